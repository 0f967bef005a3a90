"""The DCP layer against DCP's own storage on the same run: ``dcp.save`` / ``dcp.load`` through
``tierckpt.dcp.TierWriter`` / ``TierReader`` on a local tier against ``FileSystemWriter`` /
``FileSystemReader`` on the same disk, single process (``no_dist=True``).

    python benchmarks/bench_dcp_layer.py                      # small and medium, median of 9
    python benchmarks/bench_dcp_layer.py --sizes small --runs 7 --profile tier-new
    python benchmarks/bench_dcp_layer.py --json out.json

States: ``small`` is 100 float32 tensors of 100 KiB (10 MiB), ``medium`` 64 of 4 MiB
(256 MiB). Contenders, interleaved round by round (the order rotates each round) after one
warm-up round, so drift on a shared machine hits all alike:

    fs          ``FileSystemWriter(dir)`` per save (DCP's idiom; fsyncs its files)
    tier-new    a new ``TierWriter`` per save, never closed (DCP's idiom)
    tier-reuse  one ``TierWriter`` for every save of the run (the documented usage)

and for loads ``fs`` (``FileSystemReader``) and ``tier`` (a new ``TierReader``). Every save
writes a new step; loads read the step saved last. Reported: median milliseconds per call.
``--profile NAME`` runs cProfile over NAME's saves (or loads, for a reader) and prints the
top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from tierckpt import LocalTier
from tierckpt.dcp import TierReader, TierWriter

SIZES = {"tiny": (10, 4096), "small": (100, 100 * 1024), "medium": (64, 4 * 2**20)}
SAVERS = ["fs", "tier-new", "tier-reuse"]
LOADERS = ["fs", "tier"]


def make_state(n: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.rand(nbytes // 4, generator=g) for i in range(n)}


class Run:
    """One state size: every contender's folder and counters."""

    def __init__(self, root: Path, state: dict[str, torch.Tensor]) -> None:
        self.root = root
        self.state = state
        self.step = itertools.count(1)
        self.last: dict[str, int] = {}
        self.reuse = TierWriter([LocalTier(root / "tier-reuse", keep_last=3)])
        self.target = {k: torch.empty_like(v) for k, v in state.items()}

    def save(self, name: str) -> None:
        step = next(self.step)
        if name == "fs":
            w: Any = dcp.FileSystemWriter(str(self.root / "fs" / f"step-{step}"))
            dcp.save(self.state, storage_writer=w, no_dist=True)
        elif name == "tier-new":
            w = TierWriter([LocalTier(self.root / "tier-new", keep_last=3)])
            dcp.save(self.state, storage_writer=w, checkpoint_id=step, no_dist=True)
        else:
            dcp.save(self.state, storage_writer=self.reuse, checkpoint_id=step, no_dist=True)
        self.last[name] = step

    def load(self, name: str) -> None:
        if name == "fs":
            r: Any = dcp.FileSystemReader(str(self.root / "fs" / f"step-{self.last['fs']}"))
            dcp.load(self.target, storage_reader=r, no_dist=True)
        else:
            r = TierReader([LocalTier(self.root / "tier-new", keep_last=3)], self.last["tier-new"])
            dcp.load(self.target, storage_reader=r, no_dist=True)

    def close(self) -> None:
        self.reuse.close()


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(size: str, runs: int, root: Path, profile: str | None) -> dict[str, Any]:
    n, nbytes = SIZES[size]
    run = Run(root / size, make_state(n, nbytes))
    ops = [("save", s) for s in SAVERS] + [("load", r) for r in LOADERS]
    times: dict[str, list[float]] = {f"{op} {name}": [] for op, name in ops}
    try:
        for name in SAVERS:  # warm-up: imports, first pipeline, page cache
            run.save(name)
        for name in LOADERS:
            run.load(name)
        for r in range(runs):
            order = ops[r % len(ops) :] + ops[: r % len(ops)]
            for op, name in order:
                fn = (
                    (lambda nm=name: run.save(nm))
                    if op == "save"
                    else (lambda nm=name: run.load(nm))
                )
                times[f"{op} {name}"].append(_timed(fn))
        if profile is not None:
            op = "save" if profile in SAVERS else "load"
            name = profile if op == "save" else profile.removeprefix("load-")
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(runs):
                run.save(name) if op == "save" else run.load(name)
            prof.disable()
            print(f"--- cProfile: {op} {name}, {size}, {runs} calls ---")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    finally:
        run.close()
    return {
        "size": size,
        "tensors": n,
        "bytes": n * nbytes,
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "all_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="small,medium")
    ap.add_argument("--runs", type=int, default=9)
    ap.add_argument("--root", default=None, help="folder on the disk to measure (default: tmp)")
    ap.add_argument(
        "--profile",
        default=None,
        help="a saver (fs, tier-new, tier-reuse) or "
        "load-fs / load-tier: cProfile its calls after the measurement",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.root) as tmp:
        for size in args.sizes.split(","):
            res = measure(size, args.runs, Path(tmp), args.profile)
            out.append(res)
            mib = res["bytes"] / 2**20
            print(f"{size}: {res['tensors']} tensors, {mib:.0f} MiB, median of {args.runs}")
            for k, v in res["median_ms"].items():
                print(f"  {k:<16} {v:8.1f} ms")
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
        "results": out,
    }
    print(f"load average {info['loadavg']}")
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
