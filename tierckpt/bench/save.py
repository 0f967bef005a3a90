"""One contender at one size, in its own process: timed saves (immediate and lazy), the raw
disk baseline, peak memory, and for tierckpt a per-stage breakdown of one save."""

from __future__ import annotations

import shutil
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, get_args

import torch

from tierckpt.bench.config import LABELS, BenchConfig, MiB
from tierckpt.bench.contenders import Contender, Tierckpt, make_contender
from tierckpt.bench.probes import MemorySampler, medians, raw_write, simulated_compute
from tierckpt.bench.state import make_state
from tierckpt.pipeline import Stage, StageEvent

#: the pause after the raw-write baseline, before the next timed save
RAW_SETTLE_S = 1.0


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


# -- per-stage breakdown of one tierckpt save -------------------------------------------------

#: the pipeline's stages, in the order a save goes through them
STAGES: tuple[str, ...] = get_args(Stage)


@dataclass(slots=True)
class _Sum:
    seconds: float = 0.0
    nbytes: int = 0
    events: int = 0


class StageTotals:
    """A pipeline stage listener: busy seconds, bytes and events per (stage, tier)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # events arrive on several pipeline threads at once
        self._sums: dict[tuple[str, str | None], _Sum] = {}

    def __call__(self, event: StageEvent) -> None:
        with self._lock:
            s = self._sums.setdefault((event.stage, event.tier), _Sum())
            s.seconds += event.seconds
            s.nbytes += event.nbytes
            s.events += 1

    def rows(self) -> list[dict[str, Any]]:
        """One row per stage (and tier, where the stage is a tier's), in pipeline order."""
        with self._lock:
            items = sorted(
                self._sums.items(), key=lambda kv: (STAGES.index(kv[0][0]), kv[0][1] or "")
            )
        return [
            {
                "stage": stage,
                "tier": tier,
                "seconds": s.seconds,
                "nbytes": s.nbytes,
                "events": s.events,
            }
            for (stage, tier), s in items
        ]


def tierckpt_breakdown(c: Tierckpt, state: dict[str, Any], step: int) -> dict[str, Any]:
    """One more immediate save, with the busy seconds of every pipeline stage.

    The times come from the :class:`~tierckpt.pipeline.StageEvent` s the pipeline emits to a
    subscriber: capture per chunk, encode and checksum per codec, write / sync / commit per
    tier. They are summed over the threads, so stages that overlap (capture, checksum and
    write run at once) add up to more than the save took.
    """
    totals = StageTotals()
    unsubscribe = c.ck._get_pipeline().subscribe(totals)
    try:
        rec = timed_save(c, state, step, lazy=False, cfg=c.cfg)
    finally:
        unsubscribe()
    c.cleanup()
    return {**rec, "stages": totals.rows()}


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
            if isinstance(c, Tierckpt):
                # the raw baseline, then a pause before the next timed save: right after a
                # 1 GiB write + fsync, the kernel's page work slowed the next capture by ~40 ms
                # and a lazy save() call from 6 to ~25 ms here (2 cores), and DCP's rows
                # have no raw write before theirs
                r = raw_write(out / "raw.bin", info.nbytes, raw_view)
                time.sleep(RAW_SETTLE_S)
                raw.append(r)
                rec["raw_total_s"] = r["total_s"]
                rec["committed_over_raw"] = rec["committed_s"] / r["total_s"]
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
