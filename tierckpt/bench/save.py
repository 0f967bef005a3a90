"""One contender at one size, in its own process: timed saves (immediate and lazy), the raw
disk baseline, peak memory, and for tierckpt a per-stage breakdown of one save."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.config import LABELS, BenchConfig, MiB
from tierckpt.bench.contenders import Contender, Tierckpt, make_contender
from tierckpt.bench.probes import MemorySampler, medians, raw_write, simulated_compute
from tierckpt.bench.state import make_state


def timed_save(
    c: Contender, state: dict[str, Any], step: int, *, lazy: bool, cfg: BenchConfig
) -> dict[str, float]:
    """Run one save; every time is measured from the start of the save call."""
    t0 = time.perf_counter()
    c.start(state, step)
    t1 = time.perf_counter()
    rec = {"returns_s": t1 - t0}
    if lazy:
        simulated_compute(cfg.compute_s, cfg.compute)
        t2 = time.perf_counter()
        c.wait_staged()
        t3 = time.perf_counter()
        rec["lazy_wait_s"] = t3 - t2
        rec["lazy_blocked_s"] = (t1 - t0) + (t3 - t2)
    else:
        c.wait_staged()
        rec["staged_s"] = time.perf_counter() - t0
    c.wait_committed()
    rec["committed_s"] = time.perf_counter() - t0
    rec.update(c.milestones(t0))
    return rec


# -- time breakdown of one tierckpt save ------------------------------------------------------


@contextlib.contextmanager
def _instrumented(acc: dict[str, float]) -> Iterator[None]:
    """Wrap tierckpt's internal stages with timers (for one diagnostic save only)."""
    import tierckpt.arena as arena_mod
    import tierckpt.backends.local as local_mod
    import tierckpt.checkpointer as ck_mod
    import tierckpt.pipeline as pl_mod

    lock = threading.Lock()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, key: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        saved.append((owner, attr, fn))
        setattr(owner, attr, timed)

    try:
        wrap(ck_mod, "build_plan", "plan_s")
        wrap(pl_mod, "copy_chunk", "copy_s")
        wrap(pl_mod, "_encode", "checksum_encode_s")
        wrap(arena_mod.HostArena, "acquire", "arena_wait_s")
        wrap(local_mod._LocalWriter, "write", "pwrite_s")
        wrap(local_mod._LocalWriter, "commit", "fsync_rename_s")
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def tierckpt_breakdown(c: Tierckpt, state: dict[str, Any], step: int) -> dict[str, float]:
    """Per-stage busy time of one immediate save, plus plan building timed on its own."""
    from tierckpt.objects import encode_tree
    from tierckpt.plan import build_plan

    plan_times, walk_times, sig_times = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        build_plan(state, c.ck.chunk_bytes)
        t1 = time.perf_counter()
        leaves: list[torch.Tensor] = []

        def on_tensor(t: torch.Tensor, _path: object, leaves: list[torch.Tensor] = leaves) -> int:
            leaves.append(t)
            return len(leaves) - 1

        encode_tree(state, on_tensor)
        t2 = time.perf_counter()
        # what a plan cache would have to compare per save: storage, offset, shape, stride, dtype
        sig = [
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            for t in leaves
        ]
        t3 = time.perf_counter()
        del sig
        plan_times.append(t1 - t0)
        walk_times.append(t2 - t1)
        sig_times.append(t3 - t2)
    acc: dict[str, float] = {}
    try:
        with _instrumented(acc):
            rec = timed_save(c, state, step, lazy=False, cfg=c.cfg)
    except AttributeError as exc:  # internals moved: say so instead of failing the bench
        return {"error": f"breakdown unavailable: {exc}"}  # type: ignore[dict-item]
    c.cleanup()
    return {
        **acc,
        **rec,
        "plan_only_median_s": statistics.median(plan_times),
        "tree_walk_median_s": statistics.median(walk_times),
        "signature_median_s": statistics.median(sig_times),
    }


# -- the save worker (one subprocess per size and contender) ---------------------------------


def save_worker(name: str, gib: float, directory: str, cfg: BenchConfig) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=UserWarning)
    t_build = time.perf_counter()
    state, info = make_state(gib, cfg.seed)
    build_s = time.perf_counter() - t_build
    out = Path(directory) / f"{name}-{gib:g}"
    raw_buf = torch.empty(64 * MiB, dtype=torch.uint8).fill_(7)
    raw_view = memoryview(raw_buf.numpy())  # type: ignore[arg-type]
    sampler = MemorySampler()
    base_mem = sampler.current()
    sampler.start()
    c = make_contender(name, out, cfg)
    records: list[dict[str, float]] = []
    raw: list[dict[str, float]] = []
    warm: list[dict[str, float]] = []
    step = 0
    try:
        for _ in range(cfg.warmup):
            warm.append(timed_save(c, state, step, lazy=False, cfg=cfg))
            c.cleanup()
            step += 1
        for _ in range(cfg.runs):
            rec = timed_save(c, state, step, lazy=False, cfg=cfg)
            c.cleanup()
            step += 1
            if c.background:
                lazy = timed_save(c, state, step, lazy=True, cfg=cfg)
                c.cleanup()
                step += 1
                rec.update({k: v for k, v in lazy.items() if k.startswith("lazy")})
                rec["lazy_committed_s"] = lazy["committed_s"]
                rec["lazy_returns_s"] = lazy["returns_s"]
                if "captured_at_s" in lazy:
                    rec["lazy_captured_at_s"] = lazy["captured_at_s"]
            else:
                rec["lazy_blocked_s"] = rec["staged_s"]
            if isinstance(c, Tierckpt):
                r = raw_write(out / "raw.bin", info.nbytes, raw_view)
                raw.append(r)
                rec["raw_total_s"] = r["total_s"]
                rec["committed_over_raw"] = rec["committed_s"] / r["total_s"]
            records.append(rec)
        peak = sampler.stop()
        breakdown = (
            tierckpt_breakdown(c, state, step)
            if isinstance(c, Tierckpt) and cfg.breakdown
            else None
        )
        extra = c.extra()
    finally:
        sampler.stop()
        c.close()
        shutil.rmtree(out, ignore_errors=True)
    return {
        "contender": name,
        "label": LABELS[name],
        "gib": gib,
        "state": asdict(info),
        "state_build_s": build_s,
        "warmup": warm,
        "runs": records,
        "median": medians(records),
        "raw_write": {"runs": raw, "median": medians(raw)} if raw else None,
        "base_mem_bytes": base_mem,
        "peak_extra_bytes": peak - base_mem,
        "background_staging": c.background,
        "breakdown": breakdown,
        **extra,
    }
