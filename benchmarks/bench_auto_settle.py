"""How ``codec="auto"`` settles on an object store, and what its restore costs once settled.

    python benchmarks/bench_auto_settle.py                 # 0.5 GiB, 4 cycles, median of 5
    python benchmarks/bench_auto_settle.py --gib 0.25 --cycles 3 --runs 3
    python benchmarks/bench_auto_settle.py --gib 0.25 --probe-check 5   # the probe's accuracy

SeaweedFS on 127.0.0.1 (volumes on this disk, not ``/dev/shm``), obstore driver. The synthetic
state is saved once raw (the reference). Then a training job's life on an ``auto`` tier:
``--cycles`` times, save the next step and load it back in the same process (each load feeds
the policy: its rate, and the link probe where it was compressed); each line shows what the
step was stored as, the load's time and what the policy knows after it. Last, the settled
policy's newest checkpoint and the raw one are each restored ``--runs`` times in fresh
processes, interleaved, the benchmark's files dropped from the page cache first (as
``bench_restore.py`` does); medians. The policy's state folder is a fresh temporary one, so
earlier runs do not count.

``--probe-check N``: instead, N rounds (files dropped from the page cache before each load) of
a raw load of the raw checkpoint (its read rate ``R``: what the probe should measure) and a
compressed load of a planes checkpoint followed by the link probe of now and the probe of old
(16 MiB in one range per reader thread), in alternating order; each probe's rate over ``R``
of the same round, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_restore import _drop_cache  # this script's folder is on sys.path

MiB = 2**20
BUCKET = "bench-auto-settle"


def _codec_mix(endpoint: str, prefix: str, step: int) -> dict[str, int]:
    """Chunks per codec id in rank 0's shard of ``step``."""
    from collections import Counter

    from tierckpt import S3Tier
    from tierckpt.restore import read_index, read_manifest

    backend = S3Tier(f"s3://{BUCKET}/{prefix}", endpoint_url=endpoint, driver="obstore")
    b = backend.make_backend()
    try:
        index = read_index(b, read_manifest(b, step, "t").shard_for(0), "t")[0]
        return dict(Counter(index["codecs"][c.codec]["id"] for c in index["chunks"]))
    finally:
        b.close()


def worker(endpoint: str, prefix: str) -> float:
    """Restore the newest checkpoint of ``prefix`` in this (fresh) process; seconds."""
    import torch  # noqa: F401

    from tierckpt import Checkpointer, S3Tier

    tier = S3Tier(f"s3://{BUCKET}/{prefix}", endpoint_url=endpoint, driver="obstore", name=prefix)
    t0 = time.perf_counter()
    with Checkpointer([tier]) as ck:
        ck.load()
    return time.perf_counter() - t0


def _old_probe(backend: Any, name: str, pool: Any) -> float:
    """The probe of old (before 2026-12-01): 16 MiB, one contiguous range per reader thread
    into fresh memory; seconds."""
    import numpy as np

    workers = pool._max_workers
    nbytes = 16 * MiB
    step = -(-nbytes // workers)

    def one(off: int) -> None:
        out = np.empty(min(step, nbytes - off), np.uint8)
        backend.read_into(name, off, out.data)

    t0 = time.perf_counter()
    for f in [pool.submit(one, off) for off in range(0, nbytes, step)]:
        f.result()
    return time.perf_counter() - t0


def probe_check(tmp: Path, ep: str, state: Any, rounds: int) -> dict[str, Any]:
    """See the module docstring (``--probe-check``)."""
    from tierckpt import Checkpointer, S3Tier
    from tierckpt.checkpointer._auto_feedback import probe_bytes, read_probe
    from tierckpt.restore import read_manifest, read_shard

    tiers = {
        c: S3Tier(f"s3://{BUCKET}/{c}", endpoint_url=ep, driver="obstore", codec=c, name=c)
        for c in ("raw", "planes")
    }
    with Checkpointer(list(tiers.values())) as ck:
        ck.save(state, step=1).result()
    ratios: dict[str, list[float]] = {"new": [], "old": []}
    rates: dict[str, list[float]] = {"raw_load": [], "compressed_load": [], "new": [], "old": []}
    with Checkpointer([tiers["raw"]]) as ck_raw, Checkpointer([tiers["planes"]]) as ck_pl:
        for rnd in range(rounds):
            _drop_cache([tmp / "seaweedfs"])
            b = ck_raw.backend("raw")
            man = read_manifest(b, 1, "raw")
            got = read_shard(b, "raw", man, 0, ck_raw._get_read_pool())
            r = got.stored_bytes / got.read_seconds
            _drop_cache([tmp / "seaweedfs"])
            b = ck_pl.backend("planes")
            man = read_manifest(b, 1, "planes")
            pool = ck_pl._get_read_pool()
            got = read_shard(b, "planes", man, 0, pool)
            rates["compressed_load"].append(got.raw_bytes / got.read_seconds)
            ref = man.shard_for(0)
            n = probe_bytes(got.stored_bytes, ref.size)
            tier: Any = ck_pl._tiers[0]
            order = ["new", "old"] if rnd % 2 == 0 else ["old", "new"]
            for which in order:
                if which == "new":
                    bps = n / read_probe(tier, ref.file, n, pool) if n else float("nan")
                else:
                    bps = 16 * MiB / _old_probe(b, ref.file, pool)
                rates[which].append(bps)
                ratios[which].append(bps / r)
            rates["raw_load"].append(r)
            print(json.dumps({k: v[-1] / 1e9 for k, v in rates.items()}), file=sys.stderr)
    return {
        "probe_over_raw_load_median": {k: statistics.median(v) for k, v in ratios.items()},
        "probe_over_raw_load": ratios,
        "rates_gbps_median": {k: statistics.median(v) / 1e9 for k, v in rates.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default="")
    ap.add_argument("--probe-check", type=int, default=0, help="rounds of the probe check")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps({"seconds": worker(*args.worker)}))
        return 0

    from tierckpt.testing.s3servers import ACCESS_KEY, REGION, SECRET_KEY, start_seaweedfs

    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION
    )
    out: dict[str, Any] = {"gib": args.gib, "cycles": [], "date": time.strftime("%F %H:%M UTC")}
    with tempfile.TemporaryDirectory(prefix="bench-auto-", dir=os.environ.get("TMPDIR")) as t:
        tmp = Path(t)
        os.environ["TIERCKPT_AUTO_STATE_DIR"] = str(tmp / "auto-state")
        server = start_seaweedfs(tmp / "seaweedfs")
        try:
            from tierckpt import Checkpointer, S3Tier
            from tierckpt.bench.state import make_state

            ep = server.endpoint_url
            state, info = make_state(args.gib, seed=0)
            server.admin.create_bucket(Bucket=BUCKET)
            if args.probe_check:
                out["probe_check"] = probe_check(tmp, ep, state, args.probe_check)
                out["loadavg"] = os.getloadavg()
                print(json.dumps(out, indent=1))
                if args.json:
                    Path(args.json).write_text(json.dumps(out, indent=1))
                return 0
            raw = S3Tier(f"s3://{BUCKET}/raw", endpoint_url=ep, driver="obstore", codec="raw")
            with Checkpointer([raw]) as ck:
                ck.save(state, step=1).result()
            auto = S3Tier(f"s3://{BUCKET}/auto", endpoint_url=ep, driver="obstore", name="auto")
            with Checkpointer([auto]) as ck:
                policy: Any = ck._tiers[0].codec
                for step in range(1, args.cycles + 1):
                    res = ck.save(state, step=step).result()
                    mix = _codec_mix(ep, "auto", step)
                    _drop_cache([tmp / "seaweedfs"])
                    t0 = time.perf_counter()
                    ck.load()
                    seconds = time.perf_counter() - t0
                    seen = policy.describe()
                    row = {
                        "step": step,
                        "chunks": mix,
                        "stored_mib": res["auto"].stored_bytes / MiB,
                        "load_s": seconds,
                        "compress": seen["compress"],
                        "read_link_bps": seen["read_link_bps"],
                        "read_compressed_bps": seen["read_compressed_bps"],
                    }
                    out["cycles"].append(row)
                    print(json.dumps(row), file=sys.stderr)
                last = args.cycles + 1
                ck.save(state, step=last).result()
                out["settled_chunks"] = _codec_mix(ep, "auto", last)
            times: dict[str, list[float]] = {"raw": [], "auto": []}
            for _ in range(args.runs):
                for prefix in times:
                    _drop_cache([tmp / "seaweedfs"])
                    proc = subprocess.run(
                        [sys.executable, __file__, "--worker", ep, prefix],
                        capture_output=True,
                        text=True,
                        timeout=600,
                        check=True,
                    )
                    times[prefix].append(json.loads(proc.stdout.splitlines()[-1])["seconds"])
        finally:
            server.stop()
    out["times"] = times
    out["median_s"] = {k: statistics.median(v) for k, v in times.items()}
    out["loadavg"] = os.getloadavg()
    out["state_mib"] = info.nbytes / MiB
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
