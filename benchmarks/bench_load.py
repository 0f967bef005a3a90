"""Local load against a cold sequential read of the same bytes from the same disk.

    .venv/bin/python benchmarks/bench_load.py            # ~1 GiB, 5 runs
    .venv/bin/python benchmarks/bench_load.py --quick    # 0.25 GiB, 5 runs, under a minute

A synthetic training state (bf16 weights + fp32 moments, ~1,300 tensors per GiB: the
``tierckpt bench`` state) is saved once per codec (raw, planes) to a local tier on disk
(``auto`` on a local tier is raw). Each measurement runs in a fresh process that first drops
the files from the page cache (``fsync`` + ``posix_fadvise(DONTNEED)``) and runs a full garbage
collection (as ``bench_restore.py`` does: the one full collection a process owes after
``import torch`` walks ~170,000 objects, 0.25 s here, and would otherwise land in whatever
allocates next), so every variant reads from the disk: ``seq`` reads the shard files front to
back into one reused 8 MiB buffer (the disk's rate), ``fresh`` reads them front to back in
8 MiB ``readinto`` calls into fresh memory of the files' size (what a load must produce: new
memory, first-touched by the read), ``raw`` and ``planes`` are
``Checkpointer.load()`` of each codec's checkpoint (``planes``: compressed chunks, fetched in
pieces while they decode). Variants are interleaved, one warm-up round is dropped, medians are
reported against both baselines, with the CPU seconds (user + system, all threads) and the peak
RSS of the process and the load average before and after. ``--variants seq,fresh,raw`` runs a subset (the baselines always run).
``--before DIR`` also loads with another checkout's code, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VARIANTS = ("seq", "fresh", "raw", "planes")
BASELINES = ("seq", "fresh")


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def drop_cache(path: Path) -> None:
    """Evict ``path``'s files from the page cache (they are committed: fsync is a no-op)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def worker(variant: str, path: Path) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import torch  # imported before the clock starts, as by any trainer

    from tierckpt import Checkpointer, LocalTier

    drop_cache(path)
    import gc

    gc.collect()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    nbytes = 0
    if variant == "seq":
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        for f in _files(path):
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(view):
                    nbytes += n
    elif variant == "fresh":
        total = sum(f.stat().st_size for f in _files(path))
        out = torch.empty(total, dtype=torch.uint8)  # untouched pages, as a load's storages
        dest = memoryview(out.numpy())  # type: ignore[arg-type]
        for f in _files(path):
            with open(f, "rb", buffering=0) as fh:
                while n := fh.readinto(dest[nbytes : nbytes + (8 << 20)]):
                    nbytes += n
        del out, dest
    else:
        ck = Checkpointer([LocalTier(path, keep_last=None, codec=variant)])
        try:
            state = ck.load()
        finally:
            ck.close()
        nbytes = sum(f.stat().st_size for f in _files(path))
        del state
    seconds = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork + exec
    rss = next(
        int(line.split()[1]) * 1024
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    return {"variant": variant, "seconds": seconds, "cpu_s": cpu, "bytes": nbytes, "peak_rss": rss}


def save_states(root: Path, gib: float, codecs: list[str]) -> dict[str, Any]:
    from tierckpt import Checkpointer, LocalTier
    from tierckpt.bench.state import make_state

    state, info = make_state(gib)
    for codec in sorted({"raw", *codecs}):  # raw: also the baselines' bytes
        ck = Checkpointer([LocalTier(root / codec, keep_last=None, codec=codec)])
        try:
            ck.save(state, 1).result()
        finally:
            ck.close()
    return {"state_bytes": info.nbytes, "tensors": info.tensors}


def run_one(variant: str, root: Path, before: str | None) -> dict[str, Any]:
    codec, _, which = variant.partition("@")
    path = root / ("raw" if codec in BASELINES else codec)
    env = dict(os.environ)
    if which == "before" and before:
        env["PYTHONPATH"] = before
    out = subprocess.run(
        [sys.executable, __file__, "--worker", codec, "--path", str(path)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="0.25 GiB (under a minute)")
    ap.add_argument("--dir", default=None, help="where to save (on disk; default: a temp dir)")
    ap.add_argument("--json", default="benchmarks/results/bench_load.json")
    ap.add_argument(
        "--before",
        default=None,
        help="PYTHONPATH of another checkout: also load with its code (raw@before, planes@before)",
    )
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset to run")
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, Path(args.path))))
        return 0
    gib = 0.25 if args.quick else args.gib
    with tempfile.TemporaryDirectory(prefix="bench_load_", dir=args.dir or "/var/tmp") as d:
        root = Path(d)
        wanted = set(args.variants.split(",")) | set(BASELINES)
        info = save_states(root, gib, [c for c in ("raw", "planes") if c in wanted])
        variants = [v for v in VARIANTS if v in wanted]
        if args.before:
            variants += [f"{c}@before" for c in ("raw", "planes") if c in wanted]
        load_before = os.getloadavg()
        samples: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for r in range(args.runs + 1):  # round 0 warms up
            for v in variants:
                res = run_one(v, root, args.before)
                if r:
                    samples[v].append(res)
        load_after = os.getloadavg()
    seq = statistics.median(s["seconds"] for s in samples["seq"])
    fresh = statistics.median(s["seconds"] for s in samples["fresh"])
    rows = []
    for v in variants:
        secs = [s["seconds"] for s in samples[v]]
        med = statistics.median(secs)
        rows.append(
            {
                "variant": v,
                "median_s": med,
                "all_s": secs,
                "cpu_s": statistics.median(s["cpu_s"] for s in samples[v]),
                "stored_bytes": samples[v][0]["bytes"],
                "gb_per_s": info["state_bytes"] / med / 1e9,
                "vs_seq_read": seq / med,
                "vs_fresh_read": fresh / med,
                "peak_rss": max(s["peak_rss"] for s in samples[v]),
            }
        )
    print(
        f"\nlocal load, {info['state_bytes'] / 2**30:.2f} GiB, {info['tensors']} tensors, "
        f"medians of {args.runs} (cold page cache), {time.strftime('%Y-%m-%d %H:%M UTC')}, "
        f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after\n"
    )
    print(
        "| variant | median s | state GB/s | vs cold seq read (reused 8 MiB) "
        "| vs cold seq read (fresh memory) | CPU s | stored MiB | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['variant']} | {row['median_s']:.3f} | {row['gb_per_s']:.2f} | "
            f"{row['vs_seq_read']:.2f}x | {row['vs_fresh_read']:.2f}x | {row['cpu_s']:.3f} | "
            f"{row['stored_bytes'] / 2**20:.0f} | "
            f"{row['peak_rss'] / 2**20:.0f} |"
        )
    result = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "gib": gib,
        "runs": args.runs,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        **info,
        "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
