"""How ``codec="auto"`` settles on an object store, and what its restore costs once settled.

    python benchmarks/bench_auto_settle.py                 # 0.5 GiB, 4 cycles, median of 5
    python benchmarks/bench_auto_settle.py --gib 0.25 --cycles 3 --runs 3

SeaweedFS on 127.0.0.1 (volumes on this disk, not ``/dev/shm``), obstore driver. The synthetic
state is saved once raw (the reference). Then a training job's life on an ``auto`` tier:
``--cycles`` times, save the next step and load it back in the same process (each load feeds
the policy: its rate, and the link probe where it was compressed); each line shows what the
step was stored as, the load's time and what the policy knows after it. Last, the settled
policy's newest checkpoint and the raw one are each restored ``--runs`` times in fresh
processes, interleaved, the benchmark's files dropped from the page cache first (as
``bench_restore.py`` does); medians. The policy's state folder is a fresh temporary one, so
earlier runs do not count.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", default="")
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
