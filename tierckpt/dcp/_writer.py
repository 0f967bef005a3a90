"""``TierWriter``: each rank streams one shard file per tier through the pipeline; the
coordinator writes DCP's metadata and, last, each tier's manifest (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import sys
import threading
import uuid
import weakref
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt import config
from tierckpt.config import resolve_writer_config
from tierckpt.dcp._commit import choose_timeline, commit_all, gather_reports
from tierckpt.dcp._common import _DCP_VERSION, TiersArg, _parse_step, _runtimes, take_loaded
from tierckpt.dcp._metadata import _PlanInfo, _ShardOnTier, encode_metadata
from tierckpt.dcp._parking import HookTarget, park, save_ended
from tierckpt.dcp._saves import (
    GLOBAL,
    LOCAL,
    META,
    RESET,
    SETUP,
    WRITTEN,
    LocalPlanInfo,
    Saves,
    SaveState,
    mixed,
    need_step,
)
from tierckpt.dcp._shardjob import ShardSaving, collect_items, shards_result
from tierckpt.distributed import is_private_tier
from tierckpt.errors import FormatError, StaleTimeline, TierCkptError
from tierckpt.format import CheckpointId, ShardRef, step_prefix
from tierckpt.pipeline import Pipeline, PipelineHooks, SaveJob, Tier, wait_at_exit_for
from tierckpt.urls import as_policy

log = logging.getLogger("tierckpt")


class TierWriter(ShardSaving, StorageWriter):
    """A DCP ``StorageWriter`` that saves through tierckpt tiers (see the module docstring).

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`; a folder path or URL
            (``"/nvme/run1"``, ``"s3://bucket/run1"``) is that one tier (:func:`tierckpt.tier`),
            and a list may mix tiers and locations (a tier's ``every=N`` takes
            the steps that are multiples of ``N``, as for :class:`~tierckpt.Checkpointer`:
            with ``every=2``, steps 3, 5, 7, 8 put only step 8 there; ``keep_last`` is applied
            after each commit).
        step: the step to save; or pass it as DCP's ``checkpoint_id``.
        chunk_bytes, host_buffer_bytes, io_threads: as for :class:`~tierckpt.Checkpointer`.
        overwrite: what a save of a step that is already committed does. ``False`` (default):
            refused with :class:`~tierckpt.CheckpointExists` (a ``RuntimeError`` whose message
            says "Checkpoint already exists", as ``FileSystemWriter(overwrite=False)``'s).
            ``True``: saved again on a new timeline; a load of that step (or of the newest)
            then reads the new save, and the committed one stays until retention removes it —
            nothing committed is lost or overwritten in place. Neither applies to a rollback:
            after this process loaded an older checkpoint of these tiers than the newest
            (``TierReader``), the next saves go on a new timeline, as for ``Checkpointer``.

    Reuse one writer for every save of a run: its host buffer and threads stay warm. Saves
    through it may overlap (a ``dcp.async_save`` started before the previous one's future is
    done): each keeps its own step and plan from start to commit (see
    :mod:`tierckpt.dcp._saves`); give each its own process group, as DCP's collectives of two
    saves in flight must not share one (a save whose collectives were matched with another's
    fails on every rank, nothing of it committed). It
    holds threads, and its writer lease on every tier it wrote to, until :meth:`close` (or
    garbage collection); another writer on the same location is refused with
    :class:`~tierckpt.WriterConflict` meanwhile.

    A writer pickles as its configuration (no threads, locks or clients), so
    ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)`` works: the
    background process unpickles one writer per original writer and reuses it for every later
    save it is sent (its threads, buffer and leases live in that process). That process then
    holds the tiers' leases: do not save through the original writer in the trainer as well.

    DCP's own idiom, a new writer per ``dcp.save`` that is never closed, costs no setup per
    save: a writer collected without :meth:`close` parks its idle pipeline (threads, host
    buffer, leases) in this process and the next writer of the same tiers and settings adopts
    it (at most two are parked; the leases stay held until a writer that adopted them is
    closed, or the process ends). In one process the newest writer of a location takes it over
    from an older one that is not inside a save.
    """

    def __init__(
        self,
        tiers: TiersArg,
        step: int | str | None = None,
        *,
        chunk_bytes: int | None = None,
        host_buffer_bytes: int | None = None,
        io_threads: int | None = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__()
        self.policy = as_policy(tiers)
        self.step: int | None = None if step is None else _parse_step(step)
        sizes = resolve_writer_config(host_buffer_bytes, chunk_bytes, io_threads)
        self.host_buffer_bytes = sizes.host_buffer_bytes
        self.chunk_bytes = sizes.chunk_bytes
        self.io_threads = sizes.io_threads
        self.overwrite = bool(overwrite)
        #: identifies this writer across pickling (see _unpickle_writer)
        self._key = uuid.uuid4().hex
        self._runtime_state()

    def _runtime_state(self) -> None:
        """What lives in one process only (tiers with their clients, pipeline, lock), fresh."""
        #: the id, rank and role of the latest save begun (each save keeps its own: _saves)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._tiers: list[Tier] = _runtimes(self.policy)
        self._pipeline: Pipeline | None = None
        self._lock = threading.Lock()
        #: one save at a time takes the location over, starts the pipeline, takes the leases
        #: and submits its job (overlapping saves must not start two pipelines)
        self._start_lock = threading.Lock()
        #: the coordinator's timeline choice, one save at a time (reentrant: a save that ends
        #: meanwhile updates _last_saved under it)
        self._plan_lock = threading.RLock()
        self._saves = Saves(self._save_ended)
        self._shards: dict[int, dict[str, _ShardOnTier]] = {}
        self._closed = False
        self._pid = os.getpid()
        self._hook: HookTarget | None = None
        #: saves of this writer between their shard and their commit (see _take_over)
        self._in_save = 0
        self._taken_over = False
        #: the coordinator's timeline (None: chosen from the tiers at the next save) and the
        #: newest checkpoint of this writer's saves that ended; as for Checkpointer (a save in
        #: flight beside another is not "the previous save": see prepare_global_plan)
        self._timeline: int | None = None
        self._last_saved: CheckpointId | None = None
        #: the coordinator's tiers that could not be listed when its timeline was chosen:
        #: checked before each commit there, until one passes (see confirm_timeline)
        self._unconfirmed: frozenset[str] = frozenset()
        _WRITERS.add(self)
        wait_at_exit_for(_async_save_threads)

    #: what a pickled writer carries: its configuration, not its threads, lock or clients
    _PICKLED = (
        "policy",
        "step",
        "host_buffer_bytes",
        "chunk_bytes",
        "io_threads",
        "overwrite",
        "_key",
        "exit_timeout_s",
        "save_deadline",
    )

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in self._PICKLED:
            setattr(self, k, state[k])
        self._runtime_state()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_writer, (self.__getstate__(),))

    # -- DCP protocol ------------------------------------------------------------------
    # Each save's calls read only that save's SaveState (the one of the calling thread), so
    # saves that overlap on one writer never see each other's step, plan or job.
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        step = self.step if checkpoint_id is None else _parse_step(checkpoint_id)
        self.step = step  # the step of later saves made without a checkpoint_id
        self.save_id = self._saves.begin(step).save_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            _parse_step(checkpoint_id)
        except (ValueError, FormatError):
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise NotImplementedError(
                "tierckpt.dcp.TierWriter commits one manifest per checkpoint and needs DCP's "
                "collectives (use_collectives=True)"
            )
        s = self._saves.current(self.step, RESET, META)
        s.stage = SETUP
        rank = kwargs.get("rank")
        s.is_coordinator = self.is_coordinator = is_coordinator
        s.rank = self.rank = int(rank) if rank is not None else _dist_rank()

    def storage_meta(self) -> StorageMeta | None:
        """``checkpoint_id`` is where the checkpoint lives (as ``FileSystemWriter``'s path):
        the step's folder on the first tier every rank shares, e.g. ``/ck/steps/000000000100``
        or ``s3://b/run/steps/000000000100.t000001`` once the timeline is chosen (the
        ``Metadata`` ``dcp.save`` returns has it); ``TierReader`` takes it as a
        ``checkpoint_id``."""
        s = self._saves.current(self.step, RESET, RESET)
        s.stage = META
        location = self._location(need_step(s.step), self._timeline or 0)
        return StorageMeta(checkpoint_id=location, save_id=s.save_id)

    def _location(self, step: int, timeline: int) -> str:
        shared = [t for t in self._tiers if not is_private_tier(t)] or self._tiers
        if not shared:
            return step_prefix(step, timeline=timeline).rstrip("/")
        return f"{shared[0].backend.url.rstrip('/')}/{step_prefix(step, timeline=timeline)}"[:-1]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        s = self._saves.current(self.step, RESET, SETUP)
        step = need_step(s.step)
        s.stage = LOCAL
        try:
            refused = self._claim(s, step)
        except BaseException:
            self._saves.end(s)
            raise
        return dataclasses.replace(plan, storage_data=LocalPlanInfo(step, refused))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: choose the timeline (as :class:`~tierckpt.Checkpointer` does:
        at the first save, and when the step is below the previous save's, from the newest
        checkpoint on the tiers; a step not after it starts a new timeline) and hand it to
        every rank with its plan.

        A step already committed where this save would go (the timeline this writer goes on
        with, or else the newest timeline: the checkpoint ``TierReader(step)`` reads) is the
        checkpoint ``checkpoint_id`` names: refused with :class:`CheckpointExists`, or with
        ``overwrite=True`` saved again on a new timeline — unless this process loaded an
        older checkpoint of these tiers since this writer's previous save (a rollback:
        a new timeline, as for ``Checkpointer``).

        A save that overlaps another of this writer goes on the timeline that one is on (it
        is not a rollback of it, whichever of the two DCP plans first); one of a step another
        save of this writer has in flight is refused."""
        s = self._saves.current(self.step, RESET, LOCAL)
        step = need_step(s.step)
        refused: list[str] = []
        for p in plans:
            got = p.storage_data
            if isinstance(got, LocalPlanInfo) and got.step != step:
                raise mixed("a rank's plan", f"step {got.step}", f"step {step}")
            if isinstance(got, LocalPlanInfo) and got.refused:
                refused.append(got.refused)
        world = len(plans)
        if refused:  # another live writer: every rank refuses it in write_data
            s.stage = GLOBAL
            return [
                dataclasses.replace(
                    p, storage_data=_PlanInfo(i, world, s.save_id, 0, step, tuple(refused))
                )
                for i, p in enumerate(plans)
            ]
        with self._plan_lock:
            busy = [o.cid for o in self._saves.others(s) if o.cid is not None]
            if any(c.step == step for c in busy):
                raise TierCkptError(
                    f"step {step} is being saved already by another save of this TierWriter "
                    "(still in flight): wait for that save's future"
                )
            timeline, self._unconfirmed = choose_timeline(
                self._tiers,
                step,
                self._timeline,
                self._last_saved,
                overwrite=self.overwrite,
                unconfirmed=self._unconfirmed,
                loaded=take_loaded(t.backend.url for t in self._tiers),
            )
            self._timeline = timeline
            s.cid = CheckpointId(step, timeline)
        s.stage = GLOBAL
        return [
            dataclasses.replace(p, storage_data=_PlanInfo(i, world, s.save_id, timeline, step))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        s = self._saves.current(self.step, LOCAL, GLOBAL)
        try:
            results = self._write(s, plan, planner)
        except BaseException:
            self._saves.end(s)  # nothing of it to commit: the location may be taken over
            raise
        if s.is_coordinator:
            s.stage = WRITTEN  # finish() commits it
        else:
            self._saves.end(s)  # the coordinator commits; this rank's part is done
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, s: SaveState, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):
            raise TierCkptError("TierWriter.write_data got a plan its prepare_global_plan did not")
        if info.step != s.step:
            raise mixed("the coordinator's plan", f"step {info.step}", f"step {s.step}")
        if s.cid is not None and info.save_id != s.save_id:
            raise mixed("a plan", f"save {info.save_id}", f"save {s.save_id}")
        s.info = info
        if info.refused:
            self._refuse(s, info.refused)
        state, results = collect_items(plan, planner, info.rank)
        results.append(shards_result(self._save_shard(state, info, s)))
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        s = self._saves.of_thread(WRITTEN, "finish")
        try:
            self._finish(s, metadata, results)
        finally:
            self._saves.end(s)

    def _finish(self, s: SaveState, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        info = s.info
        assert info is not None  # set by write_data (stage WRITTEN)
        cid = CheckpointId(info.step, info.timeline)
        shards, storage = gather_reports(cid.step, info.world_size, results, info.save_id)
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self._location(cid.step, cid.timeline), save_id=info.save_id
        )
        blob = encode_metadata(metadata)
        commit_all(
            self._tiers,
            cid,
            info.world_size,
            shards,
            blob,
            functools.partial(self._retain, job=s.job),
            self._unconfirmed,
            self._confirmed,
            config.save_deadline_s(self.save_deadline),
        )

    def _save_ended(self, s: SaveState) -> None:
        """``s`` is over on this rank (called once, by :class:`Saves`)."""
        if s.counted:
            save_ended(self)
        if s.cid is not None:
            with self._plan_lock:
                last = self._last_saved
                self._last_saved = s.cid if last is None or s.cid > last else last

    def _confirmed(self, tier: str, refused: BaseException | None) -> None:
        """What the check of a tier not listed when the timeline was chosen found."""
        if refused is None:
            self._unconfirmed -= {tier}  # nothing newer there: no longer checked
        elif isinstance(refused, StaleTimeline):
            self._timeline = None  # chosen again at the next save, with that tier in view

    # -- internals -------------------------------------------------------------------
    def _pipeline_hooks(self) -> PipelineHooks:
        # through a weak reference: the pipeline must not keep its writer alive, so that a
        # writer dropped after dcp.save (DCP's idiom: a new writer per save) is collected at
        # once and its __del__ closes the pipeline and releases the leases; a reference cycle
        # would hold them until the cyclic GC runs and refuse the next writer meanwhile
        target = self._hook = HookTarget(self)

        def commit(tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int) -> None:
            w = target.ref()
            if w is not None:
                w._on_shard_durable(tier, job, ref, raw, stored)

        return PipelineHooks(commit=commit)

    def __del__(self) -> None:
        # dropped without close() after its saves (DCP's idiom: a new writer per dcp.save):
        # park the warm pipeline for the next writer of the same tiers in this process
        try:
            self._saves.others(None)  # saves whose thread ended are over (not in _in_save)
            if not self._closed and self._pipeline is not None and park(self):
                return
        except Exception:
            pass
        super().__del__()

    def _release(self) -> None:
        with _ADOPTED_LOCK:
            if _ADOPTED.get(self._key) is self:
                del _ADOPTED[self._key]

    def _config(self) -> tuple[Any, ...]:
        return (
            self.policy,
            self.chunk_bytes,
            self.host_buffer_bytes,
            self.io_threads,
            self.save_deadline,
            self.exit_timeout_s,
        )

    def _retain(self, t: Tier, job: SaveJob | None) -> None:
        """Apply ``t``'s retention after ``job``'s save committed there, on the pipeline's
        thread for ``t`` (off the save's critical path, as :class:`~tierckpt.Checkpointer`'s):
        only while this writer holds the location's lease, never deleting a save in flight
        (the steps of this writer's other saves are kept: :meth:`_protected_steps`)."""
        if self._pipeline is not None and job is not None:
            self._pipeline.retain_later(t, job)

    def _protected_steps(self) -> frozenset[int]:
        """The steps of this writer's saves in progress in this process: retention keeps
        them (and does not sweep their shards as leftovers) until they commit or fail — an
        overlapping save of a lower step commits after a higher one."""
        return self._saves.steps()


#: the writers of this process (weakly): while one is open, interpreter exit waits for DCP's
#: async_save threads (see _async_save_threads)
_WRITERS: weakref.WeakSet[TierWriter] = weakref.WeakSet()
#: the name of the threads DCP's thread-based async_save runs its saves on
_DCP_ASYNC_THREAD = "AsyncCheckpointExecutor"


def _async_save_threads() -> list[threading.Thread]:
    """DCP's async_save threads, while a writer of this process is open: a script that ends
    without waiting for an async_save's future would otherwise lose that save (the exit
    drain closed the idle pipeline before the save reached it; FileSystemWriter's is written
    while concurrent.futures' exit waits for the thread)."""
    if not any(not w._closed for w in list(_WRITERS)):
        return []
    return [
        th
        for th in threading.enumerate()
        if th.name.startswith(_DCP_ASYNC_THREAD) and not _idle_worker(th)
    ]


def _idle_worker(th: threading.Thread) -> bool:
    """Whether ``th`` is an executor's worker waiting for work with none queued: DCP shuts
    each async_save's executor down once its save is done, but a Ctrl-C inside the submit
    leaves the worker waiting until concurrent.futures' own exit (after this library's), so
    exit waited the whole exit timeout for a thread that saves nothing. Unsure: not idle."""
    frame = sys._current_frames().get(th.ident or -1)
    if frame is None or frame.f_code.co_name != "_worker":
        return False
    if not frame.f_code.co_filename.endswith(os.path.join("concurrent", "futures", "thread.py")):
        return False
    names = frame.f_locals  # blocked in work_queue.get(): no work item taken
    queue = names.get("work_queue")
    empty = getattr(queue, "empty", None)
    return "work_item" not in names and callable(empty) and bool(empty())


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


#: writers unpickled in this process, by the original writer's key: DCP's background save
#: process receives a pickled copy of the trainer's writer with every save request; the copies
#: of one original share one live writer (one pipeline, one set of leases) in that process
_ADOPTED: dict[str, TierWriter] = {}
_ADOPTED_LOCK = threading.Lock()


def _unpickle_writer(state: dict[str, Any]) -> TierWriter:
    """The live writer of this process for the original ``state`` was pickled from: the one
    already unpickled here (with the request's step and settings) or a new one."""
    with _ADOPTED_LOCK:
        w = _ADOPTED.get(state["_key"])
        if w is not None and not w._closed:
            w.step = state["step"]
            w.overwrite = state["overwrite"]
            return w
        w = TierWriter.__new__(TierWriter)
        w.__setstate__(state)
        _ADOPTED[state["_key"]] = w
        return w
