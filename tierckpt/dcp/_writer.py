"""``TierWriter``: each rank streams one shard file per tier through the pipeline; the
coordinator writes DCP's metadata and, last, each tier's manifest (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt import config
from tierckpt.capture import record_ready_events
from tierckpt.config import resolve_writer_config
from tierckpt.dcp._commit import choose_timeline, commit_all, gather_reports
from tierckpt.dcp._common import _DCP_VERSION, _SHARDS_FQN, TiersArg, _parse_step, _runtimes
from tierckpt.dcp._metadata import (
    ItemLocation,
    _PlanInfo,
    _RankShards,
    _ShardOnTier,
    encode_metadata,
)
from tierckpt.dcp._parking import HookTarget, park, take_over
from tierckpt.distributed import is_private_tier
from tierckpt.errors import (
    CheckpointFailed,
    FormatError,
    SaveDeadlineExceeded,
    StaleTimeline,
    TierCkptError,
    UnsupportedObject,
)
from tierckpt.format import CheckpointId, ShardRef, step_prefix
from tierckpt.handle import SaveHandle
from tierckpt.pipeline import Pipeline, PipelineHooks, PipelineOwner, SaveJob, Tier
from tierckpt.plan import build_plan
from tierckpt.policy import TierPolicy
from tierckpt.reported import DCP_PRIVATE, report_once

log = logging.getLogger("tierckpt")


def _plain_tensor(data: Any) -> torch.Tensor:
    t = data.to_local() if hasattr(data, "to_local") else data
    if not isinstance(t, torch.Tensor):
        raise UnsupportedObject(f"DCP resolved a {type(t).__name__} for a tensor item")
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    return t


def _bytes_tensor(data: io.BytesIO) -> torch.Tensor:
    buf = bytearray(data.getbuffer())
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


class TierWriter(PipelineOwner, StorageWriter):
    """A DCP ``StorageWriter`` that saves through tierckpt tiers (see the module docstring).

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy` (``every`` counts the saves
            of this writer; ``keep_last`` is applied after each commit).
        step: the step to save; or pass it as DCP's ``checkpoint_id``.
        chunk_bytes, host_buffer_bytes, io_threads: as for :class:`~tierckpt.Checkpointer`.
        overwrite: what a save of a step that is already committed does. ``False`` (default):
            refused with :class:`~tierckpt.CheckpointExists` (a ``RuntimeError`` whose message
            says "Checkpoint already exists", as ``FileSystemWriter(overwrite=False)``'s).
            ``True``: saved again on a new timeline; a load of that step (or of the newest)
            then reads the new save, and the committed one stays until retention removes it —
            nothing committed is lost or overwritten in place.

    Reuse one writer for every save of a run: its host buffer and threads stay warm. It
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
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
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
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._tiers: list[Tier] = _runtimes(self.policy)
        self._pipeline: Pipeline | None = None
        self._save_count = 0
        self._lock = threading.Lock()
        self._shards: dict[int, dict[str, _ShardOnTier]] = {}
        self._info: _PlanInfo | None = None
        self._closed = False
        self._hook: HookTarget | None = None
        #: a save of this writer is between its shard and its commit (see _take_over)
        self._in_save = False
        self._taken_over = False
        #: the coordinator's timeline (None: chosen from the tiers at the next save) and the
        #: newest checkpoint this writer saved; as for Checkpointer
        self._timeline: int | None = None
        self._last_saved: CheckpointId | None = None
        #: the coordinator's tiers that could not be listed when its timeline was chosen:
        #: checked before each commit there, until one passes (see confirm_timeline)
        self._unconfirmed: frozenset[str] = frozenset()
        #: this rank's job of the save in progress (retention protects it, see _retain)
        self._job: SaveJob | None = None

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
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._info = None

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
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else _dist_rank()

    def storage_meta(self) -> StorageMeta | None:
        """``checkpoint_id`` is where the checkpoint lives (as ``FileSystemWriter``'s path):
        the step's folder on the first tier every rank shares, e.g. ``/ck/steps/000000000100``
        or ``s3://b/run/steps/000000000100.t000001`` once the timeline is chosen."""
        return StorageMeta(checkpoint_id=self._location(self._timeline or 0), save_id=self.save_id)

    def _location(self, timeline: int) -> str:
        step = self._require_step()
        shared = [t for t in self._tiers if not is_private_tier(t)] or self._tiers
        if not shared:
            return step_prefix(step, timeline=timeline).rstrip("/")
        return f"{shared[0].backend.url.rstrip('/')}/{step_prefix(step, timeline=timeline)}"[:-1]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._require_step()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: choose the timeline (as :class:`~tierckpt.Checkpointer` does:
        at the first save, and when the step is below the previous save's, from the newest
        checkpoint on the tiers; a step not after it starts a new timeline) and hand it to
        every rank with its plan.

        A step already committed where this save would go (the timeline this writer goes on
        with, or else the newest timeline: the checkpoint ``TierReader(step)`` reads) is the
        checkpoint ``checkpoint_id`` names: refused with :class:`CheckpointExists`, or with
        ``overwrite=True`` saved again on a new timeline."""
        step = self._require_step()
        timeline, self._unconfirmed = choose_timeline(
            self._tiers,
            step,
            self._timeline,
            self._last_saved,
            overwrite=self.overwrite,
            unconfirmed=self._unconfirmed,
        )
        cid = CheckpointId(step, timeline)
        self._timeline = timeline
        self._last_saved = cid
        world = len(plans)
        return [
            dataclasses.replace(p, storage_data=_PlanInfo(i, world, self.save_id, timeline))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):
            raise TierCkptError("TierWriter.write_data got a plan its prepare_global_plan did not")
        self._info = info
        step = self._require_step()
        state: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = str(i)
            t = _bytes_tensor(data) if isinstance(data, io.BytesIO) else _plain_tensor(data)
            state[key] = t
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=t.numel() * t.element_size(),
                    storage_data=ItemLocation(info.rank, key),
                )
            )
        try:
            shards = self._save_shard(state, step, info)
        except BaseException:
            self._in_save = False  # nothing of it to commit: the location may be taken over
            raise
        results.append(
            WriteResult(
                index=MetadataIndex(f"{_SHARDS_FQN}{info.rank}"),
                size_in_bytes=0,
                storage_data=shards,
            )
        )
        if not self.is_coordinator:
            self._in_save = False  # the coordinator commits; this rank's part is done
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._finish(metadata, results)
        finally:
            self._in_save = False

    def _finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step = self._require_step()
        info = self._info
        world = info.world_size if info is not None else len(results)
        shards, storage = gather_reports(step, world, results)
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = storage
        timeline = info.timeline if info is not None else 0
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self._location(timeline), save_id=self.save_id
        )
        blob = encode_metadata(metadata)
        cid = CheckpointId(step, timeline)
        commit_all(
            self._tiers,
            cid,
            world,
            shards,
            blob,
            self._retain,
            self._unconfirmed,
            self._confirmed,
        )

    def _confirmed(self, tier: str, refused: BaseException | None) -> None:
        """What the check of a tier not listed when the timeline was chosen found."""
        if refused is None:
            self._unconfirmed -= {tier}  # nothing newer there: no longer checked
        elif isinstance(refused, StaleTimeline):
            self._timeline = None  # chosen again at the next save, with that tier in view

    # -- internals -------------------------------------------------------------------
    def _require_step(self) -> int:
        if self.step is None:
            raise ValueError("TierWriter needs a step: TierWriter(tiers, step) or checkpoint_id")
        return self.step

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
            if not self._closed and self._pipeline is not None and park(self):
                return
        except Exception:
            pass
        super().__del__()

    def _release(self) -> None:
        with _ADOPTED_LOCK:
            if _ADOPTED.get(self._key) is self:
                del _ADOPTED[self._key]

    def _on_shard_durable(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> None:
        # no manifest here: finish() on the coordinator commits once every rank is durable
        with self._lock:
            self._shards.setdefault(id(job), {})[tier.name] = _ShardOnTier(
                ref, raw, stored, tier.codec.codec_id
            )

    def _save_shard(
        self, state: dict[str, torch.Tensor], step: int, info: _PlanInfo
    ) -> _RankShards:

        self._take_over()
        self._save_count += 1
        tiers = [
            t
            for t in self._tiers
            if t.spec.receives(step) and not (info.world_size > 1 and is_private_tier(t))
        ]
        for t in self._tiers:
            if t not in tiers and t.spec.receives(step):  # once per tier (handed on, parked)
                report_once(
                    t.backend,
                    "private",
                    "DCP save skips tier %s: it is private to each process (every DCP save "
                    "skips it; said once)",
                    t.name,
                    topic=DCP_PRIVATE,
                )
        if not tiers:
            return _RankShards(info.rank, {}, {})
        pipeline = self._get_pipeline()
        plan = build_plan(state, self.chunk_bytes)
        handle = SaveHandle(step, tuple(t.name for t in tiers), timeline=info.timeline)
        job = SaveJob(
            step=step,
            plan=plan,
            tiers=tiers,
            handle=handle,
            rank=info.rank,
            world_size=info.world_size,
            ready_events=record_ready_events(plan),
            metadata={},
            attempt=info.save_id,
            timeline=info.timeline,
        )
        self._job = job
        # WriterConflict when another live writer is there
        silent = pipeline.acquire_leases(job)
        pipeline.submit(job)
        if silent:  # dcp.save waits for its shards: not behind a take its store never answers
            pipeline.give_up(
                [(t, job, _lease_unanswered(job, t)) for t in tiers if t.name in silent]
            )
        # DCP's save returns once the shards are written: a tier that makes no progress for
        # save_deadline (a short grace if it failed before) has its copy given up meanwhile,
        # as in Checkpointer.wait(), so an outage of one tier does not hold the others'
        pipeline.wait_job(job)
        errors: dict[str, str] = {}
        for t in tiers:
            try:
                handle.wait(t.name)
            except CheckpointFailed as exc:
                errors[t.name] = str(exc)
        with self._lock:
            done = self._shards.pop(id(job), {})
        return _RankShards(info.rank, done, errors)

    def _take_over(self) -> None:
        """Take this writer's locations over from older, idle TierWriters of this process.

        DCP's idiom is a new storage writer per ``dcp.save``. A dropped writer is normally
        collected at once (and releases its leases), but one still referenced somewhere (a
        traceback kept after a failed save, a debugger) would hold the lease and refuse the
        new writer with WriterConflict. So in one process the newest writer of a location
        wins: an older one that is not inside a save is closed (its leases released) and
        refuses later saves; one inside a save keeps the location (WriterConflict here).

        A pipeline parked by a dropped writer of the same tiers and settings is adopted (its
        threads, host buffer and leases stay warm: no setup per save); one parked for other
        settings on these locations is closed, releasing its leases."""
        take_over(self)

    def _config(self) -> tuple[Any, ...]:
        return (
            self.policy,
            self.chunk_bytes,
            self.host_buffer_bytes,
            self.io_threads,
            self.save_deadline,
            self.exit_timeout_s,
        )

    def _retain(self, t: Tier) -> None:
        """Apply ``t``'s retention after a commit there, on the pipeline's thread for ``t``
        (off the save's critical path, as :class:`~tierckpt.Checkpointer`'s): only while
        this writer holds the location's lease, never deleting a save in flight."""
        job = self._job
        if self._pipeline is not None and job is not None:
            self._pipeline.retain_later(t, job)


def _lease_unanswered(job: SaveJob, tier: Tier) -> SaveDeadlineExceeded:
    return SaveDeadlineExceeded(
        f"{job.id}: tier {tier.name!r} ({tier.backend.url}) did not answer this writer's lease "
        f"take within {config.lease_wait_s():g} s (TIERCKPT_LEASE_WAIT_S): its copy of this "
        "step is given up (never committed there) so dcp.save returns with the other tiers; "
        "the next save tries the tier again"
    )


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
