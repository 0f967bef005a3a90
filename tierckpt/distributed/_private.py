"""The commit on a tier only its own process (or node) can read (RAM, node RAM, or a
node-local disk named in ``TIERCKPT_PRIVATE_TIERS``): records and the manifest travel through
key-value stores, and every rank writes the same manifest onto its own copy.

Two levels, so that rank 0's store (the process group's ``TCPStore``, on rank 0's host) sees
one item per node, not one per rank (:mod:`._nodestores`):

1. Each rank puts its record into its node's store (hosted by the node's leader) and counts
   itself in; the node's last rank to do so forwards the node's records to rank 0's store as
   one item — all on the tier's writer thread, before any waiting, so that rank 0's wait never
   depends on another rank's queued commit work.
2. Rank 0 waits for one item per node, checks that they hold one record of this attempt per
   rank, composes the manifest and puts it into its store. Each node's leader fetches it once
   and puts it into its node's store, where the node's ranks fetch it.

A rank that fails sets a failure key in rank 0's store and in its node's store; rank 0 and
every waiting leader check the first, every rank of the node the second, and leaders forward
what they hear to their node. Nothing is committed anywhere unless every rank's record arrived.
Without node stores (no process group to learn the nodes from, one rank a node) each rank is
its own node: its record is one item in rank 0's store.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tierckpt import config
from tierckpt.distributed._knobs import get_knobs
from tierckpt.distributed._nodestores import LockedStore, NodeStores
from tierckpt.distributed._records import RankRecord, _ranks, decode_record, encode_record
from tierckpt.distributed._shared import _manifest, _put_manifest
from tierckpt.errors import CommitTimeout, FormatError, RankFailed, TierCkptError
from tierckpt.format import decode_manifest, encode_manifest

if TYPE_CHECKING:
    from tierckpt.pipeline import SaveJob, Tier

__all__ = ["is_private_tier", "settle_private_commits"]

log = logging.getLogger("tierckpt")

#: the longest pause between two polls of the node's store (a store on the node: polling it
#: costs rank 0's host nothing, and a rank hears of its node's manifest soon after its leader)
_NODE_POLL_MAX_S = 0.1
#: who waits for rank 0's word (a node's leader, then the node's other ranks) waits this much
#: longer than rank 0 waits for the records, per hop, at least: rank 0's verdict (the commit,
#: or a timeout naming the missing ranks) arrives, not a timeout of one's own that names
#: nobody (each rank counts from its own commit's start, and ranks start seconds apart on a
#: busy node)
_VERDICT_GRACE_S = 5.0
#: a node's item in rank 0's store is at most this large per record (records are ~300 bytes)
_MAX_ITEM_BYTES_PER_RANK = 64 << 10
_FAILED = b"FAILED "


def is_private_tier(tier: Tier) -> bool:
    """A tier other ranks cannot read: not durable (per-process RAM), node-local (node RAM),
    or named in ``TIERCKPT_PRIVATE_TIERS`` (comma-separated tier names, e.g. node-local NVMe)."""
    b = tier.backend
    return (not b.is_durable) or b.is_node_local or tier.name in config.private_tiers()


_store_lock = threading.Lock()
_store_cache: dict[int, Any] = {}


def _store() -> Any:
    """A client of the default process group's key-value store for background threads."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TierCkptError(
            "a private tier (RAM, or named in TIERCKPT_PRIVATE_TIERS) in a multi-rank job needs "
            "torch.distributed initialized: its commit goes through the process group's store"
        )
    base: Any = dist.distributed_c10d._get_default_store()
    with _store_lock:
        st = _store_cache.get(id(base))
        if st is None:
            try:
                st = base.clone()  # its own connection: the training thread keeps the other
            except (RuntimeError, AttributeError):
                st = base
            _store_cache.clear()
            _store_cache[id(base)] = st
        return st


def global_store() -> LockedStore:
    """Rank 0's store (the default group's), shared by this process's threads."""
    return LockedStore(_store(), _store_lock)


def _store_failure(where: str, failure: bytes) -> RankFailed:
    return RankFailed(
        f"{where}: {failure.decode('utf-8', 'replace')} (reported through the process group's "
        "store); nothing committed, the previous checkpoint stays the newest"
    )


def _store_wait(
    st: LockedStore,
    keys: list[str],
    where: str,
    what: Any,
    deadline: float,
    failed_key: str,
    poll_max: float | None = None,
) -> None:
    """Wait until ``keys`` are in ``st``; CommitTimeout ``where: what`` past ``deadline``
    (``what`` may be a callable, called then); RankFailed at once if a rank set
    ``failed_key``. Polls with pauses doubling up to ``poll_max`` (the knob's if None)."""
    k = get_knobs()
    delay = k.poll_initial
    longest = k.poll_max if poll_max is None else min(poll_max, k.poll_max)
    while True:
        if st.check(keys):
            return
        failure = st.failure(failed_key)
        if failure is not None:
            raise _store_failure(where, failure)
        now = time.monotonic()
        if now >= deadline:
            raise CommitTimeout(f"{where}: {what() if callable(what) else what}")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, longest)


def _prefix(tier: Tier, job: SaveJob) -> str:
    return f"tierckpt/{job.attempt}/{tier.name}/"


def _publish_private(tier: Tier, job: SaveJob, rec: RankRecord, nodes: NodeStores) -> None:
    """Put this rank's record into its node's store; the node's last rank forwards the node's
    records to rank 0's store as one item (tier thread, no waiting)."""
    if not job.attempt:
        raise TierCkptError(
            f"tier {tier.name!r} is private to each process; a multi-rank commit on it needs an "
            "initialized torch.distributed process group"
        )
    p = _prefix(tier, job)
    body = encode_record(rec)
    ns = nodes.node_store
    if ns is None:
        blobs = [body]
    else:
        ns.set(f"{p}rec/{job.rank}", body)
        if ns.add(f"{p}published", 1) != len(nodes.members):
            return
        blobs = ns.multi_get([f"{p}rec/{r}" for r in nodes.members])
    item = json.dumps([b.decode("utf-8") for b in blobs]).encode("utf-8")
    nodes.global_store.set(f"{p}node/{nodes.node}", item)


def _decode_items(
    blobs: list[bytes], keys: list[str], job: SaveJob, where: str
) -> list[RankRecord]:
    """Every record in the nodes' items; exactly one per rank, all of this attempt."""
    records: list[RankRecord] = []
    for blob, key in zip(blobs, keys, strict=True):
        if len(blob) > _MAX_ITEM_BYTES_PER_RANK * job.world_size:
            raise FormatError(f"{where}: store item {key} is {len(blob)} bytes, too large")
        try:
            texts = json.loads(blob)
        except ValueError as exc:
            raise FormatError(f"{where}: store item {key} is not JSON ({exc})") from None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise FormatError(f"{where}: store item {key} is not a list of records")
        records += [decode_record(t.encode("utf-8"), where=f"store {key}") for t in texts]
    if any(
        r.attempt != job.attempt or r.step != job.step or r.timeline != job.timeline
        for r in records
    ):
        raise FormatError(f"step {job.step}: a record in the store is of another attempt")
    ranks = sorted(r.rank for r in records)
    if ranks != list(range(job.world_size)):
        raise FormatError(
            f"{where}: the nodes' records are of ranks {_ranks(ranks)}, not one per rank of "
            f"{job.world_size}"
        )
    return records


def _compose(tier: Tier, job: SaveJob, nodes: NodeStores, deadline: float) -> bytes:
    """Rank 0: wait for every node's item, check the records, the manifest's bytes."""
    p = _prefix(tier, job)
    g = nodes.global_store
    where = f"step {job.step} tier {tier.name!r}"
    keys = [f"{p}node/{n}" for n in range(nodes.nodes)]

    def missing() -> str:
        absent = [n for n, key in enumerate(keys) if not g.check([key])]
        known: list[int] = []  # ranks whose record is not in rank 0's own node's store
        unsure: list[int] = []  # the ranks of other nodes whose item did not come
        for n in absent:
            ranks = nodes.ranks_of(n)
            here = _unpublished(nodes, p, ranks) if n == nodes.node else None
            if here:
                known += here
            elif len(ranks) == 1:
                known += ranks
            else:
                unsure += ranks
        why = (
            f"; of ranks {_ranks(sorted(unsure))} at least one did not publish: their nodes' "
            "items did not come, and a node's last rank forwards all of its node's records"
            if unsure
            else ""
        )
        return (
            f"not every rank published its completion record in time: none from ranks "
            f"{_ranks(sorted(known + unsure))} (of {job.world_size}{why}); nothing committed"
        )

    _store_wait(g, keys, where, missing, deadline, f"{p}failed")
    records = _decode_items(g.multi_get(keys), keys, job, where)
    return encode_manifest(_manifest(tier.name, job, records, node_local=True))


def _unpublished(nodes: NodeStores, prefix: str, ranks: tuple[int, ...]) -> list[int]:
    """Of ``ranks`` (this rank's node), those whose record is not in the node's store; empty
    where that cannot be told (no node store, or it does not answer)."""
    ns = nodes.node_store
    if ns is None:
        return []
    try:
        return [r for r in ranks if not ns.check([f"{prefix}rec/{r}"])]
    except (RuntimeError, TierCkptError):
        return []


def _commit_private(tier: Tier, job: SaveJob, nodes: NodeStores) -> None:
    """The waiting part (commit thread): rank 0 composes the manifest, each node's leader
    fetches it once for its node, every rank writes it onto its own copy of the tier."""
    k = get_knobs()
    grace = max(_VERDICT_GRACE_S, 0.1 * k.commit_timeout)
    hops = 0 if job.rank == 0 else 1 if nodes.is_leader else 2
    deadline = time.monotonic() + k.commit_timeout + hops * grace
    p = _prefix(tier, job)
    m_key, failed_key, done_key = f"{p}manifest", f"{p}failed", f"{p}done"
    where = f"step {job.step} tier {tier.name!r}"
    ns = nodes.node_store
    if nodes.is_leader:
        g = nodes.global_store
        try:
            if job.rank == 0:
                try:
                    body = _compose(tier, job, nodes, deadline)
                except BaseException as exc:
                    g.set(m_key, _FAILED + str(exc).encode("utf-8", "replace")[:4096])
                    raise
                g.set(m_key, body)
            else:
                _store_wait(
                    g,
                    [m_key],
                    where,
                    "rank 0 published no manifest in time; nothing committed",
                    deadline,
                    failed_key,
                )
                body = g.get(m_key)
        except BaseException as exc:
            if ns is not None:  # the node's ranks hear of it at once
                failure = g.failure(failed_key)
                if failure is not None:
                    ns.set(failed_key, failure)
                ns.set(m_key, _FAILED + str(exc).encode("utf-8", "replace")[:4096])
            raise
        if ns is not None:
            if body.startswith(_FAILED):
                failure = g.failure(failed_key)
                if failure is not None:
                    ns.set(failed_key, failure)
            ns.set(m_key, body)
        failed_in = g
    else:
        assert ns is not None
        _store_wait(
            ns,
            [m_key],
            where,
            "the node's leader published no manifest in time; nothing committed",
            deadline,
            failed_key,
            poll_max=_NODE_POLL_MAX_S,
        )
        body = ns.get(m_key)
        failed_in = ns
    if body.startswith(_FAILED):
        failure = failed_in.failure(failed_key)
        if failure is not None:  # rank 0 gave up because a rank reported a failure
            raise _store_failure(where, failure)
        raise TierCkptError(
            f"step {job.step} tier {tier.name!r}: rank 0 could not commit: "
            f"{body[len(_FAILED) :].decode('utf-8', 'replace')}"
        )
    m = decode_manifest(body, where=f"store {m_key}")
    _put_manifest(tier.backend, m)
    # the last one out cleans up: the node's ranks the node's store, the leaders rank 0's
    if ns is not None and ns.add(done_key, 1) == len(nodes.members):
        ns.delete([*(f"{p}rec/{r}" for r in nodes.members), f"{p}published", m_key, done_key])
    if nodes.is_leader:
        g = nodes.global_store
        if g.add(done_key, 1) == nodes.nodes:
            g.delete([*(f"{p}node/{n}" for n in range(nodes.nodes)), m_key, done_key])
        elif job.rank == 0:  # the last leader to write its copy deletes done_key
            _unwritten(g, done_key)


#: rank 0's private commits whose manifest not every node has written yet: (its store, the
#: commit's done key, when it was made), for :func:`settle_private_commits`
_UNWRITTEN: list[tuple[LockedStore, str, float]] = []
_UNWRITTEN_LOCK = threading.Lock()


def _unwritten(g: LockedStore, done_key: str) -> None:
    now = time.monotonic()
    with _UNWRITTEN_LOCK:  # only the commits of the last minute can still be waited for
        _UNWRITTEN[:] = [u for u in _UNWRITTEN if now - u[2] < 60.0]
        _UNWRITTEN.append((g, done_key, now))


def settle_private_commits() -> None:
    """Rank 0, at ``close()``: wait (a few seconds at most) until every node has written the
    manifests of rank 0's recent private commits onto its copy. The process group's store
    lives in rank 0's process where a job started from ``MASTER_ADDR`` (no torchrun agent): a
    rank 0 that exited right after ``close()`` took it away before the other nodes fetched the
    last manifest, and their copies missed the job's last commit (a node a step behind)."""
    with _UNWRITTEN_LOCK:
        pending, _UNWRITTEN[:] = list(_UNWRITTEN), []
    deadline = time.monotonic() + max(_VERDICT_GRACE_S, 2 * get_knobs().poll_max)
    delay = get_knobs().poll_initial
    for g, key, _made in pending:
        try:
            while g.check([key]) and time.monotonic() < deadline:
                time.sleep(delay)
                delay = min(delay * 2, _NODE_POLL_MAX_S)
        except Exception as exc:  # a store gone: nothing left to wait for
            log.debug("close: %s: %s", key, exc)
            return


def _report_private_failure(
    tier: Tier, job: SaveJob, message: str, nodes: NodeStores | None
) -> None:
    """This rank's part failed: tell rank 0 (its store) and the node's ranks (the node's)."""
    if not job.attempt:
        return
    p = _prefix(tier, job)
    body = f"rank {job.rank}: {message}".encode("utf-8", "replace")
    # rank 0's first: the node's store may be what failed (its leader died)
    (nodes.global_store if nodes is not None else global_store()).set(f"{p}failed", body)
    if nodes is not None and nodes.node_store is not None:
        nodes.node_store.set(f"{p}failed", body)
