"""The handle ``Checkpointer.save()`` returns: capture and per-tier completion of one save."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from tierckpt.errors import CheckpointFailed, CheckpointSkipped, chained

__all__ = ["SaveHandle", "TierResult"]


@dataclass(frozen=True, slots=True)
class TierResult:
    """What one tier did with one checkpoint."""

    tier: str
    step: int
    raw_bytes: int
    stored_bytes: int
    seconds: float  # from save() to committed on this tier
    codec: str
    #: the checkpoint's timeline (see :class:`~tierckpt.format.CheckpointId`)
    timeline: int = 0
    #: seconds training had waited for this save when it committed here (in ``save()`` and
    #: in ``wait_captured()`` before the optimizer step)
    blocked_seconds: float = 0.0

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    @property
    def gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of the finished frames in ``error``'s tracebacks (its cause
    and context too): a handle keeps its tiers' errors, the stats keep the last handles, and
    those frames held the whole save job (its plan and encoded tree, ~350 KB a save of 1,000
    tensors) for every copy that failed or was skipped. File and line stay."""
    for e in chained(error):
        traceback.clear_frames(e.__traceback__)


class SaveHandle:
    """Tracks one ``save()``: ``captured``, ``done(tier)``, ``wait(tier)``, ``result()``.

    For code written around :mod:`concurrent.futures`, :attr:`future` is a real
    :class:`~concurrent.futures.Future` kept in sync with the handle: it resolves when every
    tier has finished, to the per-tier results, or to the same :class:`CheckpointFailed` /
    :class:`CheckpointSkipped` that :meth:`wait` raises. ``futures.wait``, ``as_completed``
    and ``add_done_callback`` work on it (the handle is not itself a ``Future`` because its
    ``done()`` and ``result()`` take a tier).
    """

    def __init__(
        self, step: int, tiers: tuple[str, ...], *, skipped: bool = False, timeline: int = 0
    ) -> None:
        self.step = step
        #: the timeline this save writes to (0 unless the run went back to an older step)
        self.timeline = timeline
        self.tiers = tiers
        self.skipped = skipped
        self.started = time.perf_counter()
        self.captured_at: float | None = None
        #: seconds training waited for this save: in ``save()`` and in ``wait_captured()``
        self.blocked_seconds = 0.0
        #: bytes copied in ``save()`` itself: module buffers and loose tensors, which the next
        #: forward pass may write (parameters and optimizer state are captured lazily)
        self.eager_bytes = 0
        self._captured = threading.Event()
        #: set once someone waits for this save's capture (``wait_captured``, the guarded
        #: optimizer step): each chunk's checksum then comes after the copy, as training waits
        self.capture_awaited = threading.Event()
        #: set once someone waits for a commit (``wait``, ``result``): checksums and writes
        #: then start as soon as each chunk is copied (the commit is what is waited for)
        self.commit_awaited = threading.Event()
        self._capture_error: BaseException | None = None
        self._tier_events = {t: threading.Event() for t in tiers}
        self._results: dict[str, TierResult] = {}
        self._errors: dict[str, BaseException] = {}
        self._lock = threading.Lock()
        self._future: Future[dict[str, TierResult]] = Future()
        self._future.set_running_or_notify_cancel()  # cannot be cancelled: it is under way
        if skipped or not tiers:
            self._captured.set()
            for e in self._tier_events.values():
                e.set()
            self._resolve_future()

    # -- set by the pipeline ---------------------------------------------------------
    def _set_captured(self, error: BaseException | None = None) -> None:
        if error is not None:
            _drop_locals(error)
        self._capture_error = error
        self.captured_at = time.perf_counter()
        self._captured.set()

    def _set_tier(self, tier: str, result: TierResult | None, error: BaseException | None) -> None:
        if error is not None:
            _drop_locals(error)
        with self._lock:
            if result is not None:
                self._results[tier] = result
            if error is not None:
                self._errors[tier] = error
        self._tier_events[tier].set()
        if self.done():
            self._resolve_future()

    def _resolve_future(self) -> None:
        """Settle :attr:`future` once every tier is done (exactly once, whoever gets here)."""
        try:
            results = self.result(timeout=0)
        except BaseException as e:  # CheckpointFailed / CheckpointSkipped, as wait() raises
            outcome: BaseException | None = e
            results = {}
        else:
            outcome = None
        with self._lock:
            if self._future.done():
                return
            if outcome is not None:
                self._future.set_exception(outcome)
            else:
                self._future.set_result(results)

    # -- for users -----------------------------------------------------------------
    @property
    def captured(self) -> bool:
        """True once the state's bytes are in host memory (it may change from now on)."""
        return self._captured.is_set()

    def wait_captured(self, timeout: float | None = None) -> None:
        self.capture_awaited.set()
        if not self._captured.wait(timeout):
            raise TimeoutError(f"step {self.step}: capture not finished after {timeout} s")
        if self._capture_error is not None:
            raise CheckpointFailed(
                f"step {self.step}: capture failed: {self._capture_error}",
                {t: self._capture_error for t in self.tiers},
            ) from self._capture_error

    def done(self, tier: str | None = None) -> bool:
        """True when ``tier`` (every tier if None) has finished: committed or failed."""
        return all(self._tier_events[t].is_set() for t in self._tiers(tier))

    def committed(self, tier: str) -> bool:
        return self.done(tier) and tier in self._results

    def _tiers(self, tier: str | None) -> tuple[str, ...]:
        if tier is None:
            return self.tiers
        if tier not in self._tier_events:
            raise KeyError(
                f"step {self.step} was not sent to tier {tier!r} (it went to {list(self.tiers)})"
            )
        return (tier,)

    def wait(self, tier: str | None = None, timeout: float | None = None) -> SaveHandle:
        """Wait until committed on ``tier`` (all tiers if None); raise if it failed there.

        A skipped save (``on_busy="skip"``) raises :class:`CheckpointSkipped`: it was never
        written, and code that waits for a checkpoint must not take it for a committed one.
        """
        if self.skipped:
            raise CheckpointSkipped(
                f"step {self.step} was skipped: on_busy='skip' and the previous checkpoint was "
                "still flushing, so nothing of it was written (check h.skipped, or use "
                "on_busy='block' to wait for arena space instead)"
            )
        self.commit_awaited.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._tiers(tier):
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._tier_events[t].wait(remaining):
                raise TimeoutError(f"step {self.step}: tier {t!r} not done after {timeout} s")
        errors = {t: e for t, e in self.errors.items() if tier is None or t == tier}
        if errors:
            first = next(iter(errors.values()))
            raise CheckpointFailed(
                f"step {self.step} failed on tier(s) {', '.join(errors)}: {first}", errors
            ) from first
        return self

    def result(self, timeout: float | None = None) -> dict[str, TierResult]:
        """Wait for every tier; the per-tier results, or the first error raised."""
        self.wait(None, timeout)
        with self._lock:
            return dict(self._results)

    @property
    def future(self) -> Future[dict[str, TierResult]]:
        """A :class:`concurrent.futures.Future` for the whole save (every tier), see above."""
        return self._future

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once every tier has finished (at once if it already has).

        Like ``Future.add_done_callback``; it runs on the thread that finished the last tier,
        so keep it short. An exception it raises is logged by ``concurrent.futures``.
        """
        self._future.add_done_callback(lambda _f: fn(self))

    @property
    def errors(self) -> dict[str, BaseException]:
        with self._lock:
            return dict(self._errors)

    @property
    def results(self) -> dict[str, TierResult]:
        with self._lock:
            return dict(self._results)

    def __repr__(self) -> str:
        state = (
            "skipped"
            if self.skipped
            else ("done" if self.done() else ("captured" if self.captured else "capturing"))
        )
        where = f"step={self.step}" + (f" timeline={self.timeline}" if self.timeline else "")
        return f"<SaveHandle {where} {state} tiers={list(self.tiers)}>"
