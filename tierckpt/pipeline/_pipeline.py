"""The :class:`Pipeline` assembled from its parts, with its public calls, and
:class:`PipelineOwner`, the lifecycle of the objects that own one (see the package's
docstring for how a save flows through it)."""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

from tierckpt import _native, config
from tierckpt.arena import HostArena
from tierckpt.capture import CaptureStreams
from tierckpt.errors import InheritedThroughFork, TierCkptError, WriterConflict
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.pipeline._capture import _CaptureMixin
from tierckpt.pipeline._close import _CloseMixin, check_close_timeout
from tierckpt.pipeline._exit import _ExitMixin, _track
from tierckpt.pipeline._layoutcache import LayoutCache
from tierckpt.pipeline._leases import RELEASE_WAIT_S, Leases
from tierckpt.pipeline._prebuild import ArenaPrebuild
from tierckpt.pipeline._tiers import _TiersMixin
from tierckpt.pipeline._values import (
    OUTCOMES,
    CommitFn,
    PipelineHooks,
    SaveJob,
    StageListener,
    Tier,
    _rank_zero_retains,
    check_save_deadline,
    default_save_deadline,
)


class Pipeline(_CloseMixin, _TiersMixin, _CaptureMixin, _ExitMixin):
    """Every background thread and queue of a writer: capture, encode, write per tier,
    commit, deadlines, leases and the exit drain (see :mod:`tierckpt.pipeline`)."""

    #: this writer's owner id in its leases, and their time to live (seconds)
    owner: str
    lease_ttl: float

    def __init__(
        self,
        tiers: list[Tier],
        *,
        chunk_bytes: int,
        host_buffer_bytes: int,
        io_threads: int,
        commit: CommitFn,
        on_result: Callable[[TierResult, SaveHandle], None] | None = None,
        on_failure: Callable[[Tier, SaveJob, BaseException], None] | None = None,
        retains: Callable[[Tier, SaveJob], bool] | None = None,
        save_deadline: float | None = None,
        counts: dict[str, Counter[str]] | None = None,
    ) -> None:
        self.tiers = tiers
        self.on_result = on_result
        self.on_failure = on_failure
        #: whether this rank applies a tier's retention once a job committed there; default:
        #: rank 0 (the other ranks' copies are on the same storage)
        self.retains = retains or _rank_zero_retains
        self.chunk_bytes = chunk_bytes
        self.host_buffer_bytes = host_buffer_bytes
        self.commit = commit
        #: seconds a tier may make no progress while a save waits for it (inf: no deadline)
        self.save_deadline = (
            default_save_deadline() if save_deadline is None else check_save_deadline(save_deadline)
        )
        self.arena = None
        self._prebuilt = None
        self._streams = CaptureStreams()
        self._layouts = LayoutCache()
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tierckpt-encode")
        self._commit_pool = None  # deferred commits, made on demand
        self._capture_q = queue.Queue()
        self._tier_q = {t.name: queue.Queue() for t in tiers}
        self._by_name = {t.name: t for t in tiers}
        self._lock = threading.Lock()
        self._retaining = Counter()
        self._retained = threading.Condition(self._lock)
        self._in_flight = []
        #: chunks whose arena slot some tier still holds (at most the arena's slot count)
        self._held_chunks = []
        #: tier name -> since when its thread has made no progress (kept while it is idle
        #: after a failure: presumed down); tiers whose thread is working on an item
        self._stalled_since = {}
        self._busy = set()
        self._given_up_at = {}
        #: follower tier name -> the jobs whose source step it holds (copying or waiting)
        self._following = {}
        #: follower tier name -> the job its thread is working on
        self._follow_active = {}
        self._counts = counts if counts is not None else {}
        for t in tiers:
            self._counts.setdefault(t.name, Counter())
        self._closed = False
        #: replaced, never mutated, so threads iterate a snapshot without the lock
        self._listeners = ()
        #: seconds to wait for in-flight saves at interpreter exit (None: exit_timeout_s())
        self.exit_timeout_s = None
        #: set at interpreter exit once the wait is over, or when close(timeout=) ran out:
        #: no copy commits from then on
        self._abandoned = False
        self._abandon_why = (
            "abandoned at interpreter exit, unfinished after the exit timeout "
            "(TIERCKPT_EXIT_TIMEOUT_S)"
        )
        #: (step, tier) copies inside their commit (a commit is atomic: whole or not at all)
        self._committing = set()
        self._leases = Leases(tiers)
        #: one owner id per writer object (a pipeline lives as long as its owner's writing)
        self.owner = self._leases.owner
        self.lease_ttl = self._leases.ttl
        self._threads = [
            threading.Thread(target=self._capture_loop, name="tierckpt-capture", daemon=True)
        ]
        for t in tiers:
            self._threads.append(
                threading.Thread(
                    target=self._tier_loop, args=(t,), name=f"tierckpt-{t.name}", daemon=True
                )
            )
        for th in self._threads:
            th.start()
        _track(self)

    # -- public ----------------------------------------------------------------------
    def submit(self, job: SaveJob) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the checkpointer is closed")
            self._in_flight.append(job)
        self._capture_q.put(job)

    def subscribe(self, listener: StageListener) -> Callable[[], None]:
        """Send every :class:`StageEvent` of the saves that start from now on to ``listener``
        (see :data:`StageListener`); returns the function that unsubscribes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def acquire_leases(self, job: SaveJob) -> set[str]:
        """Before ``submit(job)``, in the caller's thread: have the tier threads take this
        writer's lease on every tier of ``job`` not yet held, and raise
        :class:`WriterConflict` (nothing submitted, nothing written) when another live
        writer holds one. Waits at most ``TIERCKPT_LEASE_WAIT_S``, and only for a first
        attempt (or one after a conflict): a retry after an unreachable store goes on in the
        background, and its failure fails only that tier's copy (``job.lease_errors``).
        Returns the tiers whose first take had not ended by then (their store is silent)."""
        return self._leases.acquire(job, self._queue_take)

    def claim_leases(self, tiers: list[Tier], rank: int, step: int) -> WriterConflict | None:
        """Before a save that learns only later whether every rank may write (a DCP save's
        local plan): take this writer's lease for ``rank`` on each of ``tiers`` not held yet
        and wait for the takes; the refusal of another live writer, or None. What is not
        settled by then is left to :meth:`acquire_leases` (see ``Leases.claim``)."""
        return self._leases.claim(tiers, rank, step, self._queue_take)

    def holds_leases(self, rank: int) -> bool:
        """Whether this writer holds a lease for ``rank`` on any tier (a save before this
        one took it)."""
        return self._leases.holds(rank)

    def give_back_leases(self) -> None:
        """Give back every lease this writer holds, waiting at most ``RELEASE_WAIT_S`` (a
        multi-rank job's first save that another rank's conflict refused: this rank writes
        nothing either, and the next save takes them again)."""
        self._leases.release_all(RELEASE_WAIT_S)

    def take_leases_early(self, tiers: list[Tier], rank: int, step: int) -> None:
        """At a save's start, before it lists the tiers: queue the first take of this
        writer's lease on each tier not attempted yet, so that :meth:`acquire_leases` waits
        for the listing and the takes together (a silent store costs one wait, not two)."""
        self._leases.take_early(tiers, rank, step, self._queue_take)

    def _queue_take(
        self, tier: Tier, rank: int, step: int, fut: Future[BaseException | None]
    ) -> None:
        self._tier_q[tier.name].put(("lease", None, (rank, step, fut)))

    def may_collect(self, tier: Tier, rank: int) -> bool:
        """Whether retention may delete on ``tier`` now: only while this writer still holds
        its lease there, checked by reading it back."""
        return self._leases.may_collect(tier, rank)

    def retain_later(self, tier: Tier, job: SaveJob) -> None:
        """Apply ``tier``'s retention on its thread, after what is queued there: for an owner
        that commits itself (the DCP writer's coordinator), off its save's critical path.
        As after a commit here: only while this writer holds the lease, keeping the saves in
        flight (``job`` is the owner's save just committed). Counted from now, so that
        :meth:`wait_retention` waits for it as for a pass after a commit here."""
        with self._lock:  # atomic with close(): queued before the thread's end, or not at all
            if self._closed:
                return
            self._retaining[tier.name] += 1
            self._tier_q[tier.name].put(("retain", job, None))

    def counts(self) -> dict[str, dict[str, int]]:
        """Per tier, how many copies committed, failed, were skipped or given up."""
        with self._lock:
            return {name: {k: c[k] for k in OUTCOMES} for name, c in self._counts.items()}

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no save is in flight; False if ``timeout`` seconds passed first.

        Meanwhile a tier that makes no progress for ``save_deadline`` seconds has its copies
        that have not started committing given up, so a dead tier costs about that long here
        (plus the call it is blocked in, bounded by its backend's timeouts), not its timeouts
        times the saves queued for it.
        """
        end = None if timeout is None else time.monotonic() + timeout
        poll = min(1.0, self.save_deadline / 4)
        while True:
            jobs = self.in_flight()
            if not jobs:
                return True
            for job in jobs:  # a guarded capture's last look need not wait (_capture)
                job.handle.commit_awaited.set()
            now = time.monotonic()
            if end is not None and now >= end:
                return False
            wait = poll if end is None else max(0.0, min(poll, end - now))
            events = jobs[0].handle._tier_events
            for name in jobs[0].handle.tiers:
                if not events[name].wait(wait):
                    break
            self._give_up_stalled(drain=True)

    def wait_job(self, job: SaveJob) -> None:
        """Wait until every tier of ``job`` is done with it (its handle says how); meanwhile a
        tier that makes no progress for ``save_deadline`` seconds has its copies that have not
        started committing given up, as in :meth:`drain`."""
        poll = min(1.0, self.save_deadline / 4)
        events = job.handle._tier_events
        while True:
            pending = [name for name in job.handle.tiers if not events[name].is_set()]
            if not pending:
                return
            if not events[pending[0]].wait(poll):
                self._give_up_stalled(drain=True)


_Owner = TypeVar("_Owner", bound="PipelineOwner")
_T = TypeVar("_T")


class Protecting(Protocol):
    """What names the steps a retention pass must keep (``Checkpointer``'s protectors)."""

    def steps(self) -> Collection[int]: ...

    def deleting(self, cid: CheckpointId) -> AbstractContextManager[bool]: ...


def weakly(method: Callable[..., _T]) -> Callable[..., _T | None]:
    """``method``, bound to a pipeline's owner, through a weak reference: what the pipeline's
    threads hold must not keep an owner dropped unclosed alive (its leases, threads and host
    buffer would stay for good: a notebook cell run again was refused with WriterConflict by
    its own dropped Checkpointer). A save in flight keeps its owner alive through its job
    (``SaveJob.confirm``, until the job is done); a call once the owner is collected (its
    close at collection: nothing in flight) does nothing and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> _T | None:
        fn = ref()
        return None if fn is None else fn(*args, **kwargs)

    return call


_M = TypeVar("_M", bound=Callable[..., Any])


def in_owner_process(method: _M) -> _M:
    """Refuse ``method`` on a :class:`PipelineOwner` inherited through fork (see
    :meth:`PipelineOwner._check_process`): its threads, leases and connections are the
    parent's."""

    @functools.wraps(method)
    def checked(self: PipelineOwner, *args: Any, **kwargs: Any) -> Any:
        self._check_process()
        return method(self, *args, **kwargs)

    return checked  # type: ignore[return-value]


class PipelineOwner:
    """Lifecycle shared by the objects that own a :class:`Pipeline` and its tiers
    (``Checkpointer``, ``dcp.TierWriter``): ``close()`` once, context manager, and a
    best-effort close when collected unclosed."""

    _pipeline: Pipeline | None
    _tiers: list[Tier]
    _closed: bool
    chunk_bytes: int
    host_buffer_bytes: int
    io_threads: int
    #: seconds in-flight saves get at interpreter exit (None: TIERCKPT_EXIT_TIMEOUT_S or 60)
    exit_timeout_s: float | None = None
    #: how long a save waits behind a tier making no progress (None: the configured default)
    save_deadline: float | None = None
    #: the host arena being built since construction (handed to the pipeline when made)
    _arena_prebuild: ArenaPrebuild | None = None
    #: the steps retention must keep besides its rules, asked at each pass and held around
    #: each deletion (None: none)
    _protectors: Protecting | None = None
    #: the process that made this owner (set at construction); a process forked from it holds
    #: a copy without its threads, whose leases and connections are that process's
    _pid: int | None = None

    def _inherited(self) -> bool:
        """Whether this object reached this process through fork from the one that made it."""
        return self._pid is not None and self._pid != os.getpid()

    def _check_process(self) -> None:
        """Refuse the use of a copy inherited through fork (:class:`InheritedThroughFork`)."""
        if self._inherited():
            assert self._pid is not None
            raise InheritedThroughFork(type(self).__name__, self._pid, os.getpid())

    def _start_arena_prebuild(self) -> None:
        """At construction: build the host arena on a background thread (CUDA available, or
        ``TIERCKPT_ARENA_PREBUILD=1``), so the first save does not allocate and pin it; and
        start building the streaming-store copy (:mod:`tierckpt._native`) likewise."""
        _native.prepare()
        if not config.arena_prebuild():
            return
        device = None
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        self._arena_prebuild = ArenaPrebuild(self.host_buffer_bytes, self.chunk_bytes, device)

    def _arena_for_load(self) -> HostArena | None:
        """The host arena if one is built (by the first save, or ahead of it), whose free
        slots a load onto the GPU stages chunks in; None while there is none (the load then
        pins a small staging ring of its own)."""
        pipeline = self._pipeline
        if pipeline is not None and pipeline.arena is not None:
            return pipeline.arena
        pre = pipeline._prebuilt if pipeline is not None else self._arena_prebuild
        return pre.peek() if pre is not None else None

    def _pipeline_hooks(self) -> PipelineHooks:
        """What this owner plugs into the Pipeline (``commit`` at least)."""
        raise NotImplementedError

    def _get_pipeline(self) -> Pipeline:
        """The pipeline, started on first use."""
        self._check_process()
        if self._closed:
            raise TierCkptError(f"this {type(self).__name__} is closed")
        if self._pipeline is None:
            hooks = self._pipeline_hooks()
            self._pipeline = Pipeline(
                self._tiers,
                chunk_bytes=self.chunk_bytes,
                host_buffer_bytes=self.host_buffer_bytes,
                io_threads=self.io_threads,
                commit=hooks.commit,
                on_result=hooks.on_result,
                on_failure=hooks.on_failure,
                retains=hooks.retains,
                save_deadline=self.save_deadline,
                counts=hooks.counts,
            )
            self._pipeline.exit_timeout_s = self.exit_timeout_s
            # weakly: a pipeline must not keep its owner alive (a dropped DCP writer parks
            # its pipeline for the next writer only once nothing refers to the writer)
            protector = weakly(self._protected_steps)

            def protect_steps() -> Collection[int]:
                return protector() or frozenset()

            self._pipeline.protect_steps = protect_steps
            # the protectors' method: it refers to them, not to the owner
            self._pipeline.deleting = (
                None if self._protectors is None else self._protectors.deleting
            )
            self._pipeline._prebuilt, self._arena_prebuild = self._arena_prebuild, None
        return self._pipeline

    def _protected_steps(self) -> Collection[int]:
        """Steps retention must keep besides its rules (see ``Checkpointer.protect_steps``)."""
        return frozenset() if self._protectors is None else self._protectors.steps()

    def _release(self) -> None:
        """Extra resources of the owner, released by ``close()`` after the pipeline."""

    def close(self, timeout: float | None = None) -> None:
        """Wait for in-flight saves to finish on every tier, then release threads, memory and
        this writer's leases.

        A tier that makes no progress for ``save_deadline`` seconds meanwhile has its copies
        given up (as in ``wait()``), and a call still blocked in its store is not waited for:
        that tier's lease is given back once the call returns. ``timeout``: wait at most that
        many seconds (e.g. what is left of a preemption's grace period): a copy not committed
        by then is given up on its tier (``CloseTimeout`` on its handle), except one already
        inside its atomic commit; checkpoints committed before are never touched."""
        check_close_timeout(timeout)
        if self._closed:
            return
        self._closed = True
        if self._inherited():
            # the parent's pipeline, leases and connections: a forked child lets them be
            # (its exit, a DataLoader worker's, must not give the parent's leases back)
            self._pipeline = self._arena_prebuild = None
            return
        pipeline, self._pipeline = self._pipeline, None
        try:
            if pipeline is not None:
                pipeline.close(timeout, close_backends=True)
        finally:
            if self._arena_prebuild is not None:
                self._arena_prebuild.discard()
                self._arena_prebuild = None
            self._release()
            if pipeline is None:
                for t in self._tiers:
                    t.backend.close()

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            pipeline = self._pipeline
            if self._closed or pipeline is None or self._inherited():
                return
            if threading.current_thread() in pipeline._threads:
                # collected by a GC pass that ran in one of its own threads: it cannot join
                # itself, so another thread closes it
                threading.Thread(target=pipeline.close, name="tierckpt-close", daemon=True).start()
            else:
                pipeline.close()
        except Exception:
            pass
