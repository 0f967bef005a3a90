"""The multi-rank :class:`~tierckpt.commit.CommitStrategy`: :class:`MultiRankCommit` owns the
job's save handshake (session id, save counter) and routes each call to the shared-tier or
private-tier commit, the load agreement or the repopulation; and :func:`report_failure`."""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

from tierckpt import config
from tierckpt.commit import Defer, Earlier, EarlierSave, Listed, SaveStart, being_saved
from tierckpt.distributed._agree import agree_on_step
from tierckpt.distributed._collectives import (
    _group_ok,
    _warn_once,
    collective_device,
    patience,
)
from tierckpt.distributed._listcommit import (
    listed_failure_name,
    tier_prefixes,
    wait_for_listed_records,
    write_listed_record,
)
from tierckpt.distributed._nodeshare import (
    ManifestCache,
    TorchNodeComm,
    node_key,
    read_manifests_per_node,
)
from tierckpt.distributed._nodestores import NodeStores, make_node_stores
from tierckpt.distributed._private import (
    _commit_private,
    _publish_private,
    _report_private_failure,
    global_store,
    is_private_tier,
    settle_private_commits,
)
from tierckpt.distributed._records import (
    RankRecord,
    _describe,
    encode_failure,
    shared_failure_key,
)
from tierckpt.distributed._repopulate import publish_repopulated
from tierckpt.distributed._shared import _manifest, _put_manifest, _write_record, wait_for_records
from tierckpt.errors import CheckpointExists, CommitTimeout, RankFailed
from tierckpt.format import CheckpointId, Manifest, ShardRef, rank_failure_name
from tierckpt.restore import read_manifest

if TYPE_CHECKING:
    from tierckpt.pipeline import SaveJob, Tier
    from tierckpt.restore import LoadedShard

__all__ = ["MultiRankCommit", "report_failure"]

log = logging.getLogger("tierckpt")


def report_failure(
    tier: Tier, job: SaveJob, error: BaseException, *, nodes: NodeStores | None = None
) -> None:
    """Tell the ranks waiting on ``tier`` that this rank's part of ``job`` failed.

    Called by the pipeline when a multi-rank save fails on a tier. On a shared tier a non-zero
    rank writes its failure record (rank 0 is the one that waits; nobody waits for rank 0's
    record); on a private tier any rank sets the attempt's failure key in rank 0's store and
    in its node's (``nodes``: this rank's node stores, where the commit uses them). Best
    effort: storage that just failed may fail again, and then rank 0 falls back on its
    ``commit_timeout``.
    """
    if isinstance(error, (CommitTimeout, RankFailed)):
        return  # a verdict on other ranks, not a failure of this rank's own part
    if (
        isinstance(error, CheckpointExists)
        and tier.name in job.refused
        and _group_ok(job.rank, job.world_size)
    ):
        return  # every rank refused this tier at save(), alike: nobody waits for this rank
    try:
        if is_private_tier(tier):
            _report_private_failure(tier, job, _describe(error), nodes)
            return
        if job.rank == 0:
            return
        body = encode_failure(
            job.step, job.rank, job.attempt, tier.name, _describe(error), timeline=job.timeline
        )
        prefixes = tier_prefixes(tier)
        name = (
            listed_failure_name(job.step, job.rank, prefixes, timeline=job.timeline)
            if prefixes
            else rank_failure_name(job.step, job.rank, timeline=job.timeline)
        )
        try:
            tier.backend.put_atomic(name, body, overwrite=True)
        except Exception:  # the tier that failed may fail again: tell rank 0 another way
            if not (dist.is_available() and dist.is_initialized()):
                raise
            key = shared_failure_key(tier.name, job.step, job.timeline, job.attempt)
            global_store().set(key, f"rank {job.rank}: {_describe(error)}".encode())
    except Exception as exc:  # never mask the save's own error
        log.warning(
            "step %d tier %s: could not report rank %d's failure to the other ranks (%s); "
            "rank 0 will wait out its commit timeout",
            job.step,
            tier.name,
            job.rank,
            exc,
        )


def _told_through_store(tier: Tier, job: SaveJob) -> Callable[[], bytes | None] | None:
    """Rank 0's look at the process group's store for a rank's failure on a shared ``tier``
    that could not be written there (:func:`report_failure`); None without a group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    key = shared_failure_key(tier.name, job.step, job.timeline, job.attempt)

    def told() -> bytes | None:
        try:
            return global_store().failure(key)
        except Exception:  # the group or its store gone: the records on the tier decide
            return None

    return told


class MultiRankCommit:
    """The :class:`~tierckpt.commit.CommitStrategy` of one rank of a multi-rank job.

    A save commits on a tier once every rank's shard is durable there: on a tier all ranks
    can read, through completion records that rank 0 polls for (:func:`wait_for_records`);
    on a private tier, through the process group's store (see the package docstring). A load
    reads the newest checkpoint every rank can read (:func:`agree_on_step`).

    Everything it needs is handed in, so that it never reaches into its owner: ``tiers``
    (the owner's tiers, fastest first, for the load agreement and repopulation), ``rank`` and
    ``world_size``, ``on_busy`` (with ``"skip"`` every save runs the handshake's all-reduce so
    that all ranks skip together), ``repopulate`` (loads copy onto faster tiers where every
    rank can take part), ``defer`` (the pipeline's commit threads, where rank 0's waiting
    part of a commit runs) and ``earlier`` (the owner's own earlier save of a checkpoint, for a
    save of the same checkpoint again). It owns the handshake's state: the session id agreed
    at the first save and the count of saves, which every rank makes in the same order.
    """

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        rank: int,
        world_size: int,
        on_busy: Literal["block", "skip"],
        repopulate: bool,
        defer: Defer,
        earlier: Earlier | None = None,
    ) -> None:
        self._tiers = tuple(tiers)
        self._earlier = earlier
        self._rank = rank
        self._world_size = world_size
        self._on_busy = on_busy
        self._repopulate = repopulate
        self._defer = defer
        #: drawn by rank 0 at the first save with a process group, spread by its all-reduce
        self._session = 0
        #: saves of each (step, timeline) begun so far, the ``k`` of the attempt id
        self._saves: dict[tuple[int, int], int] = {}
        #: the node's ranks (made at the first load with a process group)
        self._node: TorchNodeComm | None = None
        #: manifests the node's leader read for the current load
        self._manifests: ManifestCache | None = None
        #: the node's ranks and stores for private-tier commits (made at the first save)
        self._nodes: NodeStores | None = None

    def begin_save(
        self, step: int, busy: bool, *, timeline: int, agree_timeline: bool
    ) -> SaveStart:
        """Agree on an attempt id (and, with ``on_busy="skip"``, on skipping; and on the
        timeline); training thread.

        The attempt id is ``<session>-<step>.<timeline>.<k>``: the session id is drawn by rank
        0 and spread by one all-reduce at the first multi-rank save; ``k`` counts this
        process's saves of that step and timeline (a retry of a step is a new attempt). So with
        ``on_busy="block"`` (the default) later saves need no collective at all, and a rank
        that missed one save (a bug in the caller) costs that step only: the ranks' later saves
        still name the same attempts. With ``on_busy="skip"`` every save runs one small
        all-reduce so that all ranks skip together (and checks that they save the same step; a
        mismatch raises ``ValueError`` everywhere). Without an initialized process group (rank
        and world size given by hand) there is no collective: the session is
        ``TIERCKPT_ATTEMPT_ID`` (empty: any record is accepted).

        ``agree_timeline``: ``timeline`` is this rank's choice from its own view of the tiers
        (the first save, the first after a load, a step below the previous save's — the same
        saves on every rank); the ranks take the largest, in the same all-reduce, so that every
        rank writes the same checkpoint id. Otherwise ``timeline`` is returned as it is.

        A save of a checkpoint these ranks saved before (``k`` > 1: the same step on the same
        timeline, a retry or the step saved twice) is decided alike on every rank, by
        :meth:`_again`: refused while that save is in flight on any rank, and kept off the
        tiers where it committed.
        """
        if not _group_ok(self._rank, self._world_size):
            _warn_once(
                "no-group",
                "multi-rank save without an initialized torch.distributed group: ranks cannot "
                "agree on an attempt id (set TIERCKPT_ATTEMPT_ID per job attempt) nor skip "
                "together",
            )
            attempt = config.attempt_id()
            count = self._count(step, timeline)
            refused = self._again(step, timeline) if self._saves[(step, timeline)] > 1 else {}
            return SaveStart(f"{attempt}-{count}" if attempt else "", busy, timeline, refused)
        skip_mode = self._on_busy == "skip"
        if self._session == 0 or skip_mode or agree_timeline:
            import torch.distributed as dist

            mine = secrets.randbits(62) + 1 if self._rank == 0 and self._session == 0 else 0
            t = torch.tensor(
                [mine, step, -step, int(busy), timeline],
                dtype=torch.int64,
                device=collective_device(),
            )
            # the first save: a rank alone in it says so
            with patience(self._rank, "save()") if self._session == 0 else nullcontext():
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            drawn, hi, neg_lo, any_busy, timeline = (int(v) for v in t.tolist())
            if self._session == 0:
                self._session = drawn
                if any(is_private_tier(t) for t in self._tiers):
                    # collective, the same on every rank (same tiers): private-tier records
                    # go through a store per node, one item per node in rank 0's store
                    self._nodes = make_node_stores(node_key(), global_store, 60.0)
            if hi != -neg_lo:
                raise ValueError(
                    f"ranks are saving different steps (from {-neg_lo} to {hi}); every rank "
                    "must call save() with the same step"
                )
            busy = bool(any_busy)
        count = self._count(step, timeline)
        refused = self._again(step, timeline) if self._saves[(step, timeline)] > 1 else {}
        return SaveStart(f"{self._session:016x}-{count}", busy, timeline, refused)

    def _count(self, step: int, timeline: int) -> str:
        """``<step>.<timeline>.<k>``: this process's ``k``-th save of that step and timeline."""
        k = self._saves[(step, timeline)] = self._saves.get((step, timeline), 0) + 1
        return f"{step}.{timeline}.{k}"

    def _again(self, step: int, timeline: int) -> dict[str, str]:
        """A save of checkpoint ``(step, timeline)`` again: raise ``ValueError`` while its
        earlier save is in flight on any rank; else the tiers where it committed, which this
        save must not write (:attr:`SaveStart.refused`).

        With a process group, one all-reduce (MAX) of 1 + one int64 per tier on every rank
        alike (every rank saves the same steps in the same order, so every rank is here): a
        rank whose earlier save is in flight, and per tier whether the checkpoint is committed
        there, as rank 0 knows it for a tier all ranks share (a manifest is rank 0's to write:
        another rank's finished part there says only that its shard is durable) and as any
        rank knows it on a private tier. So a rank that finished its part never replaces its
        shard while rank 0 may still commit the earlier attempt, or after it did; after a
        failure (rank 0's commit of the earlier attempt is over and wrote nothing) every rank
        writes again. Without a process group each rank knows only its own part: it refuses
        a tier where its shard of the earlier save is durable (rank 0 may have committed it).
        """
        mine = EarlierSave() if self._earlier is None else self._earlier(step, timeline)
        if not _group_ok(self._rank, self._world_size):
            if mine.in_flight:
                raise ValueError(being_saved(step))
            sure = "is already committed"
            unsure = (
                "may already be committed (this rank's shard of it is durable there from an "
                "earlier save, and without a process group the ranks cannot tell whether rank "
                "0 committed it)"
            )
            return {
                t.name: sure if self._rank == 0 or is_private_tier(t) else unsure
                for t in self._tiers
                if t.name in mine.done
            }
        import torch.distributed as dist

        flags = [int(mine.in_flight)] + [
            int(t.name in mine.done and (self._rank == 0 or is_private_tier(t)))
            for t in self._tiers
        ]
        v = torch.tensor(flags, dtype=torch.int64, device=collective_device())
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        agreed = [int(x) for x in v.tolist()]
        if agreed[0]:
            where = "" if mine.in_flight else " (by another rank of this job)"
            raise ValueError(being_saved(step, where))
        committed = zip(self._tiers, agreed[1:], strict=True)
        return {t.name: "is already committed" for t, f in committed if f}

    def commit(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> Future[None] | None:
        """Runs on a tier's writer thread once this rank's shard is durable on ``tier``.

        Writes this rank's record and returns; on rank 0 (and on private tiers) the waiting
        part goes to the pipeline's commit threads (a Future), so the tier's writer thread
        moves on to the next checkpoint and training never waits for other ranks' flushes.
        """
        rec = RankRecord(
            step=job.step,
            rank=job.rank,
            world_size=job.world_size,
            attempt=job.attempt,
            tier=tier.name,
            file=ref.file,
            size=ref.size,
            index_checksum=ref.index_checksum,
            raw_bytes=raw,
            stored_bytes=stored,
            codec=tier.codec.codec_id,
            timeline=job.timeline,
        )
        if is_private_tier(tier):
            nodes = self._nodes_of(job)
            _publish_private(tier, job, rec, nodes)
            return self._defer(lambda: _commit_private(tier, job, nodes))
        prefixes = tier_prefixes(tier)
        if prefixes:  # format v2: the record's fields in its name, rank 0 only LISTs
            write_listed_record(tier.backend, rec, prefixes)
        else:
            _write_record(tier.backend, rec)
        if job.rank != 0:
            return None

        told = _told_through_store(tier, job)

        def wait_and_commit() -> None:
            if prefixes:
                records = wait_for_listed_records(
                    tier.backend,
                    tier.name,
                    job.step,
                    job.world_size,
                    job.attempt,
                    prefixes,
                    timeline=job.timeline,
                    reported=told,
                )
            else:
                records = wait_for_records(
                    tier.backend,
                    tier.name,
                    job.step,
                    job.world_size,
                    job.attempt,
                    timeline=job.timeline,
                    reported=told,
                )
            _put_manifest(tier.backend, _manifest(tier.name, job, records))

        return self._defer(wait_and_commit)

    def _nodes_of(self, job: SaveJob) -> NodeStores:
        """The node stores made at the first save, else every rank its own node."""
        if self._nodes is not None and self._nodes.rank == job.rank:
            return self._nodes
        return NodeStores.singleton(job.rank, job.world_size, global_store)

    def settle(self) -> None:
        """At ``close()``: rank 0 waits briefly for the other nodes' copies of its latest
        private commits (:func:`settle_private_commits`)."""
        if self._rank == 0:
            settle_private_commits()

    def retains(self, tier: Tier, job: SaveJob) -> bool:
        """Rank 0 applies retention to a tier all ranks share; every rank to its own copy of
        a private tier."""
        return job.rank == 0 or is_private_tier(tier)

    def report_failure(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        """See :func:`report_failure`."""
        report_failure(tier, job, error, nodes=self._nodes_of(job) if job.attempt else None)

    @property
    def repopulates(self) -> bool:
        """Only where every rank can take part in the collective that commits the copies (the
        same answer on every rank)."""
        return self._repopulate and _group_ok(self._rank, self._world_size)

    def agree_on_step(
        self, candidates: Sequence[CheckpointId], *, listed: Listed | None = None
    ) -> list[CheckpointId]:
        """See :func:`agree_on_step`. With a process group, manifests on shared tiers are read
        once per node (:mod:`._nodeshare`) and kept for this load's :meth:`read_manifest`: the
        newest candidate's first, the others' only where the ranks' newest readable differ.
        A rank in it for long says what it waits for (:func:`patience`)."""
        with patience(self._rank, "load()"):
            return self._agree_on_step(candidates, listed)

    def _agree_on_step(
        self, candidates: Sequence[CheckpointId], listed: Listed | None
    ) -> list[CheckpointId]:
        self._manifests = None
        prefetch = None
        # only the shared tiers listed before any private one: where a node-local tier
        # (RAM, node RAM, a local disk) comes first, ranks load from it, and reading the
        # shared tiers' manifests up front would cost requests (S3 GETs) nobody needs
        shared = list(itertools.takewhile(lambda t: not is_private_tier(t), self._tiers))
        # the tiers are the same on every rank, so all skip or none: with nothing to share,
        # no node groups (two collectives at the first load) and no broadcast of nothing
        if shared and _group_ok(self._rank, self._world_size):
            if self._node is None:
                self._node = TorchNodeComm()  # collective: every rank, first load
            node = self._node
            cache = self._manifests = ManifestCache()

            def prefetch(cids: Sequence[CheckpointId]) -> None:
                reads = [(t.name, t.backend, c) for c in cids for t in shared]
                cache.update(read_manifests_per_node(node, reads))

            prefetch(candidates[:1])
        by_tier = listed or {}
        shared_tiers = [t for t in self._tiers if not is_private_tier(t)]
        return agree_on_step(
            candidates,
            tiers=self._tiers,
            rank=self._rank,
            world_size=self._world_size,
            cache=self._manifests,
            prefetch=prefetch,
            newest_listed=listed is not None,
            shared={c for t in shared_tiers for c in by_tier.get(t.name, ())},
        )

    def read_manifest(self, tier: Tier, cid: CheckpointId) -> Manifest:
        """The manifest of ``cid`` on ``tier`` for this load: the node leader's read where it
        made one (see :meth:`agree_on_step`), else this rank's own."""
        if self._manifests is not None and (tier.name, cid) in self._manifests:
            return self._manifests.get(tier.name, cid)
        return read_manifest(tier.backend, cid.step, tier.name, timeline=cid.timeline)

    def agree_on_outcome(self, code: int) -> int:
        """See :meth:`CommitStrategy.agree_on_outcome`: one all-reduce (MAX) of one int64 per
        load (and per first save); none without a process group (each rank ends alone)."""
        if not _group_ok(self._rank, self._world_size):
            return code
        import torch.distributed as dist

        t = torch.tensor([code], dtype=torch.int64, device=collective_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def publish_repopulated(self, loaded: LoadedShard | None) -> None:
        """See :func:`publish_repopulated`; nothing (and no collective) where loads do not
        repopulate."""
        if self.repopulates:
            publish_repopulated(loaded, tiers=self._tiers, rank=self._rank)
