"""Background stages: capture → encode → write per tier → commit. All threads live here.

One capture thread copies chunks into the host arena (waiting for free slots: backpressure).
As soon as a chunk is in the arena it is encoded on a small pool (once per distinct codec
among the tiers; the raw codec costs only a checksum) and handed to every tier's writer
thread, in tier order. A tier thread writes its chunks in sequence, so S3 multipart parts go
out in order while the local tier pwrites at its own pace; a chunk's arena slot is released
once every tier has written it. After the last chunk each tier writes the index and footer,
makes the file durable and commits (manifest last), then applies retention. A failure on one
tier fails that tier's copy of that checkpoint only; it is reported on the handle and in the
log, and the next save starts clean.

A tier with a ``source`` (e.g. S3 behind the local disk) takes no chunks from the arena: once
the source tier's file is durable, the follower's thread reads it back chunk by chunk, checks
each chunk's checksum, re-encodes it for its own codec when that differs, and writes it. So a
slow tier never holds arena slots, and capture goes at the pace of the tiers fed directly.

Whoever wants to know where a save's time goes (``tierckpt bench``'s per-stage breakdown)
subscribes to :class:`StageEvent` s with :meth:`Pipeline.subscribe`; with no subscriber no
stage is timed for it.

At interpreter exit (the main thread has returned or raised), saves still in flight are drained
by :func:`_drain_at_exit`: each live pipeline gets ``exit_timeout_s`` (default 60 s,
``TIERCKPT_EXIT_TIMEOUT_S``) to finish; what is still unfinished then is abandoned — never
committed, its partial files removed by the writers' ``abort()`` — and the threads are stopped
before the interpreter tears down, so a daemon thread is never frozen inside a tensor copy
(which aborted the process with SIGABRT, exit status 134).

One writer per location (:mod:`tierckpt.lease`): before a job is submitted, ``acquire_leases``
has each tier's thread take this writer's lease there (the first time: a live other writer
refuses the save at once). The tier threads renew their leases every ``ttl / 4`` (waking from
their queue for it, and between chunks), check the lease before publishing a shard file and
before retention, and release it at ``close()``. A tier whose lease was lost fails every later
save there and is never garbage-collected by this writer again.

Every wait has a bound. A tier fed from the arena that makes no progress (no chunk written, no
item finished) for ``save_deadline`` seconds while capture waits for arena space it holds is
*given up* for the saves whose chunks it holds: their slots are released at once (capture and
training go on), the copy is reported failed (:class:`SaveDeadlineExceeded`), and that copy can
never commit: the tier's thread, blocked in a call with a view of a slot that may since hold
other bytes, checks the verdict before every write and before its commit, and aborts. The next
save hands its chunks to the tier again. ``drain()`` (``Checkpointer.wait()``, ``close()``)
gives up the queued copies of a tier stalled for as long the same way. A follower holds at most
``max_behind`` of its source's steps (the one it copies and the newest waiting ones); an older
waiting copy is skipped (:class:`CopySkipped`), so the source's retention is never held back
for more than that, and retention runs after a failed save too, so a disk that filled up frees
itself.
"""

from __future__ import annotations

import atexit
import logging
import math
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from tierckpt import config
from tierckpt._types import BytesLike
from tierckpt.arena import HostArena
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.capture import CaptureStreams, copy_chunk
from tierckpt.codecs import Codec, SupportsObserve, SupportsProfile, codec_from_config
from tierckpt.errors import (
    BackendError,
    CopySkipped,
    FormatError,
    SaveDeadlineExceeded,
    TierCkptError,
    WriterConflict,
)
from tierckpt.format import (
    CHECKSUM_ALGO,
    FOOTER_SIZE,
    FORMAT_VERSION,
    CheckpointId,
    ChunkRecord,
    Footer,
    ShardRef,
    align_up,
    checksum,
    encode_index,
    manifest_name,
    shard_name,
    step_prefix,
)
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.layout import prefixes_for, shard_file
from tierckpt.lease import WriterLease, acquire_wait, lease_ttl, new_owner_id
from tierckpt.plan import ChunkPlan, CollectedState, ShardLayout, layout_plan
from tierckpt.policy import TierSpec, resolve_codec
from tierckpt.retention import gc_tier
from tierckpt.verify import read_verified

__all__ = [
    "DEFAULT_EXIT_TIMEOUT_S",
    "DEFAULT_SAVE_DEADLINE_S",
    "Pipeline",
    "PipelineHooks",
    "SaveJob",
    "StageEvent",
    "Tier",
    "open_tiers",
    "exit_timeout_s",
    "default_save_deadline",
]

log = logging.getLogger("tierckpt")
_ZEROS = bytes(4096)

#: seconds in-flight saves get to finish at interpreter exit before they are abandoned
DEFAULT_EXIT_TIMEOUT_S = config.DEFAULT_EXIT_TIMEOUT_S
#: after abandoning, how long the exit handler lets the threads abort their writes and stop
_EXIT_ABORT_GRACE_S = 10.0
#: seconds a save may wait behind a tier that makes no progress (``TIERCKPT_SAVE_DEADLINE``)
DEFAULT_SAVE_DEADLINE_S = config.DEFAULT_SAVE_DEADLINE_S
#: what a save waits, at most, behind a tier whose last work failed without progress since
RETRY_GRACE_S = 5.0


def default_save_deadline() -> float:
    """``TIERCKPT_SAVE_DEADLINE`` (seconds; ``inf`` turns the deadline off), else 30 s."""
    return config.save_deadline_s()


def check_save_deadline(value: float) -> float:
    """``value`` as seconds, refused unless > 0 (``inf``: no deadline)."""
    return config.save_deadline_s(value)


#: the stages a save goes through, in order: ``plan`` (lay the chunks out), ``arena_wait``
#: (wait for a free arena slot: backpressure), ``capture`` (copy a chunk into the arena; for
#: a CUDA tensor, queueing the copy), ``encode`` (compress; not for raw), ``checksum``,
#: ``write`` (a chunk, or the index and footer, to one tier), ``sync`` (that tier's file made
#: durable: fsync + rename, or the multipart upload completed), ``commit`` (the manifest)
Stage = Literal["plan", "arena_wait", "capture", "encode", "checksum", "write", "sync", "commit"]


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage's work on one piece of one save, as the pipeline did it.

    ``tier`` is None for the work shared by every tier fed from the arena (plan, arena wait,
    capture, and encode/checksum, which run once per distinct codec); ``nbytes`` is what the
    stage handled (raw bytes in for capture and encode, stored bytes for checksum and write,
    the file's size for sync, the state's raw bytes for plan and commit).
    """

    stage: Stage
    step: int
    tier: str | None
    nbytes: int
    seconds: float


#: receives every StageEvent, on the pipeline's own threads (several at once): it must be
#: quick and thread-safe; an exception it raises is logged and otherwise ignored
StageListener = Callable[[StageEvent], None]
#: reports one stage (stage, nbytes, seconds) of one job, on one tier or none
_Emit = Callable[[Stage, int, float], None]


@dataclass
class Tier:
    """One tier at run time: its spec, the backend it writes to and the codec it encodes with."""

    spec: TierSpec
    backend: Backend
    codec: Codec

    @property
    def name(self) -> str:
        return self.spec.name


def open_tiers(specs: Iterable[TierSpec]) -> list[Tier]:
    """Each tier's backend opened and its codec resolved, in order (``Checkpointer`` and the
    DCP writer and reader build their tiers the same way)."""
    out = []
    for spec in specs:
        backend = spec.make_backend()
        out.append(Tier(spec, backend, resolve_codec(spec.codec, backend)))
    return out


@dataclass(frozen=True, slots=True)
class Encoded:
    data: BytesLike
    checksum: str
    codec_config: dict[str, Any]


@dataclass(eq=False)
class _ChunkState:
    plan: ChunkPlan
    slot: int
    job: SaveJob
    #: names of the tiers that have not yet written (or given up) this chunk; the slot is
    #: released when the last one goes (changed under the pipeline's lock)
    holders: set[str]
    encoded: dict[Codec, Future[Encoded]] = field(default_factory=dict)


@dataclass
class _Follow:
    """A follower tier's wait for its source tier's durable file of one job."""

    source: Tier
    #: (file name, chunk records, codec table) of the source's file, or the source's error
    done: Future[tuple[str, list[list[Any]], list[dict[str, Any]]]] = field(default_factory=Future)


@dataclass
class SaveJob:
    step: int
    #: the layout; None until the capture thread lays ``collected`` out
    plan: ShardLayout | None
    tiers: list[Tier]
    handle: SaveHandle
    rank: int
    world_size: int
    ready_events: dict[torch.device, Any]
    metadata: dict[str, Any]
    capture_error: BaseException | None = None
    #: what save() collected (tree + tensor references), laid out by the capture thread
    collected: CollectedState | None = None
    chunk_bytes: int = 0

    @property
    def laid_out(self) -> ShardLayout:
        assert self.plan is not None, "the capture thread lays the plan out first"
        return self.plan

    #: multi-rank saves: the id all ranks agreed on for this attempt (tierckpt.distributed)
    attempt: str = ""
    #: follower tier name -> its source; set by the capture thread
    follows: dict[str, _Follow] = field(default_factory=dict)
    #: the timeline this checkpoint is saved on (chosen by the owner, see CheckpointId)
    timeline: int = 0
    #: tier name -> why this writer could not take its lease there for this job
    lease_errors: dict[str, BaseException] = field(default_factory=dict)
    #: tier name -> why its copy was given up (deadline, follower behind); set under the
    #: pipeline's lock, only before the tier starts committing; such a copy never commits
    given_up: dict[str, BaseException] = field(default_factory=dict)
    #: tiers whose copy of this job can no longer be given up: committing, or failed on
    #: their own (changed under the pipeline's lock)
    settled: set[str] = field(default_factory=set)

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)

    @property
    def shard(self) -> str:
        """This rank's shard file name."""
        return shard_name(self.step, self.rank, timeline=self.timeline)

    def shard_on(self, tier: Tier) -> str:
        """This rank's shard file name on ``tier``: format v2 (hashed prefixes) unless the
        tier's ``prefixes`` knob is 0 (see tierckpt.layout)."""
        prefixes = prefixes_for(tier.spec.prefixes)
        return shard_file(step_prefix(self.step, timeline=self.timeline), self.rank, prefixes)


@dataclass
class _TierWrite:
    """One tier's progress on one job."""

    writer: ObjectWriter | None = None
    offset: int = 0
    records: list[list[Any]] = field(default_factory=list)
    codecs: list[dict[str, Any]] = field(default_factory=list)
    stored: int = 0
    error: BaseException | None = None
    write_seconds: float = 0.0
    #: this tier's stage reporter for the job; None when nobody listens
    emit: _Emit | None = None


#: commits one tier's copy; returns None when done, or a Future (from ``Pipeline.defer``) that
#: completes once committed — multi-rank rank 0 waits for the other ranks that way, without
#: holding the tier's writer thread
CommitFn = Callable[[Tier, SaveJob, ShardRef, int, int], "Future[None] | None"]


@dataclass(frozen=True, slots=True)
class PipelineHooks:
    """What a :class:`PipelineOwner` plugs into its :class:`Pipeline` (see its arguments):
    ``commit`` once a shard file is durable on a tier; ``on_result`` once a save committed on a
    tier; ``on_failure`` when it failed there; ``retains`` whether this rank applies the tier's
    retention after a commit (None: rank 0 does)."""

    commit: CommitFn
    on_result: Callable[[TierResult, SaveHandle], None] | None = None
    on_failure: Callable[[Tier, SaveJob, BaseException], None] | None = None
    retains: Callable[[Tier, SaveJob], bool] | None = None
    #: outcomes counted per tier, shared with the owner (``Checkpointer.tier_counts()``)
    counts: dict[str, Counter[str]] | None = None


#: outcomes counted per tier (``Pipeline.counts``, ``Checkpointer.tier_counts()``)
OUTCOMES = ("committed", "failed", "skipped", "deadline")


class Pipeline:
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
        self.arena: HostArena | None = None
        self._streams = CaptureStreams()
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tierckpt-encode")
        self._commit_pool: ThreadPoolExecutor | None = None  # deferred commits, made on demand
        self._capture_q: queue.Queue[SaveJob | None] = queue.Queue()
        self._tier_q: dict[str, queue.Queue[tuple[str, SaveJob, Any] | None]] = {
            t.name: queue.Queue() for t in tiers
        }
        self._by_name = {t.name: t for t in tiers}
        self._lock = threading.Lock()
        self._in_flight: list[SaveJob] = []
        #: chunks whose arena slot some tier still holds (at most the arena's slot count)
        self._held_chunks: list[_ChunkState] = []
        #: tier name -> since when its thread has made no progress (kept while it is idle
        #: after a failure: presumed down); tiers whose thread is working on an item
        self._stalled_since: dict[str, float] = {}
        self._busy: set[str] = set()
        #: follower tier name -> the jobs whose source step it holds (copying or waiting)
        self._following: dict[str, list[SaveJob]] = {}
        #: follower tier name -> the job its thread is working on
        self._follow_active: dict[str, SaveJob] = {}
        self._counts = counts if counts is not None else {}
        for t in tiers:
            self._counts.setdefault(t.name, Counter())
        self._closed = False
        #: replaced, never mutated, so threads iterate a snapshot without the lock
        self._listeners: tuple[StageListener, ...] = ()
        #: seconds to wait for in-flight saves at interpreter exit (None: exit_timeout_s())
        self.exit_timeout_s: float | None = None
        #: set at interpreter exit once the wait is over: no copy commits from then on
        self._abandoned = False
        #: (step, tier) copies inside their commit (a commit is atomic: whole or not at all)
        self._committing: set[tuple[int, str]] = set()
        #: one owner id per writer object (a pipeline lives as long as its owner's writing)
        self.owner = new_owner_id()
        self.lease_ttl = lease_ttl()
        self._leases: dict[tuple[str, int], WriterLease] = {}
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

    def defer(self, fn: Callable[[], None]) -> Future[None]:
        """Run a commit's waiting part (``fn``) off the tier's writer thread."""
        with self._lock:
            if self._commit_pool is None:
                self._commit_pool = ThreadPoolExecutor(4, thread_name_prefix="tierckpt-commit")
            return self._commit_pool.submit(fn)

    def subscribe(self, listener: StageListener) -> Callable[[], None]:
        """Send every :class:`StageEvent` of the saves that start from now on to ``listener``
        (see :data:`StageListener`); returns the function that unsubscribes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

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

    def in_flight(self) -> list[SaveJob]:
        with self._lock:
            return list(self._in_flight)

    # -- leases (tierckpt.lease) -----------------------------------------------------------
    def _lease(self, tier: Tier, rank: int) -> WriterLease:
        with self._lock:
            lease = self._leases.get((tier.name, rank))
            if lease is None:
                lease = WriterLease(tier.backend, tier.name, rank, self.owner, self.lease_ttl)
                self._leases[(tier.name, rank)] = lease
            return lease

    def _tier_leases(self, tier: str) -> list[WriterLease]:
        with self._lock:
            return [lease for (name, _), lease in self._leases.items() if name == tier]

    def acquire_leases(self, job: SaveJob) -> None:
        """Before ``submit(job)``, in the caller's thread: have the tier threads take this
        writer's lease on every tier of ``job`` not yet held, and raise
        :class:`WriterConflict` (nothing submitted, nothing written) when another live
        writer holds one. Waits at most ``TIERCKPT_LEASE_WAIT_S``, and only for a first
        attempt (or one after a conflict): a retry after an unreachable store goes on in the
        background, and its failure fails only that tier's copy (``job.lease_errors``)."""
        waits: dict[str, Future[BaseException | None]] = {}
        for t in job.tiers:
            lease = self._lease(t, job.rank)
            if lease.held or lease.lost is not None:
                continue
            fut: Future[BaseException | None] = Future()
            if not lease.attempted or isinstance(lease.last_error, WriterConflict):
                waits[t.name] = fut
            self._tier_q[t.name].put(("lease", job, fut))
        if not waits:
            return
        done, _ = wait_futures(waits.values(), timeout=acquire_wait())
        conflicts = [f.result() for f in done if isinstance(f.result(), WriterConflict)]
        if not conflicts:
            return
        for t in job.tiers:  # give back what this call took: this save writes nothing
            got = waits.get(t.name)
            if got is not None and got in done and got.result() is None:
                self._lease(t, job.rank).release()
        raise conflicts[0]  # type: ignore[misc]

    def _lease_request(self, tier: Tier, job: SaveJob, fut: Future[BaseException | None]) -> None:
        """Tier thread: take this writer's lease on ``tier`` (a no-op when held)."""
        try:
            self._lease(tier, job.rank).acquire()
        except WriterConflict as exc:
            job.lease_errors[tier.name] = exc
            fut.set_result(exc)
            return
        except Exception as exc:
            job.lease_errors[tier.name] = exc
            log.warning(
                "step %d: cannot take this writer's lease on tier %s (its copy of this step "
                "fails; tried again at the next save): %s",
                job.step,
                tier.name,
                exc,
            )
        fut.set_result(None)

    def _renew_leases(self, tier: Tier) -> None:
        """Tier thread: renew this tier's leases that are due (cheap when none is)."""
        now = time.monotonic()
        for lease in self._tier_leases(tier.name):
            if lease.next_renewal() <= now:
                lease.renew_if_due()

    def _renewal_timeout(self, tier: Tier) -> float | None:
        due = min(
            (lease.next_renewal() for lease in self._tier_leases(tier.name)), default=math.inf
        )
        return None if due == math.inf else max(0.0, due - time.monotonic())

    def may_collect(self, tier: Tier, rank: int) -> bool:
        """Whether retention may delete on ``tier`` now: only while this writer still holds
        its lease there, checked by reading it back."""
        with self._lock:
            lease = self._leases.get((tier.name, rank))
        if lease is None:
            return False
        try:
            lease.verify()
        except Exception as exc:
            log.warning("retention on tier %s skipped: %s", tier.name, exc)
            return False
        return True

    def release_leases(self) -> None:
        """Delete this writer's leases that are still its own (close, exit)."""
        with self._lock:
            leases = list(self._leases.values())
        for lease in leases:
            lease.release()

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
            now = time.monotonic()
            if end is not None and now >= end:
                return False
            wait = poll if end is None else max(0.0, min(poll, end - now))
            events = jobs[0].handle._tier_events
            for name in jobs[0].handle.tiers:
                if not events[name].wait(wait):
                    break
            self._give_up_stalled(drain=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _live.discard(self)
        self.drain()
        self._capture_q.put(None)
        for th in self._threads:
            # after drain() each thread has at most the call it is blocked in left (bounded by
            # its backend's timeouts), then only skips and aborts of given-up copies
            th.join()
        with self._lock:
            commit_pool = self._commit_pool
        if commit_pool is not None:
            commit_pool.shutdown(wait=True)  # each deferred commit is bounded by its timeout
        self._pool.shutdown(wait=True)
        self.release_leases()
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- interpreter exit ------------------------------------------------------------
    def _abandoned_error(self, job: SaveJob) -> TierCkptError:
        return TierCkptError(
            f"step {job.step}: abandoned at interpreter exit, unfinished after the exit "
            "timeout (TIERCKPT_EXIT_TIMEOUT_S); not committed"
        )

    def _check_abandoned(self, job: SaveJob) -> None:
        if self._abandoned:
            raise self._abandoned_error(job)

    def _drain_at_exit(self, started: float) -> None:
        """Finish in-flight saves by ``started + exit timeout``, else abandon them; then stop
        the threads (bounded). Called once, by :func:`_drain_at_exit`, on the main thread."""
        timeout = exit_timeout_s(self.exit_timeout_s)
        deadline = started + timeout
        jobs = self.in_flight()
        unfinished: list[SaveJob] = []
        try:
            for job in jobs:
                for t in job.handle.tiers:
                    left = max(0.0, deadline - time.monotonic())
                    if not job.handle._tier_events[t].wait(left):
                        unfinished.append(job)
                        break
        except BaseException:  # Ctrl-C while waiting: abandon now
            unfinished = [j for j in jobs if not j.handle.done()]
        if not unfinished:
            if jobs:
                log.warning(
                    "at exit: finished %d in-flight save(s) (step %s)",
                    len(jobs),
                    ", ".join(str(j.step) for j in jobs),
                )
            self.close()
            return
        with self._lock:  # from here no tier copy starts its commit
            self._abandoned = True
            committing = set(self._committing)
        for job in unfinished:
            open_tiers = [t for t in job.handle.tiers if not job.handle.done(t)]
            racing = [t for t in open_tiers if (job.step, t) in committing]
            dropped = [t for t in open_tiers if t not in racing]
            if dropped:
                log.warning(
                    "at exit: abandoned step %d on tier(s) %s after %.0f s "
                    "(TIERCKPT_EXIT_TIMEOUT_S): not committed there; older checkpoints are "
                    "untouched",
                    job.step,
                    ", ".join(dropped),
                    timeout,
                )
            if racing:
                log.warning(
                    "at exit: step %d was committing on tier(s) %s; a commit is atomic, so it "
                    "is there whole or not at all",
                    job.step,
                    ", ".join(racing),
                )
        self._pool.shutdown(wait=False, cancel_futures=True)  # queued encodes are not needed
        with self._lock:
            self._closed = True
        _live.discard(self)
        self._capture_q.put(None)
        # let the writers abort (temporary files, multipart uploads) and the threads end, so
        # none is frozen by the interpreter's teardown in the middle of a tensor copy
        grace_end = time.monotonic() + _EXIT_ABORT_GRACE_S
        for th in self._threads:
            th.join(max(0.0, grace_end - time.monotonic()))
        stuck = [th.name for th in self._threads if th.is_alive()]
        if stuck:
            log.warning("at exit: thread(s) %s still in a storage call; exiting anyway", stuck)
        else:  # nothing of this writer can publish any more: the location is free for the next
            try:
                self.release_leases()
            except Exception as exc:
                log.warning("at exit: could not give the writer leases back: %s", exc)

    # -- deadlines and follower bounds -------------------------------------------------
    def _stall_timeout(self) -> float | None:
        """How long capture may wait for arena space before the next stalled-tier check."""
        d = self.save_deadline
        if math.isinf(d):
            return None
        now = time.monotonic()
        with self._lock:
            holding = {name for st in self._held_chunks for name in st.holders}
            due = [self._stalled_since.get(name, now) + d - now for name in holding]
        return max(0.01, min(due)) if due else min(d, 1.0)

    def _give_up_stalled(self, *, drain: bool = False) -> None:
        """Give up the copies of the tiers that made no progress for ``save_deadline`` s.

        From capture (``drain=False``): the copies whose arena slots such a tier holds, which
        frees those slots. From :meth:`drain`: every copy of such a tier not yet committing.
        """
        d = self.save_deadline
        if math.isinf(d):
            return
        now = time.monotonic()
        verdicts: list[tuple[Tier, SaveJob, BaseException]] = []
        released: list[_ChunkState] = []
        with self._lock:
            stalled = {n: now - t for n, t in self._stalled_since.items() if now - t >= d}
            if not stalled:
                return
            if drain:
                pairs = [(t, j) for j in self._in_flight for t in j.tiers if t.name in stalled]
                what = "close()/wait() waited for it"
            else:
                pairs = [
                    (self._by_name[n], st.job)
                    for st in self._held_chunks
                    for n in st.holders
                    if n in stalled
                ]
                what = "training waited for host arena space it holds"
            seen: set[tuple[str, int]] = set()
            for tier, job in pairs:
                if (tier.name, id(job)) in seen:
                    continue
                seen.add((tier.name, id(job)))
                err = SaveDeadlineExceeded(
                    f"{job.id}: tier {tier.name!r} ({tier.backend.url}) made no progress "
                    f"for {stalled[tier.name]:.1f} s, past save_deadline={d:g} s, while {what}; "
                    "its copy of this step is given up (it never commits there) so training "
                    "goes on, and the next save tries the tier again. If the tier is down, its "
                    "own errors are in the log; if it is only slow, raise save_deadline "
                    "(TIERCKPT_SAVE_DEADLINE) or let it copy from a local tier (source=...)"
                )
                if self._give_up_locked(tier, job, err, released):
                    verdicts.append((tier, job, err))
        self._release_slots(released)
        for t, j, why in verdicts:
            self._report_given_up(t, j, why)

    def _give_up_locked(
        self, tier: Tier, job: SaveJob, err: BaseException, released: list[_ChunkState]
    ) -> bool:
        """Record that ``tier`` gives ``job`` up and drop its holds on arena slots (the lock is
        held). False if it is too late: the copy started committing or is done already."""
        name = tier.name
        if name in job.given_up or name in job.settled or job.handle.done(name):
            return False
        job.given_up[name] = err
        self._unfollow_locked(name, job)
        for st in list(self._held_chunks):
            if st.job is job and name in st.holders:
                st.holders.discard(name)
                if not st.holders:
                    self._held_chunks.remove(st)
                    released.append(st)
        return True

    def _release_slots(self, states: list[_ChunkState]) -> None:
        for st in states:
            st.encoded.clear()
            assert self.arena is not None
            self.arena.release(st.slot)

    def _report_given_up(self, tier: Tier, job: SaveJob, err: BaseException) -> None:
        """Report a given-up copy now (the tier's thread may stay blocked for a while)."""
        self._source_done(tier, job, None, err)
        outcome = "skipped" if isinstance(err, CopySkipped) else "deadline"
        self._finish(tier, job, None, err, outcome=outcome, defer_hooks=True)

    def _check_given_up(self, tier: Tier, job: SaveJob) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
        if err is not None:
            raise err

    def _enter_commit(self, tier: Tier, job: SaveJob) -> None:
        """From here on ``tier``'s copy of ``job`` can no longer be given up (or it was)."""
        with self._lock:
            err = job.given_up.get(tier.name)
            if err is None:
                job.settled.add(tier.name)
                self._unfollow_locked(tier.name, job)  # the source's file is read: let it go
        if err is not None:
            raise err

    def _register_follows(self, job: SaveJob) -> None:
        """A follower holds at most ``max_behind`` source steps: skip its oldest waiting ones."""
        skipped: list[tuple[Tier, SaveJob, BaseException]] = []
        released: list[_ChunkState] = []
        with self._lock:
            for name, follow in job.follows.items():
                tier = self._by_name[name]
                held = self._following.setdefault(name, [])
                held.append(job)
                active = self._follow_active.get(name)
                waiting = [j for j in held if j is not active]
                for old in waiting[: max(0, len(held) - tier.spec.max_behind)]:
                    src = follow.source.name
                    doing = f"still on {active.id}" if active is not None else "busy"
                    err = CopySkipped(
                        f"{old.id}: tier {name!r} skipped its copy from tier {src!r}: it "
                        f"would hold more than max_behind={tier.spec.max_behind} steps of tier "
                        f"{src!r} ({doing}); tier {src!r} keeps {old.id} only under its "
                        f"own retention and tier {name!r} copies a newer step next. Its own "
                        "errors, if any, are in the log"
                    )
                    if self._give_up_locked(tier, old, err, released):
                        skipped.append((tier, old, err))
        self._release_slots(released)
        for t, j, why in skipped:
            self._report_given_up(t, j, why)

    def _unfollow_locked(self, name: str, job: SaveJob) -> None:
        held = self._following.get(name)
        if held is not None and job in held:
            held.remove(job)
        if self._follow_active.get(name) is job:
            del self._follow_active[name]

    def _protected(self, tier: Tier, job: SaveJob) -> set[CheckpointId]:
        """Checkpoints retention on ``tier`` must keep besides its newest: those still being
        saved there, and (for a source) those its followers hold, at most ``max_behind`` each."""
        with self._lock:
            ids = {
                j.id
                for j in self._in_flight
                if j is not job
                and tier.name in j.handle.tiers
                and tier.name not in j.given_up
                and not j.handle.done(tier.name)
            }
            for name, held in self._following.items():
                if self._by_name[name].spec.source == tier.name:
                    ids.update(j.id for j in held)
        return ids

    def _retain(self, tier: Tier, job: SaveJob) -> None:
        if not self.may_collect(tier, job.rank):
            return
        try:
            gc_tier(tier.backend, tier.spec.keep_last, protect=self._protected(tier, job))
        except (BackendError, OSError) as exc:
            log.warning("retention on tier %s failed (will retry next save): %s", tier.name, exc)

    # -- capture ---------------------------------------------------------------------
    def _ensure_arena(self, plan: ShardLayout) -> HostArena:
        """The arena, grown (once, between saves) if this plan needs bigger or more slots."""
        biggest = max((c.raw_size for c in plan.chunks), default=0)
        slot = align_up(max(biggest, 4096))
        a = self.arena
        if a is not None:
            slot = max(slot, a.slot_bytes)
        cap = max(2, self.host_buffer_bytes // slot)
        want = min(max(2, len(plan.chunks), a.n_slots if a else 0), cap)
        if a is not None and a.slot_bytes >= slot and a.n_slots >= want:
            return a
        if a is not None:
            # a bigger state than any before: grow once, between saves
            while not a.wait_idle(self._stall_timeout()):
                self._give_up_stalled()
            a.close()
        self.arena = HostArena(want, slot)
        log.debug(
            "host arena: %d slots x %d bytes (%.2f s to allocate)",
            want,
            slot,
            self.arena.alloc_seconds,
        )
        return self.arena

    def _acquire(self, a: HostArena) -> int:
        """A free arena slot; a tier that holds slots without progress past the deadline is
        given up meanwhile, so this waits at most about ``save_deadline`` per stalled tier."""
        while True:
            try:
                return a.acquire(timeout=self._stall_timeout())
            except TimeoutError:
                self._give_up_stalled()

    def _capture_loop(self) -> None:
        while True:
            job = self._capture_q.get()
            if job is None:
                for q in self._tier_q.values():
                    q.put(None)
                return
            try:
                self._capture(job)
            except BaseException as exc:
                # at exit, say so (not e.g. that the encode pool, shut down, refused a chunk)
                error = self._abandoned_error(job) if self._abandoned else exc
                job.capture_error = error
                log.error("step %d: capture failed: %s", job.step, error)
                job.handle._set_captured(error)
            for t in job.tiers:
                self._tier_q[t.name].put(("end", job, None))

    def _capture(self, job: SaveJob) -> None:
        emit = self._emitter(job.step, None)
        self._check_abandoned(job)
        if job.plan is None:
            assert job.collected is not None
            t0 = time.perf_counter() if emit else 0.0
            job.plan = layout_plan(job.collected, job.chunk_bytes or self.chunk_bytes)
            job.collected = None
            if emit is not None:
                emit("plan", job.plan.data_bytes, time.perf_counter() - t0)
        plan = job.plan
        by_name = {t.name: t for t in job.tiers}
        job.follows = {
            t.name: _Follow(by_name[t.spec.source])
            for t in job.tiers
            if t.spec.source is not None and t.spec.source in by_name
        }
        direct = [t for t in job.tiers if t.name not in job.follows]
        self._register_follows(job)
        a = self._ensure_arena(plan)
        self._grace(job)
        for t in job.tiers:
            self._tier_q[t.name].put(("start", job, None))
        events = []
        for chunk in plan.chunks:
            with self._lock:
                if all(t.name in job.given_up for t in direct):
                    break  # every tier fed from the arena gave this save up: nothing to copy
            t0 = time.perf_counter() if emit else 0.0
            self._check_abandoned(job)
            slot = self._acquire(a)
            try:
                t1 = time.perf_counter() if emit else 0.0
                slot_t = a.slot(slot)
                event = copy_chunk(plan, chunk, slot_t, self._streams, job.ready_events)
            except BaseException:
                a.release(slot)
                raise
            if emit is not None:
                emit("arena_wait", chunk.raw_size, t1 - t0)
                emit("capture", chunk.raw_size, time.perf_counter() - t1)
            if event is not None:
                events.append(event)
            view = memoryview(slot_t[: chunk.raw_size].numpy())  # type: ignore[arg-type]
            with self._lock:  # a tier given up meanwhile gets no more chunks of this save
                takers = [t for t in direct if t.name not in job.given_up]
                state = _ChunkState(chunk, slot, job, {t.name for t in takers})
                for codec in {t.codec for t in takers}:
                    state.encoded[codec] = self._pool.submit(
                        _encode, codec, chunk.dtype, view, event, emit
                    )
                if takers:
                    self._held_chunks.append(state)
                now = time.monotonic()
                for t in takers:  # a tier's clock runs from when it has work it has not done
                    self._stalled_since.setdefault(t.name, now)
            if not takers:
                a.release(slot)
                break
            for t in takers:
                self._tier_q[t.name].put(("chunk", job, state))
        for ev in events:
            ev.synchronize()
        job.handle._set_captured()

    # -- tiers -----------------------------------------------------------------------
    def _release(self, state: _ChunkState, tier: str) -> None:
        """``tier`` is done with this chunk; the last holder frees its slot (a given-up tier
        no longer holds it, so this is then a no-op)."""
        with self._lock:
            if tier not in state.holders:
                return
            state.holders.discard(tier)
            last = not state.holders
            if last:
                self._held_chunks.remove(state)
        if last:
            self._release_slots([state])

    def _tier_busy(self, tier: Tier, *, progressed: bool, idle: bool) -> None:
        """Track the tier thread's progress for the deadline. A clock runs from when it is
        handed work while it makes none: each chunk written or item finished resets it, failures and
        skips do not. Idle after progress the clock stops; idle after a failure (presumed
        down) it keeps running, and the next save gives the tier a short grace instead of a
        whole deadline (:meth:`_grace`)."""
        now = time.monotonic()
        with self._lock:
            if idle:
                self._busy.discard(tier.name)
                if progressed:
                    self._stalled_since.pop(tier.name, None)
            else:
                self._busy.add(tier.name)
                if progressed or tier.name not in self._stalled_since:
                    self._stalled_since[tier.name] = now

    def _grace(self, job: SaveJob) -> None:
        """A new save for an idle tier presumed down (its last work failed, no progress
        since): it has ``min(save_deadline, 5 s)`` to show progress before capture gives it
        up, so an outage costs each save that long, not a whole deadline; while its thread
        is still blocked in a call, the old clock runs on and later saves give it up at once."""
        d = self.save_deadline
        floor = time.monotonic() - d + min(d, RETRY_GRACE_S)
        with self._lock:
            for t in job.tiers:
                since = self._stalled_since.get(t.name)
                if since is not None and t.name not in self._busy:
                    self._stalled_since[t.name] = max(since, floor)

    def _tier_loop(self, tier: Tier) -> None:
        q = self._tier_q[tier.name]
        progress: dict[int, _TierWrite] = {}
        while True:
            try:
                item = q.get(timeout=self._renewal_timeout(tier))
            except queue.Empty:
                self._renew_leases(tier)
                continue
            if item is None:
                return
            kind, job, payload = item
            if kind == "lease":
                self._lease_request(tier, job, payload)
                continue
            self._tier_busy(tier, progressed=False, idle=False)
            tw = progress.setdefault(id(job), _TierWrite())
            ok = False
            try:
                if kind == "start":
                    self._tier_start(tier, job, tw)
                elif kind == "chunk":
                    try:
                        if tw.error is None and self._abandoned:
                            tw.error = self._abandoned_error(job)
                        if tw.error is None:
                            self._tier_chunk(tier, job, tw, payload)
                    finally:
                        self._release(payload, tier.name)
                elif kind == "end":
                    del progress[id(job)]
                    self._tier_end(tier, job, tw)
                ok = tw.error is None
            except BaseException as exc:
                tw.error = exc
                if tw.writer is not None:
                    tw.writer.abort()
                    tw.writer = None
                if kind == "end":
                    self._tier_failed(tier, job, exc)
            finally:
                self._tier_busy(tier, progressed=ok, idle=q.empty())

    def _tier_failed(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        with self._lock:
            given_up = job.given_up.get(tier.name)
            if given_up is None:
                job.settled.add(tier.name)  # failed on its own: reported once, as that
        self._source_done(tier, job, None, given_up or error)
        if given_up is not None:
            return  # reported when it was given up
        self._finish(tier, job, None, error)
        if self.retains(tier, job) and not tier.backend.is_remote:
            # a failed save (disk full) runs retention too, so the disk frees itself; a
            # remote tier that just failed would likely fail again: its next commit does it
            self._retain(tier, job)

    def _tier_start(self, tier: Tier, job: SaveJob, tw: _TierWrite) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
            if err is None and tier.name in job.follows:
                self._follow_active[tier.name] = job
        if err is not None:
            raise err
        lease_error = job.lease_errors.get(tier.name)
        if lease_error is not None:
            raise lease_error
        self._lease(tier, job.rank).acquire()  # a no-op while held; raises once lost
        if tier.backend.exists(manifest_name(job.step, timeline=job.timeline)):
            raise FileExistsError(
                f"{job.id} is already committed on tier {tier.name!r} "
                f"({tier.backend.url}); refusing to overwrite it — save under another step or "
                "delete the old one first (tierckpt gc)"
            )
        tw.writer = tier.backend.open_writer(job.shard_on(tier))
        tw.emit = self._emitter(job.step, tier.name)

    def _tier_chunk(self, tier: Tier, job: SaveJob, tw: _TierWrite, state: _ChunkState) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
            enc = state.encoded.get(tier.codec) if tier.name in state.holders else None
        if err is not None:
            raise err
        assert enc is not None, "a tier writes only chunks it holds"
        self._append(tier, tw, state.plan, enc.result())
        # given up during the write: the slot may hold other bytes by now; stop here
        self._check_given_up(tier, job)

    def _append(self, tier: Tier, tw: _TierWrite, chunk: ChunkPlan, enc: Encoded) -> None:
        """Write one encoded chunk at the next aligned offset and record it."""
        assert tw.writer is not None
        self._renew_leases(tier)  # a long save (or copy from a source) must not let it lapse
        start = align_up(tw.offset)
        if start > tw.offset and not tier.backend.supports_random_write:
            tw.writer.write(tw.offset, _ZEROS[: start - tw.offset])
        t0 = time.perf_counter()
        tw.writer.write(start, enc.data)
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        self._tier_busy(tier, progressed=True, idle=False)
        n = len(memoryview(enc.data).cast("B"))
        if tw.emit is not None:
            tw.emit("write", n, seconds)
        try:
            codec_idx = tw.codecs.index(enc.codec_config)
        except ValueError:
            tw.codecs.append(enc.codec_config)
            codec_idx = len(tw.codecs) - 1
        rec = ChunkRecord(chunk.logical_offset, chunk.raw_size, n, start, codec_idx, enc.checksum)
        tw.records.append(rec.to_json())
        tw.offset = start + n
        tw.stored += n

    def _tier_end(self, tier: Tier, job: SaveJob, tw: _TierWrite) -> None:
        if job.capture_error is not None:
            raise job.capture_error
        if tw.error is not None:
            raise tw.error
        follow = job.follows.get(tier.name)
        if follow is not None:
            self._copy_from_source(tier, job, tw, follow)
        self._enter_commit(tier, job)
        assert tw.writer is not None
        index = {
            "format": "tierckpt-shard",
            "version": FORMAT_VERSION,
            "step": job.step,
            **({"timeline": job.timeline} if job.timeline else {}),
            "rank": job.rank,
            "world_size": job.world_size,
            "checksum_algo": CHECKSUM_ALGO,
            "codecs": tw.codecs,
            "chunks": tw.records,
            **job.laid_out.index_skeleton(),
        }
        blob = encode_index(index)
        index_offset = tw.offset
        t0 = time.perf_counter() if tw.emit else 0.0
        tw.writer.write(index_offset, blob)
        size = index_offset + len(blob) + FOOTER_SIZE
        footer = Footer(index_offset, len(blob), checksum(blob), size)
        tw.writer.write(index_offset + len(blob), footer.encode())
        if tw.emit is not None:
            tw.emit("write", len(blob) + FOOTER_SIZE, time.perf_counter() - t0)
        if tw.writer.size != size:
            raise FormatError(f"shard size {tw.writer.size} != expected {size}")
        self._check_abandoned(job)
        # publishing replaces whatever has this name: only while the location is still ours
        self._lease(tier, job.rank).verify()
        t0 = time.perf_counter()
        tw.writer.commit()
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        if tw.emit is not None:
            tw.emit("sync", size, seconds)
        self._source_done(tier, job, (job.shard_on(tier), tw.records, tw.codecs), None)
        if isinstance(tier.codec, SupportsObserve):  # the auto policy learns the link's speed
            tier.codec.observe(tw.stored, tw.write_seconds)
        tw.writer = None
        ref = ShardRef(job.rank, job.shard_on(tier), size, footer.index_checksum)
        key = (job.step, tier.name)
        with self._lock:  # the exit handler abandons under the same lock: commit or abandon
            if self._abandoned:
                raise self._abandoned_error(job)
            self._committing.add(key)
        t0 = time.perf_counter() if tw.emit else 0.0
        try:
            pending = self.commit(tier, job, ref, job.laid_out.data_bytes, tw.stored)
        finally:
            with self._lock:
                self._committing.discard(key)
        if tw.emit is not None:  # a deferred (multi-rank) commit: only its first part
            tw.emit("commit", job.laid_out.data_bytes, time.perf_counter() - t0)
        if pending is not None:
            codecs = list(tw.codecs)
            stored = tw.stored
            pending.add_done_callback(lambda f: self._after_deferred(tier, job, stored, codecs, f))
            return
        self._after_commit(tier, job, tw.stored, tw.codecs, None)

    def _source_done(
        self,
        tier: Tier,
        job: SaveJob,
        result: tuple[str, list[list[Any]], list[dict[str, Any]]] | None,
        error: BaseException | None,
    ) -> None:
        """Hand this tier's durable file (or its failure) to the tiers that copy from it."""
        for f in job.follows.values():
            if f.source is tier and not f.done.done():
                if error is not None:
                    f.done.set_exception(error)
                else:
                    assert result is not None
                    f.done.set_result(result)

    def _copy_from_source(self, tier: Tier, job: SaveJob, tw: _TierWrite, follow: _Follow) -> None:
        """Read the source tier's durable file chunk by chunk into this tier's writer."""
        src = follow.source
        try:
            file, records, codecs = follow.done.result()
        except BaseException as exc:
            raise TierCkptError(
                f"step {job.step}: tier {tier.name!r} copies from tier {src.name!r}, whose copy "
                f"failed: {exc}"
            ) from exc
        chunks = job.laid_out.chunks
        if len(records) != len(chunks):
            raise FormatError(
                f"step {job.step}: tier {src.name!r} wrote {len(records)} chunks, "
                f"the plan has {len(chunks)}"
            )
        stored_buf: torch.Tensor | None = None
        raw_buf: torch.Tensor | None = None
        source_codecs = [codec_from_config(c) for c in codecs]
        for i, fields in enumerate(records):
            self._check_abandoned(job)
            self._check_given_up(tier, job)
            rec = ChunkRecord(*fields)
            if stored_buf is None or stored_buf.numel() < rec.stored_size:
                stored_buf = torch.empty(max(rec.stored_size, 1), dtype=torch.uint8)
            stored = memoryview(stored_buf.numpy())[: rec.stored_size]  # type: ignore[arg-type]
            where = f"tier {src.name!r} {src.backend.url}/{file}, read back for tier {tier.name!r}"
            read_verified(src.backend, file, rec, i, stored, tier=src.name, where=where)
            codec = source_codecs[rec.codec]
            if codec.is_passthrough:
                raw = stored
            else:
                if raw_buf is None or raw_buf.numel() < rec.raw_size:
                    raw_buf = torch.empty(max(rec.raw_size, 1), dtype=torch.uint8)
                raw = memoryview(raw_buf.numpy())[: rec.raw_size]  # type: ignore[arg-type]
                codec.decode(stored, raw)
            enc = _encode(tier.codec, chunks[i].dtype, raw, None, tw.emit)
            self._append(tier, tw, chunks[i], enc)

    def _after_deferred(
        self,
        tier: Tier,
        job: SaveJob,
        stored: int,
        codecs: list[dict[str, Any]],
        done: Future[None],
    ) -> None:
        try:
            self._after_commit(tier, job, stored, codecs, done.exception())
        except BaseException as exc:  # a callback's error would otherwise be lost
            if not job.handle.done(tier.name):
                self._finish(tier, job, None, exc)

    def _after_commit(
        self,
        tier: Tier,
        job: SaveJob,
        stored: int,
        codecs: list[dict[str, Any]],
        error: BaseException | None,
    ) -> None:
        if error is not None:
            self._finish(tier, job, None, error)
            return
        seconds = time.perf_counter() - job.handle.started
        codec_desc = ",".join(sorted({c["id"] for c in codecs})) or "raw"
        result = TierResult(
            tier.name, job.step, job.laid_out.data_bytes, stored, seconds, codec_desc, job.timeline
        )
        log.info(
            "committed %s on %s: %d bytes in %.3f s (%.2f GB/s), codec %s ratio %.2f",
            job.id,
            tier.name,
            result.raw_bytes,
            seconds,
            result.gbps,
            codec_desc,
            result.ratio,
        )
        # the owner says which ranks apply retention where; only while holding the lease
        if self.retains(tier, job):
            self._retain(tier, job)
        self._finish(tier, job, result, None)

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
        """Report ``tier``'s copy of ``job`` done: committed (``result``) or not (``error``,
        counted as ``outcome``). ``defer_hooks``: the caller must not block (capture)."""
        if error is not None:
            if outcome == "skipped":
                log.warning("%s", error)
            else:
                log.error("step %d failed on tier %s: %s", job.step, tier.name, error)
            hook = self.on_failure
            if hook is not None:
                # e.g. tell rank 0 not to wait for this rank (I/O on a tier that may hang)
                err: BaseException = error
                if defer_hooks:
                    self.defer(lambda: hook(tier, job, err))
                else:
                    hook(tier, job, err)
        with self._lock:
            self._counts[tier.name]["committed" if error is None else outcome] += 1
            self._unfollow_locked(tier.name, job)
        if result is not None and self.on_result is not None:
            self.on_result(result, job.handle)
        job.handle._set_tier(tier.name, result, error)
        if job.handle.done():
            with self._lock:
                if job in self._in_flight:
                    self._in_flight.remove(job)
            if job.plan is not None:
                job.plan.sources.clear()
            job.collected = None


def _rank_zero_retains(tier: Tier, job: SaveJob) -> bool:
    return job.rank == 0


def _encode(
    tier_codec: Codec, dtype: str, view: memoryview, event: Any, emit: _Emit | None = None
) -> Encoded:
    if event is not None:
        event.synchronize()
    if isinstance(tier_codec, SupportsProfile):  # the auto policy measures its candidate, once
        tier_codec.profile(dtype, view)
    codec = tier_codec.for_dtype(dtype)
    data: BytesLike
    if codec.is_passthrough:
        data, config = view, codec.get_config()
    else:
        t0 = time.perf_counter() if emit else 0.0
        out = codec.encode(view)
        if emit is not None:
            emit("encode", len(view), time.perf_counter() - t0)
        if len(memoryview(out).cast("B")) >= len(view):
            # incompressible: store raw bytes, never more than raw
            data, config = view, {"id": "raw"}
        else:
            data, config = out, codec.get_config()
    t0 = time.perf_counter() if emit else 0.0
    digest = checksum(data)
    if emit is not None:
        emit("checksum", len(memoryview(data).cast("B")), time.perf_counter() - t0)
    return Encoded(data, digest, config)


def exit_timeout_s(configured: float | None = None) -> float:
    """Seconds in-flight saves get at interpreter exit: ``configured``, else
    ``TIERCKPT_EXIT_TIMEOUT_S``, else :data:`DEFAULT_EXIT_TIMEOUT_S` (0: abandon at once)."""
    try:
        return config.exit_timeout_s(configured)
    except ValueError as exc:  # read at interpreter exit too: never raise there
        log.warning("%s; using %.0f", exc, DEFAULT_EXIT_TIMEOUT_S)
        return DEFAULT_EXIT_TIMEOUT_S


#: pipelines not yet closed, drained at interpreter exit (weakly: a dropped one is gone)
_live: weakref.WeakSet[Pipeline] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_installed = False


def _track(pipeline: Pipeline) -> None:
    """Remember a live pipeline; install the exit handler on first use."""
    global _exit_hook_installed
    _live.add(pipeline)
    with _exit_hook_lock:
        if _exit_hook_installed:
            return
        _exit_hook_installed = True
    # threading's exit hooks run when the main thread is done, before concurrent.futures
    # shuts its executors down (it registered earlier, and these run last-registered first):
    # the encode pool and S3's part uploads still work while saves finish. ``atexit`` would
    # run only after that, too late.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_drain_at_exit)
        else:  # pragma: no cover - every supported Python has it
            atexit.register(_drain_at_exit)
    except RuntimeError:  # the interpreter is already shutting down
        pass


def _drain_at_exit() -> None:
    """Interpreter exit: finish or abandon every live pipeline's in-flight saves (bounded).

    Never raises and never changes the exit status: that stays the script's own.
    """
    try:
        started = time.monotonic()
        pipelines = [p for p in list(_live) if not p._closed]
        busy = [(p, p.in_flight()) for p in pipelines]
        steps = sorted({j.step for _p, jobs in busy for j in jobs})
        if steps:
            longest = max(exit_timeout_s(p.exit_timeout_s) for p, jobs in busy if jobs)
            log.warning(
                "interpreter exit with %d save(s) in flight (step %s): waiting up to %.0f s "
                "for them (TIERCKPT_EXIT_TIMEOUT_S); call close() or wait() on the "
                "checkpointer before exiting to wait for them yourself",
                len(steps),
                ", ".join(map(str, steps)),
                longest,
            )
        for p in pipelines:
            p._drain_at_exit(started)
    except BaseException as exc:  # never let the exit hook change how the script ends
        try:
            log.warning("at exit: draining in-flight saves failed: %s", exc)
        except BaseException:
            pass


#: how long exit waits for that (a store that cannot be reached must not hold the exit)
EXIT_RELEASE_SECONDS = 10.0


@atexit.register
def _release_idle_leases() -> None:
    # the live pipelines the exit drain left idle and open: a process that ends without
    # close() would otherwise hold its leases until their ttl runs out on other machines
    idle = [p for p in list(_live) if not p._closed and not p.in_flight()]
    if not idle:
        return

    def release() -> None:
        for p in idle:
            try:
                p.release_leases()
            except Exception:  # never fail the interpreter's exit
                pass

    th = threading.Thread(target=release, name="tierckpt-exit", daemon=True)
    th.start()
    th.join(EXIT_RELEASE_SECONDS)


_Owner = TypeVar("_Owner", bound="PipelineOwner")


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

    def _pipeline_hooks(self) -> PipelineHooks:
        """What this owner plugs into the Pipeline (``commit`` at least)."""
        raise NotImplementedError

    def _get_pipeline(self) -> Pipeline:
        """The pipeline, started on first use."""
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
        return self._pipeline

    def _release(self) -> None:
        """Extra resources of the owner, released by ``close()`` after the pipeline."""

    def close(self) -> None:
        """Wait for in-flight saves to finish on every tier, then release threads and memory."""
        if self._closed:
            return
        self._closed = True
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        self._release()
        for t in self._tiers:
            t.backend.close()

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._pipeline is not None:
                self._pipeline.close()
        except Exception:
            pass
