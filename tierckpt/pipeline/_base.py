"""The state every part of the :class:`~tierckpt.pipeline.Pipeline` shares, declared once.

The pipeline is assembled from mixins, one per concern (``_stall``, ``_capture``, ``_tiers``,
``_exit``); each reads and changes this state, always under ``_lock`` where a comment says so.
The methods one part calls on another are declared here too, so each mixin type-checks alone.
``Pipeline.__init__`` (``tierckpt.pipeline._pipeline``) sets every attribute."""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any

from tierckpt.arena import HostArena
from tierckpt.capture import CaptureStreams
from tierckpt.errors import TierCkptError
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.pipeline._layoutcache import LayoutCache
from tierckpt.pipeline._leases import Leases
from tierckpt.pipeline._prebuild import ArenaPrebuild
from tierckpt.pipeline._values import (
    CommitFn,
    SaveJob,
    Stage,
    StageEvent,
    StageListener,
    Tier,
    _ChunkState,
    _Emit,
)

log = logging.getLogger("tierckpt")


class _PipelineBase:
    #: steps retention keeps on every tier besides its rules (an integration's live pointers),
    #: asked at each retention; if it raises, that retention is skipped (set by the owner)
    protect_steps: Callable[[], Collection[int]] = frozenset
    #: held around each deletion of a retention pass; yields True when the checkpoint must
    #: be kept after all (a load of its step began during the pass; set by the owner)
    deleting: Callable[[CheckpointId], AbstractContextManager[bool]] | None = None
    tiers: list[Tier]
    on_result: Callable[[TierResult, SaveHandle], None] | None
    on_failure: Callable[[Tier, SaveJob, BaseException], None] | None
    #: whether this rank applies a tier's retention once a job committed there; default:
    #: rank 0 (the other ranks' copies are on the same storage)
    retains: Callable[[Tier, SaveJob], bool]
    chunk_bytes: int
    host_buffer_bytes: int
    commit: CommitFn
    #: seconds a tier may make no progress while a save waits for it (inf: no deadline)
    save_deadline: float
    arena: HostArena | None
    #: the arena being built since the owner's construction; taken by the first save
    _prebuilt: ArenaPrebuild | None
    _streams: CaptureStreams
    #: the last save's layout, reused while the state's tensors stay where they were
    _layouts: LayoutCache
    _pool: ThreadPoolExecutor
    _commit_pool: ThreadPoolExecutor | None  # deferred commits, made on demand
    _capture_q: queue.Queue[SaveJob | None]
    #: (kind, job, payload); a lease take has no job: ("lease", None, (rank, step, future))
    _tier_q: dict[str, queue.Queue[tuple[str, SaveJob | None, Any] | None]]
    _by_name: dict[str, Tier]
    _lock: threading.Lock
    _in_flight: list[SaveJob]
    #: chunks whose arena slot some tier still holds (at most the arena's slot count)
    _held_chunks: list[_ChunkState]
    #: tier name -> since when its thread has made no progress (kept while it is idle
    #: after a failure: presumed down); tiers whose thread is working on an item
    _stalled_since: dict[str, float]
    _busy: set[str]
    #: tier name -> when a copy of it was last given up (it made no progress, or did not
    #: answer its lease take): close() does not wait for its thread stalled since before
    _given_up_at: dict[str, float]
    #: follower tier name -> the jobs whose source step it holds (copying or waiting)
    _following: dict[str, list[SaveJob]]
    #: follower tier name -> the job its thread is working on
    _follow_active: dict[str, SaveJob]
    _counts: dict[str, Counter[str]]
    _closed: bool
    #: replaced, never mutated, so threads iterate a snapshot without the lock
    _listeners: tuple[StageListener, ...]
    #: seconds to wait for in-flight saves at interpreter exit (None: exit_timeout_s())
    exit_timeout_s: float | None
    #: set at interpreter exit once the wait is over, or when ``close(timeout=)`` ran out:
    #: no copy commits from then on; ``_abandon_why`` says which, in each copy's error
    _abandoned: bool
    _abandon_why: str
    #: (step, tier) copies inside their commit (a commit is atomic: whole or not at all)
    _committing: set[tuple[int, str]]
    #: this writer's leases (tierckpt.lease)
    _leases: Leases
    _threads: list[threading.Thread]
    #: tier name -> retention passes reported-but-running after commits (under ``_lock``);
    #: ``_retained`` (a condition on ``_lock``) is notified as each ends
    _retaining: Counter[str]
    _retained: threading.Condition

    # -- shared helpers ------------------------------------------------------------------
    def in_flight(self) -> list[SaveJob]:
        with self._lock:
            return list(self._in_flight)

    def defer(self, fn: Callable[[], None]) -> Future[None]:
        """Run a commit's waiting part (``fn``) off the tier's writer thread."""
        with self._lock:
            if self._commit_pool is None:
                self._commit_pool = ThreadPoolExecutor(4, thread_name_prefix="tierckpt-commit")
            return self._commit_pool.submit(fn)

    def _emitter(self, step: int, tier: str | None) -> _Emit | None:
        """The reporter of ``step``'s stages on ``tier`` (None: shared work), or None when
        nobody listens, so that then no stage is timed."""
        listeners = self._listeners
        if not listeners:
            return None

        def emit(stage: Stage, nbytes: int, seconds: float) -> None:
            event = StageEvent(stage, step, tier, nbytes, seconds)
            for fn in listeners:
                try:
                    fn(event)
                except Exception:  # a profiler's bug must not fail a checkpoint
                    log.exception("stage listener %r failed on %s", fn, event)

        return emit

    def _abandoned_error(self, job: SaveJob) -> TierCkptError:
        return TierCkptError(f"step {job.step}: {self._abandon_why}; not committed")

    def _check_abandoned(self, job: SaveJob) -> None:
        if self._abandoned:
            raise self._abandoned_error(job)

    # -- implemented by the parts (declared here so each part type-checks alone) ---------
    def give_up(self, copies: list[tuple[Tier, SaveJob, BaseException]]) -> None:
        raise NotImplementedError  # _stall

    def close(self, timeout: float | None = None, *, close_backends: bool = False) -> None:
        raise NotImplementedError  # _close

    def drain(self, timeout: float | None = None) -> bool:
        raise NotImplementedError  # Pipeline

    def _source_done(
        self,
        tier: Tier,
        job: SaveJob,
        result: tuple[str, list[list[Any]], list[dict[str, Any]]] | None,
        error: BaseException | None,
    ) -> None:
        raise NotImplementedError  # _tiers

    def _finish(
        self,
        tier: Tier,
        job: SaveJob,
        result: TierResult | None,
        error: BaseException | None,
        *,
        outcome: str = "failed",
        defer_hooks: bool = False,
    ) -> None:
        raise NotImplementedError  # _tiers
