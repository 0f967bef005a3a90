"""Where SeaweedFS's CPU goes in an S3 save (issue 15): per request kind and per save.

On a small machine the S3 server is CPU-bound during a save, so the save's wall time follows
the client's CPU plus the server's. This bench attributes the server's CPU: it runs, in
interleaved rounds (the order alternating, one warm-up round), each of

- a raw obstore ``put`` of the same bytes (8 MiB parts, 8 in flight: the tier's sizing),
  overwriting one key;
- a tier save (driver obstore, codec raw) with ``keep_last=None`` and with ``keep_last=1``
  (save to commit, then the retention pass: LIST and the DeleteObjects of the previous
  checkpoint);
- each small request kind a tier save sends besides its upload, ``--repeat`` times in a row:
  the HEAD of a missing manifest, the GET of a lease-sized object, the create-only PUT of a
  manifest-sized object (``If-None-Match: *``), the LIST of the tier's prefix, and one
  DeleteObjects of a 256 MiB object (the previous checkpoint's shard; it is uploaded untimed
  before).

SeaweedFS's CPU (utime + stime of the ``weed`` process, ``/proc``) is read from a quiet server
(the bench waits until it stops using CPU) to a quiet server again, so work the server does
after answering (deleting chunks, say) counts where it belongs. For the saves it also prints
the paired difference to the raw put of the same round (mean +- standard error, median).

    python benchmarks/bench_s3_server_cpu.py --size 256MiB --runs 8

Measured on the 2-core test machine (SeaweedFS on disk, 256 MiB, 2026-12-01, other jobs
running, so wall times are loose), ``--runs 6``, medians, server CPU:

- raw obstore put 3.31 s (wall 1.91 s, client CPU 0.30 s); tier save ``keep_last=None``
  3.38 s (wall 2.02, client 0.43), ``keep_last=1`` 3.36 s (wall 2.02, client 0.42);
  paired to the raw put: +0.037 +- 0.078 s and +0.053 +- 0.109 s (an earlier run of 14
  rounds: -0.11 +- 0.16 and -0.21 +- 0.16);
- per request: HEAD 1.5 ms, GET 1.5 ms, create-only PUT 3.5 ms, LIST 6 ms, DeleteObjects of
  a 256 MiB object 10 ms (its chunks' deletion included). What a save sends besides its
  upload (HEAD, two lease GETs, the manifest PUT) is about 8 ms; its retention pass (LIST,
  two DeleteObjects) under 20 ms.

So the tier's requests cost SeaweedFS some 0.03 s per 256 MiB save, within the noise of one
save's server CPU (+-0.3 s run to run); the tier's gap to the raw put is its client CPU (the
capture's copy and xxh3, ~0.1 s, in Python threads; obstore's own threads spend the same
0.28 s for both), which on two cores slows the CPU-bound server as much.

Part sizes (raw put, 8 rounds paired to 8 MiB x 8, client + server CPU): 5 MiB x 12
+0.12 +- 0.04 s, 16 MiB x 4 +0.04 +- 0.07, 16 MiB x 8 +0.22 +- 0.07, 32 MiB x 4 +0.08 +- 0.09;
walls within +-0.2 s noise: none is better than the tier's 8 MiB x 8 here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_s3_drivers import MiB, children_cpu, make_state, parse_size

from tierckpt import Checkpointer, S3Tier
from tierckpt.testing.s3servers import REGION, start_seaweedfs

#: the server counts as quiet after this many polls in a row without CPU (s each)
QUIET_POLLS, POLL_S, QUIET_CPU_S = 3, 0.15, 0.01


def settle(limit_s: float = 10.0) -> None:
    """Wait until SeaweedFS stops using CPU (at most ``limit_s``)."""
    last, quiet, t0 = children_cpu(), 0, time.perf_counter()
    while quiet < QUIET_POLLS and time.perf_counter() - t0 < limit_s:
        time.sleep(POLL_S)
        now = children_cpu()
        quiet = quiet + 1 if now - last <= QUIET_CPU_S else 0
        last = now


def measure(fn: Callable[[], float | None], n: int = 1) -> dict[str, float]:
    """``fn`` run ``n`` times from a quiet server to a quiet server: wall (``fn``'s own seconds
    where it returns them), client CPU and server CPU, each per run."""
    settle()
    s0, c0, t0 = children_cpu(), time.process_time(), time.perf_counter()
    own = [fn() for _ in range(n)]
    wall = time.perf_counter() - t0
    c1 = time.process_time()
    settle()
    s1 = children_cpu()
    if all(isinstance(x, float) for x in own):
        wall = sum(x for x in own if x is not None)
    return {"wall": wall / n, "client": (c1 - c0) / n, "server": (s1 - s0) / n}


def cases(
    server: Any, bucket: str, size: int, repeat: int
) -> tuple[dict[str, tuple[int, Any]], list[Checkpointer]]:
    """``({name: (runs per sample, fn or (untimed preparation, fn))}, checkpointers to close)``."""
    import obstore
    from obstore.store import S3Store

    os.environ.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_DEFAULT_REGION=REGION,
    )
    state = make_state(size)
    data = b"".join(t.numpy().tobytes() for t in state.values())
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
    small = b"x" * 300  # a lease's size
    manifest = b"m" * 480  # a manifest's size
    obstore.put(store, "small/lease.json", small)
    counter = iter(range(1 << 40))
    steps = iter(range(1, 1 << 40))
    out: dict[str, tuple[int, Any]] = {}
    cks: list[Checkpointer] = []

    def raw_put() -> None:
        obstore.put(store, "raw/obstore", data, chunk_size=8 * MiB, max_concurrency=8)

    out["raw obstore put 8 MiB x 8"] = (1, raw_put)
    for keep in (None, 1):
        tier = S3Tier(
            f"s3://{bucket}/ckpt-keep-{keep}",
            endpoint_url=server.endpoint_url,
            keep_last=keep,
            codec="raw",
        )
        ck = Checkpointer([tier], host_buffer_bytes=len(data) + (256 << 20))
        ck.save(state, step=next(steps)).result()  # untimed: the lease, the store's probe
        ck.wait(retention=True)

        def save(ck: Checkpointer = ck) -> float:
            seconds = float(ck.save(state, step=next(steps)).result()["s3"].seconds)
            ck.wait(retention=True)
            return seconds

        out[f"tier save keep_last={keep}"] = (1, save)
        cks.append(ck)

    def head_missing() -> None:
        try:
            obstore.head(store, f"manifests/missing-{next(counter)}.json")
        except FileNotFoundError:
            pass

    def put_create() -> None:
        obstore.put(store, f"manifests/m-{next(counter)}.json", manifest, mode="create")

    out["HEAD (missing manifest)"] = (repeat, head_missing)
    out["GET 300 B (lease)"] = (
        repeat,
        lambda: bytes(obstore.get(store, "small/lease.json").bytes()),
    )
    out["PUT create-only 480 B (manifest)"] = (repeat, put_create)
    out["LIST the tier's prefix"] = (repeat, lambda: list(obstore.list(store, "ckpt-keep-1/")))
    big = "old/shard.tck"

    def prepare_delete() -> None:
        obstore.put(store, big, data, chunk_size=8 * MiB, max_concurrency=8)

    def delete_big() -> None:
        obstore.delete(store, [big])  # one DeleteObjects, as a retention pass sends

    out[f"DeleteObjects of a {size // MiB} MiB object"] = (1, (prepare_delete, delete_big))
    return out, cks


def se(xs: list[float]) -> float:
    return statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=256 * MiB)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20, help="small requests per sample")
    ap.add_argument("--tmpdir", default=None, help="SeaweedFS's volumes (default: system temp)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    samples: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        server = start_seaweedfs(Path(tmp) / "weed")
        try:
            bucket = "bench"
            server.admin.create_bucket(Bucket=bucket)
            c, close = cases(server, bucket, args.size, args.repeat)
            try:
                names = list(c)
                for i in range(1 + args.runs):
                    for name in names if i % 2 == 0 else names[::-1]:
                        n, fn = c[name]
                        if isinstance(fn, tuple):
                            fn[0]()
                            fn = fn[1]
                        got = measure(fn, n)
                        if i:
                            samples.setdefault(name, []).append(got)
            finally:
                for ck in close:
                    ck.close()
        finally:
            server.stop()
    raw = samples["raw obstore put 8 MiB x 8"]
    print(f"\nSeaweedFS CPU per request / save ({args.size // MiB} MiB), medians of {args.runs}")
    print(f"  {'case':36} {'wall ms':>9} {'client ms':>9} {'server ms':>9}  server - raw put")
    results: dict[str, Any] = {"size": args.size, "runs": args.runs}
    for name in [n for n in c if n in samples]:
        got = samples[name]
        med = {k: statistics.median(g[k] for g in got) for k in ("wall", "client", "server")}
        line = f"  {name:36} {med['wall'] * 1e3:9.1f} {med['client'] * 1e3:9.1f} "
        line += f"{med['server'] * 1e3:9.1f}"
        row: dict[str, Any] = {**{f"{k}_s": v for k, v in med.items()}, "samples": got}
        if name.startswith("tier"):
            d = [g["server"] - r["server"] for g, r in zip(got, raw, strict=True)]
            row["server_minus_raw_s"] = {"mean": statistics.mean(d), "se": se(d)}
            line += f"  {statistics.mean(d):+.3f} +- {se(d):.3f} s (median "
            line += f"{statistics.median(d):+.3f})"
        results[name] = row
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
