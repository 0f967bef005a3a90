"""How a ``TierWriter`` rank saves its shard of a DCP save: the items DCP resolves, one
shard file per tier streamed through the pipeline, and the report the coordinator commits
(see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import io
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt import config
from tierckpt.capture import record_ready_events
from tierckpt.dcp._common import _SHARDS_FQN
from tierckpt.dcp._metadata import ItemLocation, _PlanInfo, _RankShards, _ShardOnTier
from tierckpt.dcp._parking import HookTarget, take_over
from tierckpt.dcp._saves import SaveState
from tierckpt.distributed import is_private_tier
from tierckpt.errors import (
    CheckpointFailed,
    SaveDeadlineExceeded,
    UnsupportedObject,
    WriterConflict,
)
from tierckpt.format import ShardRef
from tierckpt.handle import SaveHandle
from tierckpt.pipeline import Pipeline, PipelineOwner, SaveJob, Tier
from tierckpt.plan import build_plan
from tierckpt.reported import DCP_PRIVATE, report_once


class ShardSaving(PipelineOwner):
    """The rank's side of a ``TierWriter`` save (its base class)."""

    _lock: threading.Lock
    _start_lock: threading.Lock
    _shards: dict[int, dict[str, _ShardOnTier]]
    _in_save: int
    _taken_over: bool
    _hook: HookTarget | None

    def _on_shard_durable(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> None:
        # no manifest here: finish() on the coordinator commits once every rank is durable
        with self._lock:
            self._shards.setdefault(id(job), {})[tier.name] = _ShardOnTier(
                ref, raw, stored, tier.codec.codec_id
            )

    def _save_shard(
        self, state: dict[str, torch.Tensor], info: _PlanInfo, s: SaveState
    ) -> _RankShards:
        with self._start_lock:  # one save at a time starts (overlapping saves: one pipeline)
            started = self._start_job(state, info, s)
        if started is None:
            return _RankShards(info.rank, {}, {}, info.save_id)
        pipeline, job = started
        handle = job.handle
        # DCP's save returns once the shards are written: a tier that makes no progress for
        # save_deadline (a short grace if it failed before) has its copy given up meanwhile,
        # as in Checkpointer.wait(), so an outage of one tier does not hold the others'
        pipeline.wait_job(job)
        errors: dict[str, str] = {}
        for t in job.tiers:
            try:
                handle.wait(t.name)
            except CheckpointFailed as exc:
                errors[t.name] = str(exc)
        with self._lock:
            done = self._shards.pop(id(job), {})
        return _RankShards(info.rank, done, errors, info.save_id)

    def _start_job(
        self, state: dict[str, torch.Tensor], info: _PlanInfo, s: SaveState
    ) -> tuple[Pipeline, SaveJob] | None:
        """Take the location over, and submit this rank's shard of ``s`` to the pipeline
        (None: no tier takes it)."""
        step = info.step
        self._begin(s)
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
            return None
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
        s.job = job
        # WriterConflict when another live writer is there
        silent = pipeline.acquire_leases(job)
        pipeline.submit(job)
        if silent:  # dcp.save waits for its shards: not behind a take its store never answers
            pipeline.give_up(
                [(t, job, _lease_unanswered(job, t)) for t in tiers if t.name in silent]
            )
        return pipeline, job

    def _claim(self, s: SaveState, step: int) -> str | None:
        """In the local plan, before any rank writes: take the location over and this rank's
        leases on the tiers every rank shares. Why another live writer refused them (None:
        taken, or left to the write's own take). The coordinator sees every rank's answer;
        where one was refused, every rank refuses the save in write_data and none writes
        (a second job with more ranks than a live one wrote stray shards with its extra
        ranks before)."""
        with self._start_lock:
            self._begin(s)
            tiers = [t for t in self._tiers if t.spec.receives(step) and not is_private_tier(t)]
            if not tiers:
                return None
            pipeline = self._get_pipeline()
            s.fresh_leases = not pipeline.holds_leases(s.rank)
            refused = pipeline.claim_leases(tiers, s.rank, step)
        return None if refused is None else f"rank {s.rank}: {refused}"

    def _refuse(self, s: SaveState, refused: tuple[str, ...]) -> None:
        """Every rank's side of a save that some rank's lease take refused: leases this
        save took are given back, and it raises (DCP fails the save on every rank)."""
        if s.fresh_leases and self._pipeline is not None:
            self._pipeline.give_back_leases()
        raise WriterConflict(
            f"step {s.step}: another live writer holds this TierWriter's location, so this "
            f"DCP save is refused on every rank and nothing of it was written ("
            + "; ".join(refused)
            + "). Save to a folder or prefix of this job's own, or stop the other job first"
        )

    def _begin(self, s: SaveState) -> None:
        """Count ``s`` in this writer's saves in flight, taking the location over first
        (once per save: its local plan, or its write when DCP made no plan through us)."""
        if not s.counted:
            self._take_over()
            s.counted = True  # in _in_save until the save ends (Saves -> _save_ended)

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
        raise NotImplementedError


def collect_items(
    plan: SavePlan, planner: SavePlanner, rank: int
) -> tuple[dict[str, torch.Tensor], list[WriteResult]]:
    """The tensors of ``plan``'s items, by key, and their write results (the shard's report
    is added by the writer)."""
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
                storage_data=ItemLocation(rank, key),
            )
        )
    return state, results


def shards_result(shards: _RankShards) -> WriteResult:
    """The extra write result that carries a rank's shard report to the coordinator."""
    return WriteResult(
        index=MetadataIndex(f"{_SHARDS_FQN}{shards.rank}"), size_in_bytes=0, storage_data=shards
    )


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


def _lease_unanswered(job: SaveJob, tier: Tier) -> SaveDeadlineExceeded:
    return SaveDeadlineExceeded(
        f"{job.id}: tier {tier.name!r} ({tier.backend.url}) did not answer this writer's lease "
        f"take within {config.lease_wait_s():g} s (TIERCKPT_LEASE_WAIT_S): its copy of this "
        "step is given up (never committed there) so dcp.save returns with the other tiers; "
        "the next save tries the tier again"
    )
