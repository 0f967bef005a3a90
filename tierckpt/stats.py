"""Observability: per-checkpoint, per-tier figures and commit callbacks.

Every time a checkpoint commits on a tier, the pipeline hands the :class:`TierResult` to a
:class:`StatsRecorder`. The recorder keeps a bounded history (``Checkpointer.stats()``) and
calls the user's callbacks (``Checkpointer(on_commit=fn)`` or ``ck.add_callback(fn)``), so the
figures can go to TensorBoard, Prometheus or a log without polling::

    writer = torch.utils.tensorboard.SummaryWriter()

    def to_tensorboard(r: tierckpt.TierResult) -> None:
        writer.add_scalar(f"ckpt/{r.tier}/seconds", r.seconds, r.step)
        writer.add_scalar(f"ckpt/{r.tier}/ratio", r.ratio, r.step)

    ck = tierckpt.Checkpointer(tiers, on_commit=to_tensorboard)

Callbacks run on the tier's background thread right after the commit: keep them short. An
exception in a callback is logged and never fails the checkpoint.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierckpt.handle import SaveHandle, TierResult

__all__ = ["CommitCallback", "CommitStats", "StatsRecorder"]

log = logging.getLogger("tierckpt")

#: a commit callback receives the tier's result
CommitCallback = Callable[[TierResult], Any]


@dataclass(frozen=True, slots=True)
class CommitStats:
    """Figures of one checkpoint committed on one tier.

    ``seconds`` runs from ``save()`` to the commit on this tier; ``blocked_seconds`` is how
    long training waited for this save (inside ``save()`` plus waiting for its capture before
    the optimizer step). ``ratio`` is raw bytes / stored bytes.
    """

    step: int
    tier: str
    raw_bytes: int
    stored_bytes: int
    seconds: float
    blocked_seconds: float
    codec: str
    committed_at: float  # wall clock (time.time())

    @property
    def gbps(self) -> float:
        """Raw gigabytes per second from ``save()`` to this tier's commit."""
        return self.raw_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        """A flat dict (for JSON lines, CSV, metrics systems)."""
        return {
            "step": self.step,
            "tier": self.tier,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "seconds": self.seconds,
            "gbps": self.gbps,
            "ratio": self.ratio,
            "blocked_seconds": self.blocked_seconds,
            "codec": self.codec,
            "committed_at": self.committed_at,
        }


class StatsRecorder:
    """A bounded history of commits plus the callbacks to notify; thread-safe."""

    def __init__(self, history: int = 1000) -> None:
        if history < 1:
            raise ValueError(f"stats history must be >= 1, got {history}")
        self._lock = threading.Lock()
        self._entries: collections.deque[tuple[TierResult, SaveHandle, float]] = (
            collections.deque(maxlen=history)
        )
        self._callbacks: list[CommitCallback] = []

    def add_callback(self, fn: CommitCallback) -> CommitCallback:
        if not callable(fn):
            raise TypeError(f"a commit callback must be callable, got {fn!r}")
        with self._lock:
            self._callbacks.append(fn)
        return fn

    def remove_callback(self, fn: CommitCallback) -> None:
        with self._lock:
            self._callbacks = [c for c in self._callbacks if c is not fn]

    def record(self, result: TierResult, handle: SaveHandle) -> None:
        """Called by the pipeline once per commit, before the handle reports the tier done."""
        with self._lock:
            self._entries.append((result, handle, time.time()))
            callbacks = list(self._callbacks)
        for fn in callbacks:
            try:
                fn(result)
            except Exception:  # a metrics sink must never fail a checkpoint
                log.exception("commit callback %r failed for step %d on tier %s",
                              fn, result.step, result.tier)

    def stats(self) -> list[CommitStats]:
        """The recorded commits, oldest first."""
        with self._lock:
            entries = list(self._entries)
        # blocked time is read now: it is final once the save's capture is done
        return [
            CommitStats(
                step=r.step,
                tier=r.tier,
                raw_bytes=r.raw_bytes,
                stored_bytes=r.stored_bytes,
                seconds=r.seconds,
                blocked_seconds=h.blocked_seconds,
                codec=r.codec,
                committed_at=at,
            )
            for r, h, at in entries
        ]
