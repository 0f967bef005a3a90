"""The multi-rank commit and load at scale: format v1 against v2, against SeaweedFS.

Simulates N ranks (threads, 8 to a node) that each write a small shard and its completion
record and commit through the real ``MultiRankCommit`` (see ``tierckpt/bench/scale.py``),
behind the fault proxy, which counts the requests by type and key prefix. Reports per
configuration: requests per checkpoint by type, the largest share of writes on one prefix,
rank 0's commit latency after the last record landed (median of ``--repeats``), and manifest
GETs per load (read once per node vs. by every rank).

    python benchmarks/bench_scale.py                      # N = 64, 256, 1024; 5 repeats
    python benchmarks/bench_scale.py --quick              # N = 64, 1 repeat (< 1 min)
    python benchmarks/bench_scale.py --json scale.json
    python benchmarks/bench_scale.py --private            # private (RAM) tiers: store calls

``--private`` simulates the private-tier commit instead (``tierckpt/bench/private_scale.py``:
no S3, real ``TCPStore`` servers for rank 0's store and each node's): calls on rank 0's store
per checkpoint, one store for all ranks (before) against one store per node.

Targets at N = 1024 (format v2): commit <= 1 s after the last record (median of 5), zero
record GETs, no prefix with more than 2/prefixes + 1 % of the writes, one manifest GET per
simulated node at load. The exit status is 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid

from tierckpt.bench.private_scale import PrivateScaleResult, run_private_scale
from tierckpt.bench.scale import ScaleResult, request_costs, run_scale
from tierckpt.testing.s3servers import start_seaweedfs


def check(r: ScaleResult) -> list[str]:
    """The targets a v2 run at N >= 1024 misses."""
    missed = []
    if r.commit_latency_median > 1.0:
        missed.append(f"commit {r.commit_latency_median:.2f} s after the last record > 1 s")
    if r.record_gets:
        missed.append(f"{r.record_gets} record GETs")
    bound = 2 / r.prefixes + 0.01
    if r.max_write_share > bound:
        missed.append(f"prefix {r.max_write_prefix} has {r.max_write_share:.2%} > {bound:.2%}")
    if r.manifest_gets_per_node_load != r.nodes:
        missed.append(f"{r.manifest_gets_per_node_load} manifest GETs for {r.nodes} nodes")
    return missed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--ranks", default="64,256,1024", help="comma-separated N")
    ap.add_argument("--prefixes", type=int, default=256, help="hashed prefixes of format v2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="N = 64, 1 repeat")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--costs", action="store_true", help="also time one request of each kind")
    ap.add_argument("--private", action="store_true", help="the private-tier commit instead")
    args = ap.parse_args(argv)
    sizes = [64] if args.quick else [int(x) for x in args.ranks.split(",")]
    repeats = 1 if args.quick else args.repeats
    if args.private:
        return private(sizes, repeats, args.json)
    results: list[ScaleResult] = []
    costs: dict[str, float] = {}
    missed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        server = start_seaweedfs(tmp)
        os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
        os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
        os.environ["AWS_DEFAULT_REGION"] = server.region
        try:
            for n in sizes:
                for prefixes in (0, args.prefixes):
                    bucket = f"scale-{uuid.uuid4().hex[:10]}"
                    server.admin.create_bucket(Bucket=bucket)
                    print(f"N={n} format v{2 if prefixes else 1} ({prefixes} prefixes)", flush=True)
                    r = run_scale(
                        server.endpoint_url,
                        bucket,
                        ranks=n,
                        prefixes=prefixes,
                        repeats=repeats,
                        log=lambda s: print(s, flush=True),
                    )
                    results.append(r)
                    if prefixes and n >= 1024:
                        missed += [f"N={n}: {m}" for m in check(r)]
            if args.costs or not args.quick:
                bucket = f"scale-{uuid.uuid4().hex[:10]}"
                server.admin.create_bucket(Bucket=bucket)
                costs = request_costs(server.endpoint_url, bucket)
                direct = request_costs(server.endpoint_url, bucket, through_proxy=False)
                print("median per request, one client: through the proxy / straight to the server")
                for kind, sec in costs.items():
                    print(f"  {kind:<30} {sec * 1000:7.1f} ms / {direct[kind] * 1000:7.1f} ms")
                costs = {**costs, **{f"{k} (direct)": v for k, v in direct.items()}}
        finally:
            server.stop()
    print()
    print(
        f"{'N':>5} {'fmt':>3} {'PUT':>5} {'GET':>5} {'HEAD':>4} {'LIST':>5} {'rec GET':>7} "
        f"{'max prefix':>10} {'commit ms (median)':>18} {'mf GET/load node':>16} "
        f"{'mf GET/load rank':>16}"
    )
    for r in results:
        q = r.requests
        print(
            f"{r.ranks:>5} {'v2' if r.prefixes else 'v1':>3} {q.get('PUT', 0):>5} "
            f"{q.get('GET', 0):>5} {q.get('HEAD', 0):>4} {q.get('LIST', 0):>5} "
            f"{r.record_gets:>7} {r.max_write_share:>9.1%} "
            f"{r.commit_latency_median * 1000:>18.0f} {r.manifest_gets_per_node_load:>16} "
            f"{r.manifest_gets_per_rank_load:>16}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [r.as_dict() for r in results], "costs": costs}, f, indent=1)
    for m in missed:
        print("MISSED:", m)
    return 1 if missed else 0


def private(sizes: list[int], repeats: int, json_path: str | None) -> int:
    """The private-tier commit, both layouts at each N (8 ranks a node)."""
    runs: list[PrivateScaleResult] = []
    for n in sizes:
        for layout in ("flat", "per_node"):
            print(f"N={n} private tier, {layout}", flush=True)
            runs.append(
                run_private_scale(
                    ranks=n, layout=layout, repeats=repeats, log=lambda s: print(s, flush=True)
                )
            )
    print()
    print(
        f"{'N':>5} {'layout':>8} {'calls':>6} {'set':>5} {'get':>5} {'check':>6} "
        f"{'widest':>6} {'MB out':>7} {'rank 0 ms':>9} {'all ms':>7}  (medians)"
    )
    for r in runs:
        d = r.as_dict()
        q = r.global_ops
        print(
            f"{r.ranks:>5} {r.layout:>8} {d['global_ops_total']:>6} {q.get('set', 0):>5} "
            f"{q.get('get', 0):>5} {q.get('check', 0):>6} {r.widest_check:>6} "
            f"{r.global_bytes_out / 1e6:>7.2f} {d['commit_median_s'] * 1000:>9.0f} "
            f"{d['everyone_median_s'] * 1000:>7.0f}"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"private": [r.as_dict() for r in runs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
