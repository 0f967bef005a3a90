"""``TierWriter``: each rank streams one shard file per tier through the pipeline; the
coordinator writes DCP's metadata and, last, each tier's manifest (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt._version import __version__
from tierckpt.capture import record_ready_events
from tierckpt.catalog import newest_committed, timeline_for
from tierckpt.config import resolve_writer_config
from tierckpt.dcp._common import (
    _DCP_VERSION,
    _SHARDS_FQN,
    METADATA_VERSION,
    TiersArg,
    _parse_step,
    _runtimes,
    dcp_metadata_name,
)
from tierckpt.dcp._metadata import (
    ItemLocation,
    _PlanInfo,
    _RankShards,
    _ShardOnTier,
    encode_metadata,
)
from tierckpt.distributed import is_private_tier
from tierckpt.errors import (
    BackendError,
    CheckpointFailed,
    FormatError,
    TierCkptError,
    UnsupportedObject,
)
from tierckpt.format import (
    CheckpointId,
    Manifest,
    ShardRef,
    checksum,
    encode_manifest,
    manifest_name,
)
from tierckpt.handle import SaveHandle
from tierckpt.pipeline import Pipeline, PipelineHooks, PipelineOwner, SaveJob, Tier
from tierckpt.plan import build_plan
from tierckpt.policy import TierPolicy
from tierckpt.retention import gc_tier

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

    Reuse one writer for every save of a run: its host buffer and threads stay warm. It
    holds threads, and its writer lease on every tier it wrote to, until :meth:`close` (or
    garbage collection); another writer on the same location is refused with
    :class:`~tierckpt.WriterConflict` meanwhile.
    """

    def __init__(
        self,
        tiers: TiersArg,
        step: int | str | None = None,
        *,
        chunk_bytes: int | None = None,
        host_buffer_bytes: int | None = None,
        io_threads: int | None = None,
    ) -> None:
        super().__init__()
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
        self.step: int | None = None if step is None else _parse_step(step)
        sizes = resolve_writer_config(host_buffer_bytes, chunk_bytes, io_threads)
        self.host_buffer_bytes = sizes.host_buffer_bytes
        self.chunk_bytes = sizes.chunk_bytes
        self.io_threads = sizes.io_threads
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
        #: the coordinator's timeline (None: chosen from the tiers at the next save) and the
        #: newest checkpoint this writer saved; as for Checkpointer
        self._timeline: int | None = None
        self._last_saved: CheckpointId | None = None

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
        return StorageMeta(checkpoint_id=f"tierckpt:{self.step}", save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._require_step()
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: choose the timeline (as :class:`~tierckpt.Checkpointer` does:
        at the first save, and when the step is below the previous save's, from the newest
        checkpoint on the tiers; a step not after it starts a new timeline) and hand it to
        every rank with its plan."""
        step = self._require_step()
        last = self._last_saved
        if self._timeline is not None and (last is None or step >= last.step):
            timeline = self._timeline
        else:
            newest = newest_committed((t.name, t.backend) for t in self._tiers)
            if last is not None and (newest is None or last > newest):
                newest = last
            timeline = timeline_for(step, newest)
        cid = CheckpointId(step, timeline)
        for t in self._tiers:
            if t.backend.exists(manifest_name(step, timeline=timeline)):
                raise FileExistsError(
                    f"{cid} is already committed on tier {t.name!r} ({t.backend.url}); "
                    "refusing to overwrite it — save under another step"
                )
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
        shards = self._save_shard(state, step, info)
        results.append(
            WriteResult(
                index=MetadataIndex(f"{_SHARDS_FQN}{info.rank}"),
                size_in_bytes=0,
                storage_data=shards,
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step = self._require_step()
        info = self._info
        world = info.world_size if info is not None else len(results)
        shards: dict[int, _RankShards] = {}
        storage: dict[MetadataIndex, Any] = {}
        for per_rank in results:
            for wr in per_rank:
                if isinstance(wr.storage_data, _RankShards):
                    shards[wr.storage_data.rank] = wr.storage_data
                else:
                    storage[wr.index] = wr.storage_data
        if sorted(shards) != list(range(world)):
            raise CheckpointFailed(f"step {step}: shard reports from ranks {sorted(shards)} only")
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        blob = encode_metadata(metadata)
        timeline = info.timeline if info is not None else 0
        committed: list[str] = []
        failed: dict[str, BaseException] = {}
        for t in self._tiers:
            missing = [r for r in range(world) if t.name not in shards[r].tiers]
            if len(missing) == world:
                continue  # this tier did not take part in this save
            if missing:
                why = {r: shards[r].errors.get(t.name, "?") for r in missing[:3]}
                failed[t.name] = CheckpointFailed(f"ranks {missing[:10]} failed there: {why}")
                log.error("step %d not committed on tier %s: %s", step, t.name, failed[t.name])
                continue
            try:
                self._commit_tier(
                    t,
                    CheckpointId(step, timeline),
                    world,
                    [shards[r].tiers[t.name] for r in range(world)],
                    blob,
                )
                committed.append(t.name)
            except (BackendError, OSError, FormatError) as exc:
                failed[t.name] = exc
                log.error("step %d: commit on tier %s failed: %s", step, t.name, exc)
        if not committed:
            raise CheckpointFailed(f"DCP step {step} was committed on no tier", failed)

    # -- internals -------------------------------------------------------------------
    def _require_step(self) -> int:
        if self.step is None:
            raise ValueError("TierWriter needs a step: TierWriter(tiers, step) or checkpoint_id")
        return self.step

    def _pipeline_hooks(self) -> PipelineHooks:
        return PipelineHooks(commit=self._on_shard_durable)

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

        self._save_count += 1
        tiers = [
            t
            for t in self._tiers
            if t.spec.receives(step) and not (info.world_size > 1 and is_private_tier(t))
        ]
        for t in self._tiers:
            if t not in tiers and t.spec.receives(step):
                log.warning("DCP save skips tier %s: it is private to each process", t.name)
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
        pipeline.acquire_leases(job)  # WriterConflict when another live writer is there
        pipeline.submit(job)
        errors: dict[str, str] = {}
        for t in tiers:
            try:
                handle.wait(t.name)
            except CheckpointFailed as exc:
                errors[t.name] = str(exc)
        with self._lock:
            done = self._shards.pop(id(job), {})
        return _RankShards(info.rank, done, errors)

    def _commit_tier(
        self,
        t: Tier,
        cid: CheckpointId,
        world: int,
        shards: list[_ShardOnTier],
        blob: bytes,
    ) -> None:
        step = cid.step
        name = dcp_metadata_name(step, timeline=cid.timeline)
        t.backend.put_atomic(name, blob, overwrite=True)
        m = Manifest(
            step=step,
            world_size=world,
            shards=tuple(s.ref for s in shards),
            created=time.time(),
            library_version=__version__,
            tier=t.name,
            raw_bytes=sum(s.raw_bytes for s in shards),
            stored_bytes=sum(s.stored_bytes for s in shards) + len(blob),
            codecs=tuple(sorted({s.codec for s in shards})),
            metadata={
                "dcp": {
                    "file": name,
                    "size": len(blob),
                    "checksum": checksum(blob),
                    "encoding": "json+zstd",
                    "version": METADATA_VERSION,
                }
            },
            timeline=cid.timeline,
        )
        t.backend.put_atomic(manifest_name(step, timeline=cid.timeline), encode_manifest(m))
        log.info("DCP %s committed on tier %s (%d ranks)", cid, t.name, world)
        rank = self._info.rank if self._info is not None else self.rank
        if self._pipeline is None or not self._pipeline.may_collect(t, rank):
            return  # retention only while this writer holds the location's lease
        try:
            gc_tier(t.backend, t.spec.keep_last)
        except OSError as exc:
            log.warning("retention on tier %s failed (will retry next save): %s", t.name, exc)


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
