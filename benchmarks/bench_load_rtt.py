"""A load's round trips (issue 15): the time to load a checkpoint from an object store whose
every request waits ``--rtt`` seconds before it is answered, as a remote region's store does.

A cloud restore of a small or medium shard is made of round trips, not bandwidth: the LIST
of the manifests, the manifest's GET, the GET of the shard file's tail (footer and index),
then the data GETs. This bench saves a state to SeaweedFS on 127.0.0.1, then loads it in
fresh processes through :class:`~tierckpt.testing.faultproxy.FaultProxy` (run in this
process), which delays every request by each ``--rtt`` in turn; with ``--before`` it also
loads with another checkout of tierckpt (its folder on ``PYTHONPATH``), interleaved, so that
two versions are compared in the same run.

    python benchmarks/bench_load_rtt.py --rtt 0,0.02 --runs 5 --before /path/to/checkout

It prints the median load time per version and delay, and the requests of one load.
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
from collections import Counter
from pathlib import Path
from typing import Any

BUCKET = "rtt"

#: the worker: one load in a fresh process (imports before the clock), its seconds on stdout
_LOAD = r"""
import json, sys, time
from tierckpt import Checkpointer, S3Tier
with Checkpointer([S3Tier(sys.argv[1], endpoint_url=sys.argv[2], name="s3")]) as ck:
    t = time.perf_counter()
    ck.load()
    print(json.dumps({"seconds": time.perf_counter() - t}))
"""


def _state(mib: float, tensors: int) -> dict[str, Any]:
    import torch

    n = max(1, int(mib * (1 << 20) / 4 / tensors))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(tensors)}


def _timeline(records: list[Any], classify: Any) -> list[dict[str, Any]]:
    """Each request of a load: its kind, object, and when (ms from the first) the proxy got
    it and when the store's answer came (after the delay: a request waits ``rtt`` first)."""
    t0 = min((r.sent for r in records), default=0.0)
    out = []
    for r in records:
        kind, _top, rel = classify(r, BUCKET)
        answered = None if r.answered is None else round((r.answered - t0) * 1000, 1)
        out.append(
            {
                "kind": kind,
                "object": rel,
                "sent_ms": round((r.sent - t0) * 1000, 1),
                "answered_ms": answered,
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt", default="0,0.02", help="seconds each request waits, comma-separated")
    ap.add_argument("--mib", type=float, default=4.0, help="state size in MiB")
    ap.add_argument("--tensors", type=int, default=200, help="tensors in the state")
    ap.add_argument("--runs", type=int, default=5, help="measured loads per version and delay")
    ap.add_argument("--before", default="", help="another checkout (a folder with tierckpt/)")
    ap.add_argument("--json", default="bench-out/load_rtt.json", help="where to write results")
    args = ap.parse_args(argv)
    rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
    here = str(Path(__file__).resolve().parent.parent)
    trees = {"this": here, **({"before": os.path.abspath(args.before)} if args.before else {})}

    from tierckpt import Checkpointer, S3Tier
    from tierckpt.bench.scale import classify
    from tierckpt.testing.faultproxy import Fault, FaultProxy
    from tierckpt.testing.s3servers import ACCESS_KEY, REGION, SECRET_KEY, start_seaweedfs

    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION
    )
    url = f"s3://{BUCKET}/run"
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-rtt-", dir=os.environ.get("TMPDIR")) as t:
        server = start_seaweedfs(Path(t) / "seaweedfs")
        try:
            server.admin.create_bucket(Bucket=BUCKET)
            with Checkpointer([S3Tier(url, endpoint_url=server.endpoint_url, name="s3")]) as ck:
                ck.save(_state(args.mib, args.tensors), step=1).result()
            with FaultProxy(server.endpoint_url) as proxy:
                requests: dict[str, list[dict[str, Any]]] = {}
                for rtt in rtts:
                    proxy.set_faults([Fault("delay", seconds=rtt)] if rtt > 0 else [])
                    for rnd in range(args.runs + 1):  # the first round warms up
                        for label, tree in trees.items():
                            proxy.requests.clear()
                            env = dict(os.environ, PYTHONPATH=tree)
                            out = subprocess.run(
                                [sys.executable, "-c", _LOAD, url, proxy.endpoint_url],
                                env=env,
                                cwd=t,  # not a checkout: ``-c`` puts the cwd first on sys.path
                                capture_output=True,
                                text=True,
                                timeout=300,
                            )
                            if out.returncode != 0:
                                raise SystemExit(f"{label}: {out.stderr.strip()[-400:]}")
                            got = json.loads(out.stdout.strip().splitlines()[-1])
                            if rnd:
                                times.setdefault(f"{label} rtt={rtt:g}", []).append(got["seconds"])
                            requests[label] = _timeline(proxy.requests, classify)
        finally:
            server.stop()
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mib": args.mib,
        "tensors": args.tensors,
        "runs": args.runs,
        "loads": {k: {"median_s": statistics.median(v), "runs_s": v} for k, v in times.items()},
        "requests": requests,
    }
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(results, indent=2))
    print(f"load of {args.mib:g} MiB in {args.tensors} tensors, medians of {args.runs}")
    for k, v in results["loads"].items():
        print(f"  {k:24s} {v['median_s'] * 1000:8.1f} ms")
    for label, reqs in requests.items():
        kinds = Counter(r["kind"] for r in reqs)
        print(f"  requests of the last load ({label}, rtt={rtts[-1]:g}): {dict(kinds)}")
        for r in reqs:
            print(
                f"    {r['kind']} {r['object']}: sent +{r['sent_ms']} ms, "
                f"answered +{r['answered_ms']} ms"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
