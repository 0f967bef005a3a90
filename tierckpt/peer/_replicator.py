"""The peer tier at run time: :class:`PeerReplicator` copies every node-RAM commit to the
partners in the background, and before a load pulls the shards a rank lacks from them."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from tierckpt.catalog import committed_ids
from tierckpt.distributed import checkpoint_key, checkpoint_of_key
from tierckpt.errors import TierCkptError
from tierckpt.format import CheckpointId, Manifest, encode_manifest, manifest_name
from tierckpt.handle import TierResult
from tierckpt.noderam import REPLICA_SUFFIX, NodeRamBackend, NodeRamTier
from tierckpt.peer._choose import choose
from tierckpt.peer._placement import Placement, node_key, ring_placement
from tierckpt.peer._spare import SpareSegment, prepare_spare
from tierckpt.peer._spec import PeerTier
from tierckpt.peer._wire import Offer, Received, exchange
from tierckpt.reported import Outage
from tierckpt.restore import read_manifest
from tierckpt.retention import Retention, gc_tier, kept_ids, pinned_ids
from tierckpt.stats import CheckpointEvent

if TYPE_CHECKING:
    from tierckpt.pipeline import Tier

__all__ = ["PeerReplicator", "RestoreReport", "open_peer"]

log = logging.getLogger("tierckpt")

#: newest checkpoints per rank and per kind compared at a load
_CANDIDATES = 16
#: a kept-list key that says "the source cannot tell what it keeps"
_UNKNOWN = -1


@dataclass(frozen=True, slots=True)
class RestoreReport:
    """Where each rank's shard of a load came from (``PeerReplicator.last_restore``).

    ``sources[r]``: ``"noderam"`` (its own node's RAM), ``"peer:<h>"`` (pulled from rank
    ``h``'s node RAM), or the name of the slower tier it falls back to."""

    checkpoint: CheckpointId
    sources: tuple[str, ...]
    pulled_bytes: int
    pull_seconds: float
    #: how long the load waited for this rank's spare segment to be allocated
    spare_wait_seconds: float = 0.0


def open_peer(
    specs: Sequence[Any], tiers: Sequence[Tier], *, rank: int, world_size: int
) -> PeerReplicator | None:
    """The replicator of the policy's :class:`PeerTier`, or None without one (or in a job of
    one process, where there is no partner: logged). Creates its process groups: every rank
    must call it together (the ``Checkpointer`` constructor)."""
    peers = [s for s in specs if isinstance(s, PeerTier)]
    if not peers:
        return None
    if len(peers) > 1:
        raise ValueError("a policy takes one PeerTier (replicas=N for more copies)")
    spec = peers[0]
    rams = [t for t in tiers if isinstance(t.spec, NodeRamTier)]
    src = [t for t in rams if spec.source in (None, t.name)]
    if not src:
        raise ValueError(
            f"PeerTier {spec.name!r} copies a NodeRamTier's commits: list a NodeRamTier "
            f"before it" + (f" named {spec.source!r}" if spec.source else "")
        )
    if world_size == 1:
        log.warning("PeerTier %r: a job of one process has no partner; no replicas", spec.name)
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TierCkptError(
            f"PeerTier {spec.name!r} moves replicas over torch.distributed: initialize the "
            "process group before building the Checkpointer"
        )
    return PeerReplicator(spec, src[0], tiers, rank=rank, world_size=world_size)


class PeerReplicator:
    """Copies this rank's node-RAM commits to its partners and keeps its sources' replicas.

    Two gloo groups over every rank, created here: one only the background thread uses (the
    copies after each commit), one only the training thread uses (:meth:`prepare_load`), so
    that neither waits on the other and the training group never carries a byte of it.

    Each node-RAM save is one *round* on every rank, whatever its outcome on that rank
    (every rank's node-RAM tier receives the same steps): each rank offers the shard it just
    committed there to its partners — nothing if its copy failed — and receives its
    sources' shards (:func:`~tierckpt.peer._wire.exchange`). A round per save, not per
    commit, keeps the rounds of every rank in step when a commit fails on some ranks only
    (the node's manifest could not be written, a commit timeout): a rank that skipped its
    round would pair the next one with its partners' previous one, and the last with none.
    So a replica exists only of a shard committed in its own node's RAM; a step that failed
    there has no replica of that rank's shard, and later steps replicate as before.
    A partner keeps ``keep_last`` replicas per source in ``<run folder>.replicas/rank-<s>/``
    beside its own node-RAM folder, within the node-RAM budget (a replica that does not fit
    is declined and logged), and besides, every replica its source's node RAM keeps beyond
    its newest: pinned (``Checkpointer.pin``) or kept by the node-RAM tier's ``keep_best`` /
    ``keep_every_n_steps``. Each round carries that list from every rank to its partners
    (whether it offers a shard or not), and the partner's retention of that source's
    replicas keeps them; an unpin reaches the replicas with the next round. A round that
    fails (a partner died: the group's timeout) ends replication for this run, logged; saves
    and loads go on without it.
    """

    def __init__(
        self, spec: PeerTier, ram: Tier, tiers: Sequence[Tier], *, rank: int, world_size: int
    ) -> None:
        import torch.distributed as dist

        self.spec = spec
        self._ram = ram
        self._tiers = tuple(tiers)
        self._rank = rank
        self._world = world_size
        assert isinstance(ram.spec, NodeRamTier) and isinstance(ram.backend, NodeRamBackend)
        self._ram_spec: NodeRamTier = ram.spec
        self._ram_backend: NodeRamBackend = ram.backend
        timeout = timedelta(seconds=spec.timeout_s)
        self._bg_group = dist.new_group(backend="gloo", timeout=timeout)
        self._load_group = dist.new_group(backend="gloo", timeout=timeout)
        mine = torch.tensor([node_key(self._ram_spec.path)], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(gathered, mine, group=self._load_group)
        keys = [int(t.item()) for t in gathered]
        self.placement = (
            Placement.fixed(spec.placement, world_size)
            if spec.placement is not None
            else ring_placement(keys, spec.replicas)
        )
        if not self.placement.partners[rank]:
            log.warning("PeerTier: rank %d has no partner on another node: no replica", rank)
        self._replicas: dict[int, NodeRamBackend] = {}
        #: per source rank, what its node RAM keeps beyond its newest (its last round's
        #: word); None: it could not tell, so its replicas are left as they are
        self._source_kept: dict[int, set[CheckpointId] | None] = {}
        #: this rank's node RAM could not tell what it keeps (background thread only)
        self._kept_outage = Outage()
        #: (checkpoint, committed on this node's RAM): one round each, in the order reported
        self._queue: queue.Queue[tuple[CheckpointId, bool] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._broken: str | None = None
        #: rounds done, bytes sent and received (for tests and stats)
        self.rounds = 0
        self.sent_bytes = 0
        self.received_bytes = 0
        self.last_restore: RestoreReport | None = None
        self.spare: SpareSegment | None = prepare_spare(  # what a pull at the load fills
            self._ram_backend, self.replica_backend, self.placement, rank, self._load_group
        )

    # -- replica folders ---------------------------------------------------------------
    def replica_backend(self, src: int) -> NodeRamBackend:
        """Where this rank keeps rank ``src``'s replicas (counted in its node-RAM budget)."""
        b = self._replicas.get(src)
        if b is None:
            root = self._ram_spec.root
            b = NodeRamBackend(
                os.path.join(root + REPLICA_SUFFIX, f"rank-{src:06d}"),
                max_bytes=self._ram_spec.max_bytes,
                budget_root=root,
            )
            self._replicas[src] = b
        return b

    def _held(self, backend: NodeRamBackend, rank: int) -> list[tuple[CheckpointId, Manifest]]:
        """Checkpoints whose ``rank`` shard is whole on ``backend``, newest first."""
        out = []
        for cid in reversed(committed_ids(backend)[-_CANDIDATES:]):
            try:
                m = read_manifest(backend, cid.step, "noderam", timeline=cid.timeline)
                ref = m.shard_for(rank)
                if backend.size(ref.file) == ref.size:
                    out.append((cid, m))
            except (OSError, TierCkptError):
                continue
        return out

    def _offer(self, backend: NodeRamBackend, cid: CheckpointId, rank: int) -> Offer | None:
        try:
            m = read_manifest(backend, cid.step, "noderam", timeline=cid.timeline)
            ref = m.shard_for(rank)
        except (OSError, TierCkptError):
            return None  # removed by retention meanwhile
        return Offer(cid, rank, encode_manifest(m), backend._path(ref.file), ref.size)

    # -- background replication ----------------------------------------------------------
    def on_event(self, event: CheckpointEvent) -> None:
        """An event callback (pipeline threads): every outcome of a node-RAM save — committed,
        failed, given up — starts a round; only a committed one offers the shard."""
        if event.tier != self._ram.name or self._broken is not None:
            return
        if event.kind not in ("committed", "failed", "deadline"):
            return
        self._enqueue(CheckpointId(event.step, event.timeline), event.kind == "committed")

    def on_commit(self, result: TierResult) -> None:
        """A commit callback: a node-RAM commit starts a round (:meth:`on_event` also starts
        one for a failed copy; a Checkpointer registers that one)."""
        if result.tier == self._ram.name and self._broken is None:
            self._enqueue(CheckpointId(result.step, result.timeline), True)

    def _enqueue(self, cid: CheckpointId, committed: bool) -> None:
        # the pipeline reports each tier's copy of a save once (committed, failed or given
        # up), so every rank queues the same number of rounds
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierckpt-peer", daemon=True)
                self._thread.start()
        self._queue.put((cid, committed))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            cid = item[0] if item is not None else None
            try:
                if item is None:
                    return
                if self._broken is None:
                    self._round(*item)
            except Exception as exc:
                self._broken = str(exc)
                log.warning(
                    "PeerTier: replicating %s failed (%s); no more replicas this run (loads "
                    "still use the replicas already made)",
                    cid,
                    exc,
                )
            finally:
                self._queue.task_done()

    def _round(self, cid: CheckpointId, committed: bool = True) -> None:
        t0 = time.perf_counter()
        me = self._rank
        # a copy that did not commit here has nothing to offer (its shard file may even be
        # whole, but without this node's manifest it is not a checkpoint)
        offer = self._offer(self._ram_backend, cid, me) if committed else None
        offers: dict[int, Offer | None] = dict.fromkeys(self.placement.partners[me], offer)
        sources = self.placement.sources(me)

        def accept(src: int, rank: int, m: Manifest) -> str | None:
            b = self.replica_backend(rank)
            if b.exists(manifest_name(m.step, timeline=m.timeline)):
                return None
            ref = m.shard_for(rank)
            try:
                b.check_budget(ref.size, ref.file)
            except OSError as exc:
                log.warning("PeerTier: declining rank %d's replica of %s: %s", src, m.id, exc)
                return None
            return b._path(ref.file)

        kept_in: dict[int, list[int]] = {}
        got = exchange(
            self._bg_group, me, offers, sources, accept, kept=self._kept_keys(), kept_in=kept_in
        )
        self.rounds += 1
        if offer is not None:
            self.sent_bytes += offer.size * len(offers)
        for s, keys in kept_in.items():
            self._source_kept[s] = (
                None if _UNKNOWN in keys else {checkpoint_of_key(k) for k in keys}
            )
        for r in got:
            self._commit_replica(r)
        for s in sources:  # an unpin (or a new best) reaches the replicas with this round
            self._retain(s)
        log.debug("PeerTier: round for %s in %.3f s", cid, time.perf_counter() - t0)

    def _kept_keys(self) -> list[int]:
        """The checkpoints this rank's node RAM keeps beyond its newest — pinned, or kept by
        its ``keep_best`` / ``keep_every_n_steps`` — as keys for the partners (``[-1]``:
        unknown, the node RAM could not be read: the partners then remove nothing)."""
        b = self._ram_backend
        rule = self._ram_spec.retention
        try:
            keep = set(pinned_ids(b))
            if rule.keep_best is not None or rule.keep_every_n_steps is not None:
                beyond = Retention(
                    keep_last=1,
                    keep_every_n_steps=rule.keep_every_n_steps,
                    keep_best=rule.keep_best,
                    best_metric=rule.best_metric,
                    best_mode=rule.best_mode,
                )
                keep |= kept_ids(b, committed_ids(b), beyond)
        except (OSError, TierCkptError) as exc:  # at every round while it lasts: said once
            self._kept_outage.failed(
                "PeerTier: cannot tell which checkpoints node RAM keeps (the partners keep "
                "every replica of this rank meanwhile; said again when it works): %s",
                exc,
            )
            return [_UNKNOWN]
        self._kept_outage.worked("PeerTier: node RAM tells again which checkpoints it keeps")
        return sorted(checkpoint_key(c) for c in keep)

    def _retain(self, src: int) -> None:
        """Retention of rank ``src``'s replicas: this tier's rules, and what ``src``'s node
        RAM keeps beyond its newest (pins, best, every n-th)."""
        kept = self._source_kept.get(src, set())
        if kept is None:
            return  # the source could not tell: remove nothing rather than guess
        b = self.replica_backend(src)
        gc_tier(b, self.spec.retention, protect=kept)

    def _commit_replica(self, r: Received) -> None:
        b = self.replica_backend(r.rank)
        try:
            b.put_atomic(manifest_name(r.manifest.step, timeline=r.manifest.timeline), r.body)
        except FileExistsError:
            pass
        self.received_bytes += r.size

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the rounds queued so far are done (tests, benchmarks, close)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._thread is not None and self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def release_spare(self) -> None:
        """Give back the spare segment's node RAM (a load that pulls takes it itself): a load
        of one named tier (no pull) or a save came first, and the spare, counted in the
        node-RAM budget, would otherwise hold a shard's memory until ``close``."""
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.discard()

    def close(self, timeout: float = 60.0) -> None:
        """Finish the queued rounds (bounded by ``timeout``), then stop the thread."""
        self.release_spare()
        th = self._thread
        if th is None:
            return
        self._queue.put(None)
        th.join(timeout)
        if th.is_alive():
            log.warning("PeerTier: replication still busy after %.0f s; abandoned", timeout)

    # -- load ---------------------------------------------------------------------------
    def prepare_load(self, step: int | None, timeline: int | None) -> CheckpointId | None:
        """Before a load (training thread, every rank together): agree on the newest
        checkpoint every rank can restore (from its node RAM, from a partner's replica, or
        from a slower tier it lists) and pull from partners the shards whose node RAM lacks
        them into this rank's node RAM. Returns the checkpoint to load (None: none is common;
        the load's own agreement then says why)."""
        import torch.distributed as dist

        me = self._rank
        own = self._held(self._ram_backend, me)
        slow: dict[CheckpointId, str] = {}
        for t in self._tiers:
            if t is self._ram:
                continue
            try:
                for cid in committed_ids(t.backend)[-_CANDIDATES:]:
                    slow.setdefault(cid, t.name)
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
        held: list[tuple[int, CheckpointId]] = []
        for src in self.placement.sources(me):
            held += [(src, cid) for cid, _m in self._held(self.replica_backend(src), src)]
        smax = self.placement.max_sources()
        k = _CANDIDATES
        names = [t.name for t in self._tiers]
        # [own node RAM: k ids][slower tiers: k (id, tier index)][replicas: (source, id)...]
        vec = torch.full((3 * k + 2 * k * smax,), -1, dtype=torch.int64)
        for i, (cid, _m) in enumerate(own[:k]):
            vec[i] = checkpoint_key(cid)
        for i, cid in enumerate(sorted(slow, reverse=True)[:k]):
            vec[k + 2 * i] = checkpoint_key(cid)
            vec[k + 2 * i + 1] = names.index(slow[cid])
        for i, (src, cid) in enumerate(held[: k * smax]):
            vec[3 * k + 2 * i] = src
            vec[3 * k + 2 * i + 1] = checkpoint_key(cid)
        gathered = [torch.empty_like(vec) for _ in range(self._world)]
        dist.all_gather(gathered, vec, group=self._load_group)
        plan = choose(gathered, k, names, self.placement.partners, step, timeline)
        if plan is None:
            return None
        chosen, sources, pulls = plan
        spare, self.spare = self.spare, None
        if spare is not None and not any(r == me for _h, r in pulls):
            spare.discard()  # nothing to pull here after all: its memory goes back
            spare = None
        waited = spare.wait() if spare is not None else 0.0
        t0 = time.perf_counter()
        try:
            pulled = self._pull(chosen, pulls, spare)
        finally:
            if spare is not None:
                spare.discard()  # taken (renamed) by the pull, or unused: removed
        seconds = time.perf_counter() - t0
        mine = sources[me]
        if mine != "noderam" and not mine.startswith("peer:"):
            log.warning(
                "rank %d: %s is neither in this node's RAM nor on a partner (ranks %s): "
                "falling back to tier %r",
                me,
                chosen,
                list(self.placement.partners[me]),
                mine,
            )
        elif mine.startswith("peer:"):
            log.warning(
                "rank %d: %s was not in this node's RAM: pulled %d bytes from partner rank %s "
                "in %.3f s",
                me,
                chosen,
                pulled,
                mine[5:],
                seconds,
            )
        else:
            log.info("rank %d: restoring %s from this node's RAM", me, chosen)
        self.last_restore = RestoreReport(chosen, tuple(sources), pulled, seconds, waited)
        return chosen

    def _pull(
        self, cid: CheckpointId, pulls: list[tuple[int, int]], spare: SpareSegment | None = None
    ) -> int:
        """Run the pulls (holder -> receiver) this rank takes part in; returns bytes received.
        A pulled shard lands in this rank's node RAM and commits there (its manifest,
        create-only, unless the node already had it)."""
        me = self._rank
        offers: dict[int, Offer | None] = {}
        for h, r in pulls:
            if h == me:
                offers[r] = self._offer(self.replica_backend(r), cid, r)
        sources = [h for h, r in pulls if r == me]
        if not offers and not sources:
            return 0

        def accept(src: int, rank: int, m: Manifest) -> str | None:
            ref = m.shard_for(rank)
            if rank != me or m.id != cid:
                return None
            # a ready spare becomes the file: only the bytes beyond it are new
            more = ref.size - (spare.size if spare is not None and spare.error is None else 0)
            # an earlier pull of this file killed midway left its temporary file (a whole
            # shard; only this rank writes this name): it goes before the budget is checked
            # (the save's sweep would remove it too, but only at the next save)
            self._ram_backend.cleanup_incomplete(ref.file)
            try:
                self._ram_backend.check_budget(max(0, more), ref.file)
            except OSError as exc:  # decline: the load reads a slower tier instead
                log.warning("rank %d: cannot pull %s into node RAM: %s", me, cid, exc)
                return None
            return self._ram_backend._path(ref.file)

        got = exchange(self._load_group, me, offers, sources, accept, tag=1, spare=spare)
        n = 0
        for rec in got:
            try:
                self._ram_backend.put_atomic(
                    manifest_name(rec.manifest.step, timeline=rec.manifest.timeline), rec.body
                )
            except FileExistsError:
                pass
            n += rec.size
        if sources and not got:
            # every rank goes on to the load's agreement, which then finds this rank short
            log.warning("rank %d: partner rank(s) %s could not send %s", me, sources, cid)
        return n
