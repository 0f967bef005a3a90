"""Capture with a slow S3 tier: fed from the host arena, or copying from the local tier.

A state larger than the arena, a local tier and an S3 tier (SeaweedFS on 127.0.0.1, its own
process). For each variant, one long-lived Checkpointer, one warm-up save, then the median of
``--runs`` saves of: *captured* (``save()`` to ``wait_captured()``: what training waits for
with ``ck.guard()``), committed on local, committed on S3.

    python benchmarks/bench_follow.py [--size 512MiB] [--arena 128MiB] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_s3 import _state_of, parse_size

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.testing.s3servers import start_seaweedfs

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=512 * MiB)
    ap.add_argument("--arena", type=parse_size, default=128 * MiB)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--codec", default="raw", help="the S3 tier's codec (raw: a pure link test)")
    ap.add_argument("--dir", default=None, help="folder for the local tier (default: temp)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    state = _state_of(args.size)
    results: dict[str, Any] = {"size": args.size, "arena": args.arena, "codec": args.codec}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-follow-") as tmp:
        server = start_seaweedfs(Path(tmp) / "weed")
        try:
            client = server.client(max_pool_connections=16)
            client.create_bucket(Bucket="bench")
            step = 0
            for variant in ("arena", "follow"):
                tiers = [
                    LocalTier(Path(tmp) / f"local-{variant}", keep_last=1),
                    S3Tier(
                        f"s3://bench/{variant}",
                        client=client,
                        codec=args.codec,
                        keep_last=1,
                        conditional_put=False,
                        source="local" if variant == "follow" else None,
                    ),
                ]
                rows = []
                with Checkpointer(tiers, host_buffer_bytes=args.arena) as ck:
                    for i in range(args.runs + 1):
                        step += 1
                        t0 = time.perf_counter()
                        h = ck.save(state, step=step)
                        ck.wait_captured()
                        captured = time.perf_counter() - t0
                        res = h.result()
                        if i:  # the first save warms the arena and the connections
                            rows.append(
                                {
                                    "captured_s": captured,
                                    "local_s": res["local"].seconds,
                                    "s3_s": res["s3"].seconds,
                                }
                            )
                results[variant] = {
                    k: statistics.median(r[k] for r in rows)
                    for k in ("captured_s", "local_s", "s3_s")
                }
                results[variant]["runs"] = rows
        finally:
            server.stop()
    print(
        f"state {args.size / MiB:.0f} MiB, arena {args.arena / MiB:.0f} MiB, S3 codec "
        f"{args.codec}, median of {args.runs}"
    )
    print(f"{'S3 fed from':<22}{'captured':>10}{'local commit':>14}{'S3 commit':>11}")
    for variant, label in (("arena", "host arena"), ("follow", "local file (source=)")):
        r = results[variant]
        print(f"{label:<22}{r['captured_s']:>9.2f}s{r['local_s']:>13.2f}s{r['s3_s']:>10.2f}s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
