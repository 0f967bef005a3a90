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

Failures reach callbacks too: an *event* callback (``Checkpointer(on_event=fn)`` or
``ck.add_event_callback(fn)``) receives a :class:`CheckpointEvent` for every outcome of every
tier's copy: ``committed``, ``failed``, ``skipped`` (a follower more than ``max_behind``
behind), ``deadline`` (given up past ``save_deadline``), and ``save_skipped`` for a whole save
skipped by ``on_busy="skip"``. ``ck.stats(failures=True)`` lists the failures beside the
commits. Ready-made sinks (TensorBoard, Lightning and Hugging Face loggers, Prometheus text)
are in :mod:`tierckpt.integrations.sinks`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import CopySkipped, SaveDeadlineExceeded
from tierckpt.handle import SaveHandle, TierResult

__all__ = [
    "EVENT_KINDS",
    "CheckpointEvent",
    "CommitCallback",
    "CommitStats",
    "EventCallback",
    "StatsRecorder",
    "outcome_of",
]

log = logging.getLogger("tierckpt")

#: a commit callback receives the tier's result
CommitCallback = Callable[[TierResult], Any]

#: what can happen to a save on a tier (and ``save_skipped``: to a whole save)
EVENT_KINDS = ("committed", "failed", "skipped", "deadline", "save_skipped")


def outcome_of(error: BaseException) -> str:
    """The event kind of a tier's copy that ended with ``error``."""
    if isinstance(error, CopySkipped):
        return "skipped"
    if isinstance(error, SaveDeadlineExceeded):
        return "deadline"
    return "failed"


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    """One outcome of one save on one tier (``tier`` is ``""`` for ``save_skipped``).

    ``kind`` is one of :data:`EVENT_KINDS`; ``result`` is the :class:`TierResult` of a
    commit; ``error`` the message (and ``error_type`` the class name) of a failure, skip or
    give-up. ``blocked_seconds``: how long training had waited for this save so far.
    """

    kind: str
    step: int
    tier: str
    timeline: int = 0
    result: TierResult | None = None
    error: str | None = None
    error_type: str | None = None
    blocked_seconds: float = 0.0
    at: float = 0.0  # wall clock (time.time())

    @property
    def ok(self) -> bool:
        return self.kind == "committed"

    def as_dict(self) -> dict[str, Any]:
        """A flat dict (for JSON lines and metrics systems)."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "step": self.step,
            "tier": self.tier,
            "timeline": self.timeline,
            "blocked_seconds": self.blocked_seconds,
            "at": self.at,
            "error": self.error,
            "error_type": self.error_type,
        }
        if self.result is not None:
            r = self.result
            out.update(
                raw_bytes=r.raw_bytes,
                stored_bytes=r.stored_bytes,
                seconds=r.seconds,
                gbps=r.gbps,
                ratio=r.ratio,
                codec=r.codec,
            )
        return out


#: an event callback receives every :class:`CheckpointEvent`
EventCallback = Callable[[CheckpointEvent], Any]


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
    #: ``committed``, or (with ``stats(failures=True)``) ``failed`` / ``skipped`` /
    #: ``deadline`` / ``save_skipped``; ``error`` says why
    outcome: str = "committed"
    error: str | None = None

    @property
    def gbps(self) -> float:
        """Raw gigabytes per second from ``save()`` to this tier's commit."""
        return self.raw_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def as_dict(self) -> dict[str, Any]:
        """A flat dict (for JSON lines, CSV, metrics systems); ``outcome`` and ``error`` only
        for a failure (a commit's keys stay what they were)."""
        out: dict[str, Any] = {
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
        if self.outcome != "committed":
            out.update(outcome=self.outcome, error=self.error)
        return out


class StatsRecorder:
    """A bounded history of commits plus the callbacks to notify; thread-safe."""

    def __init__(self, history: int = 1000) -> None:
        if history < 1:
            raise ValueError(f"stats history must be >= 1, got {history}")
        self._lock = threading.Lock()
        # the handle by weak reference (its blocked time is read at stats()), with that time as
        # it was at the commit for a handle already gone: a handle holds its save's errors,
        # whose tracebacks held the whole save job, for each of the last ``history`` commits
        self._entries: collections.deque[
            tuple[TierResult, weakref.ref[SaveHandle], float, float]
        ] = collections.deque(maxlen=history)
        self._callbacks: list[CommitCallback] = []
        self._event_callbacks: list[EventCallback] = []
        #: failures, skips and give-ups (the commits are in _entries)
        self._failures: collections.deque[CheckpointEvent] = collections.deque(maxlen=history)

    def add_callback(self, fn: CommitCallback) -> CommitCallback:
        if not callable(fn):
            raise TypeError(f"a commit callback must be callable, got {fn!r}")
        with self._lock:
            self._callbacks.append(fn)
        return fn

    def remove_callback(self, fn: CommitCallback) -> None:
        with self._lock:
            self._callbacks = [c for c in self._callbacks if c is not fn]

    def add_event_callback(self, fn: EventCallback) -> EventCallback:
        if not callable(fn):
            raise TypeError(f"an event callback must be callable, got {fn!r}")
        with self._lock:
            self._event_callbacks.append(fn)
        return fn

    def remove_event_callback(self, fn: EventCallback) -> None:
        with self._lock:
            self._event_callbacks = [c for c in self._event_callbacks if c is not fn]

    def record(self, result: TierResult, handle: SaveHandle) -> None:
        """Called by the pipeline once per commit, before the handle reports the tier done."""
        at = time.time()
        with self._lock:
            self._entries.append((result, weakref.ref(handle), handle.blocked_seconds, at))
            callbacks = list(self._callbacks)
        for fn in callbacks:
            try:
                fn(result)
            except Exception:  # a metrics sink must never fail a checkpoint
                log.exception(
                    "commit callback %r failed for step %d on tier %s", fn, result.step, result.tier
                )
        self._emit(
            CheckpointEvent(
                "committed",
                result.step,
                result.tier,
                result.timeline,
                result=result,
                blocked_seconds=handle.blocked_seconds,
                at=at,
            )
        )

    def record_failure(
        self,
        kind: str,
        step: int,
        tier: str,
        error: BaseException | str,
        *,
        timeline: int = 0,
        blocked_seconds: float = 0.0,
    ) -> None:
        """A tier's copy failed, was skipped or given up (or, ``save_skipped``, a whole save
        was skipped): kept for ``stats(failures=True)`` and sent to the event callbacks."""
        event = CheckpointEvent(
            kind,
            step,
            tier,
            timeline,
            error=str(error),
            error_type=type(error).__name__ if isinstance(error, BaseException) else None,
            blocked_seconds=blocked_seconds,
            at=time.time(),
        )
        with self._lock:
            self._failures.append(event)
        self._emit(event)

    def _emit(self, event: CheckpointEvent) -> None:
        with self._lock:
            callbacks = list(self._event_callbacks)
        for fn in callbacks:
            try:
                fn(event)
            except Exception:  # a metrics sink must never fail a checkpoint
                log.exception(
                    "event callback %r failed for %s of step %d on tier %s",
                    fn,
                    event.kind,
                    event.step,
                    event.tier,
                )

    def stats(self, *, failures: bool = False) -> list[CommitStats]:
        """The recorded commits, oldest first; with ``failures``, also the failures, skips
        and give-ups (``outcome`` and ``error`` say which), in the order they happened."""
        with self._lock:
            entries = list(self._entries)
            failed = list(self._failures) if failures else []
        # blocked time is read now: it is final once the save's capture is done
        out = [
            CommitStats(
                step=r.step,
                tier=r.tier,
                raw_bytes=r.raw_bytes,
                stored_bytes=r.stored_bytes,
                seconds=r.seconds,
                blocked_seconds=_blocked(ref, blocked),
                codec=r.codec,
                committed_at=at,
            )
            for r, ref, blocked, at in entries
        ]
        out += [
            CommitStats(
                step=e.step,
                tier=e.tier,
                raw_bytes=0,
                stored_bytes=0,
                seconds=0.0,
                blocked_seconds=e.blocked_seconds,
                codec="",
                committed_at=e.at,
                outcome=e.kind,
                error=e.error,
            )
            for e in failed
        ]
        if failed:
            out.sort(key=lambda c: c.committed_at)
        return out


def _blocked(ref: weakref.ref[SaveHandle], at_commit: float) -> float:
    handle = ref()
    return handle.blocked_seconds if handle is not None else at_commit
