"""The two S3 drivers of an S3 tier against the raw clients, on SeaweedFS (issue 15).

One state of ``--size`` bytes of fp32 tensors is saved and restored through a Checkpointer with
one S3 tier per driver (``driver="obstore"``, the default, and ``driver="boto3"``), each with
the tier's defaults (parts sized per shard, the node's connection share), and the same number
of bytes is uploaded and read back by the raw clients: boto3's TransferManager
(``upload_fileobj`` / ``download_fileobj``, 8 MiB parts, 8 threads), obstore (``put`` in
8 MiB parts, 8 in flight; ``get_ranges`` of 8 MiB ranges, 8 at a time, into memory) and, where
importable, s3torchconnector (its writer; one streamed GET). Each case's wall time and this
process's CPU time (the client's: SeaweedFS is another process). Rounds are interleaved (each
round runs every case once, the order alternating), one warm-up round, then the median of
``--runs``.

    python benchmarks/bench_s3_drivers.py --size 256MiB --runs 5 --json out.json

SeaweedFS runs as its own process with its volumes on disk (``--tmpdir``, default the system's
temporary folder, not ``/dev/shm``).
"""

from __future__ import annotations

import argparse
import io
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

from tierckpt import Checkpointer, S3Tier
from tierckpt.testing.s3servers import REGION, S3Server, start_seaweedfs

MiB = 2**20
PART = 8 * MiB
THREADS = 8


def parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def make_state(size: int) -> dict[str, torch.Tensor]:
    """About ``size`` bytes as fp32 tensors of mixed sizes (a model's shapes, roughly)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    sizes = [16 * MiB, 4 * MiB, 1 * MiB, 256 * 1024]
    total, i = 0, 0
    while total < size:
        n = min(sizes[i % len(sizes)], size - total) // 4
        out[f"t{i}"] = torch.randn(n, generator=gen)
        total += n * 4
        i += 1
    return out


def cases(server: S3Server, bucket: str, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """``{"save": {name: fn}, "restore": {name: fn}}``: each fn returns its seconds."""
    import obstore
    from boto3.s3.transfer import TransferConfig
    from obstore.store import S3Store

    # the tiers and s3torchconnector find the server's keys where every AWS client looks
    os.environ.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_DEFAULT_REGION=REGION,
    )
    data = b"".join(t.numpy().tobytes() for t in state.values())
    size = len(data)
    client = server.client(max_pool_connections=THREADS + 4, tcp_keepalive=True)
    transfer = TransferConfig(
        multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS
    )
    store = S3Store(
        bucket,
        config={
            "endpoint": server.endpoint_url,
            "region": REGION,
            "access_key_id": server.access_key,
            "secret_access_key": server.secret_key,
        },
        client_options={"allow_http": True},
    )
    sink = bytearray(size)
    save: dict[str, Callable[[], float]] = {}
    restore: dict[str, Callable[[], float]] = {}

    def wall(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    save["raw boto3 (TransferManager)"] = wall(
        lambda: client.upload_fileobj(io.BytesIO(data), bucket, "raw/boto3", Config=transfer)
    )
    save["raw obstore (put)"] = wall(
        lambda: obstore.put(store, "raw/obstore", data, chunk_size=PART, max_concurrency=THREADS)
    )

    def ranged_get() -> None:
        starts = list(range(0, size, PART))
        for i in range(0, len(starts), THREADS):
            batch = starts[i : i + THREADS]
            lengths = [min(PART, size - s) for s in batch]
            got = obstore.get_ranges(store, "raw/obstore", starts=batch, lengths=lengths)
            for s, part in zip(batch, got, strict=True):
                sink[s : s + len(part)] = memoryview(part)

    restore["raw boto3 (TransferManager)"] = wall(
        lambda: client.download_fileobj(bucket, "raw/boto3", io.BytesIO(), Config=transfer)
    )
    restore["raw obstore (get_ranges)"] = wall(ranged_get)
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        s3t = S3Client(
            REGION,
            endpoint=server.endpoint_url,
            s3client_config=S3ClientConfig(force_path_style=True, part_size=PART),
        )

        def s3t_put() -> None:
            writer = s3t.put_object(bucket, "raw/s3t")
            writer.write(data)
            writer.close()

        def s3t_get() -> None:
            reader = s3t.get_object(bucket, "raw/s3t")
            n = reader.readinto(memoryview(sink))
            assert n == size, n

        save["raw s3torchconnector"] = wall(s3t_put)
        restore["raw s3torchconnector"] = wall(s3t_get)
    except ImportError:
        pass

    steps = iter(range(1, 1 << 30))
    cks: dict[str, Checkpointer] = {}
    for driver in ("obstore", "boto3"):
        tier = S3Tier(
            f"s3://{bucket}/ckpt-{driver}",
            driver=driver,
            endpoint_url=server.endpoint_url,
            keep_last=1,
            codec="raw",
        )
        ck = Checkpointer([tier], host_buffer_bytes=size + (256 << 20))
        cks[driver] = ck

        def ck_save(ck: Checkpointer = ck) -> float:
            return float(ck.save(state, step=next(steps)).result()["s3"].seconds)

        save[f"tierckpt driver={driver}"] = ck_save
        restore[f"tierckpt driver={driver}"] = wall(lambda ck=ck: ck.load())
    return {"save": save, "restore": restore, "close": [*cks.values()], "size": size}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=256 * MiB)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tmpdir", default=None, help="SeaweedFS's volumes (default: system temp)")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kinds", default="save,restore", help="what to run: save, restore or both (default)"
    )
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        server = start_seaweedfs(Path(tmp) / "weed")
        try:
            bucket = "bench"
            server.admin.create_bucket(Bucket=bucket)
            c = cases(server, bucket, make_state(args.size))
            kinds = [k for k in ("save", "restore") if k in args.kinds.split(",")]
            times: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
            cpu: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}
            for i in range(args.warmup + args.runs):
                for kind in kinds:
                    items = list(c[kind].items())
                    for name, fn in items if i % 2 == 0 else items[::-1]:
                        c0 = time.process_time()  # this process's CPU: the client's
                        t = fn()
                        spent = time.process_time() - c0
                        if i >= args.warmup:
                            times[kind].setdefault(name, []).append(t)
                            cpu[kind].setdefault(name, []).append(spent)
            for ck in c["close"]:
                ck.close()
        finally:
            server.stop()
    size = c["size"]
    results: dict[str, Any] = {"size": size, "runs": args.runs, "python": sys.version.split()[0]}
    for kind, by in times.items():
        med = {name: statistics.median(ts) for name, ts in by.items()}
        best_raw = min(t for name, t in med.items() if name.startswith("raw"))
        results[kind] = {
            name: {
                "median_s": med[name],
                "gb_per_s": size / 1e9 / med[name],
                "speed_vs_best_raw": best_raw / med[name],
                "client_cpu_s": statistics.median(cpu[kind][name]),
                "seconds": ts,
            }
            for name, ts in by.items()
        }
        print(f"\n{kind} of {size / MiB:.0f} MiB, medians of {args.runs} (SeaweedFS, 127.0.0.1)")
        print(f"  {'client':34} {'median s':>9} {'GB/s':>6} {'x best raw':>10} {'CPU s':>6}")
        for name, row in results[kind].items():
            print(
                f"  {name:34} {row['median_s']:9.3f} {row['gb_per_s']:6.2f} "
                f"{row['speed_vs_best_raw']:10.2f} {row['client_cpu_s']:6.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
