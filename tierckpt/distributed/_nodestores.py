"""The node's ranks and stores for the private-tier commit (:mod:`._private`).

On a private tier (RAM, node RAM, a node-local disk) every rank's completion record used to be
one ``set`` on the process group's store, the ``TCPStore`` on rank 0's host, and every rank
fetched the composed manifest (~1.1 MB at 8,000 ranks) from it: 8,000 sets and 8.8 GB out of
one host per checkpoint (docs/scale.md). Instead each node's ranks publish into a store of
their own node, hosted by the node's leader (its lowest rank); the node's last rank to publish
forwards all of them to rank 0's store as one item, and the leader fetches the manifest once
for its node. :class:`NodeStores` is one rank's view: its node, the node's ranks, the node's
store and rank 0's; :func:`make_node_stores` builds it (collective, training thread).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from tierckpt.distributed._collectives import collective_device
from tierckpt.errors import TierCkptError

log = logging.getLogger("tierckpt")

__all__ = ["LockedStore", "NodeStores", "make_node_stores"]


class LockedStore:
    """A store client shared by this process's threads, one call at a time (a store client is
    one connection; the commit threads of several tiers use it at once). ``label``: where the
    store is, for errors (a store's own error says only that a connection failed)."""

    def __init__(
        self, store: Any, lock: threading.Lock | None = None, label: str | None = None
    ) -> None:
        self.store = store
        self.lock = lock if lock is not None else threading.Lock()
        self.label = label

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self.lock:
            try:
                yield
            except RuntimeError as exc:  # torch's store errors (DistStoreError and others)
                if self.label is None:
                    raise
                raise TierCkptError(
                    f"{self.label}: {exc} (its host process may have died); nothing committed"
                ) from exc

    def set(self, key: str, value: bytes) -> None:
        with self._call():
            self.store.set(key, value)

    def get(self, key: str) -> bytes:
        with self._call():
            return bytes(self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        with self._call():
            return bool(self.store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self._call():
            return [bytes(b) for b in self.store.multi_get(keys)]

    def add(self, key: str, n: int) -> int:
        with self._call():
            return int(self.store.add(key, n))

    def failure(self, key: str) -> bytes | None:
        """The value of ``key`` if it is set (a failure someone reported), else None."""
        with self._call():
            return bytes(self.store.get(key)) if self.store.check([key]) else None

    def delete(self, keys: Sequence[str]) -> None:
        with self.lock:
            for key in keys:
                with contextlib.suppress(RuntimeError):
                    self.store.delete_key(key)


class NodeStores:
    """One rank's place in the private-tier commit: its node (``node`` of ``nodes``), the
    node's ranks (``members``, ascending; the first leads), the node's store (None when the
    rank is alone on its node) and rank 0's store (``global_store``; a callable, called at
    each use, so that the default group's store is looked up late)."""

    def __init__(
        self,
        *,
        rank: int,
        node: int,
        nodes: int,
        members: Sequence[int],
        node_store: LockedStore | None,
        global_store: Callable[[], LockedStore],
        node_members: Sequence[Sequence[int]] | None = None,
    ) -> None:
        self.rank = rank
        self.node = node
        self.nodes = nodes
        self.members = tuple(members)
        self.node_store = node_store
        self._global_store = global_store
        #: every node's ranks (for rank 0's messages); None: node i is rank i alone
        self.node_members = tuple(tuple(m) for m in node_members) if node_members else None

    @classmethod
    def singleton(
        cls, rank: int, world_size: int, global_store: Callable[[], LockedStore]
    ) -> NodeStores:
        """Every rank its own node: each publishes straight into rank 0's store (the protocol
        without node stores: no process group to learn the nodes from, or one rank a node)."""
        return cls(
            rank=rank,
            node=rank,
            nodes=world_size,
            members=(rank,),
            node_store=None,
            global_store=global_store,
        )

    @property
    def is_leader(self) -> bool:
        return self.rank == self.members[0]

    @property
    def global_store(self) -> LockedStore:
        return self._global_store()

    def ranks_of(self, node: int) -> tuple[int, ...]:
        return self.node_members[node] if self.node_members else (node,)


def _advertised_host() -> str:
    """The address other ranks of this node reach this process at: the local address of the
    route to rank 0's store (the same host: its own address), else 127.0.0.1."""
    import torch.distributed as dist

    try:
        st: Any = dist.distributed_c10d._get_default_store()
        while hasattr(st, "underlying_store"):
            st = st.underlying_store
        master = str(st.host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 1))  # no packet is sent: only the route is looked up
            return str(s.getsockname()[0])
    except (AttributeError, OSError, RuntimeError):
        return "127.0.0.1"


_cache_lock = threading.Lock()
_cache: dict[int, tuple[Any, NodeStores]] = {}


def make_node_stores(
    node_key: str, global_store: Callable[[], LockedStore], timeout_s: float
) -> NodeStores:
    """This rank's :class:`NodeStores` from the default process group (collective: every
    rank calls it at the same point, in the training thread; made once per process group).

    One ``all_gather_object`` of the node keys (``TIERCKPT_NODE`` or the host name) finds the
    nodes; each node's leader starts a ``TCPStore`` server (a free port, all interfaces) and a
    second ``all_gather_object`` tells the node's ranks where it is. A rank alone on its node
    needs no store.
    """
    import torch.distributed as dist

    base: Any = dist.distributed_c10d._get_default_store()
    with _cache_lock:
        hit = _cache.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1]
    world = dist.get_world_size()
    me = dist.get_rank()
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, node_key)
    by_key: dict[str, list[int]] = {}
    for r, key in enumerate(keys):
        by_key.setdefault(str(key), []).append(r)
    groups = sorted(by_key.values())  # by lowest rank: rank 0's node is node 0
    node = next(i for i, g in enumerate(groups) if me in g)
    members = groups[node]
    timeout = timedelta(seconds=timeout_s)
    server: Any = None
    where: tuple[str, int] | None = None
    if me == members[0] and len(members) > 1:
        host = _advertised_host()
        server = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
        where = (host, int(server.port))
    wheres: list[Any] = [None] * world
    dist.all_gather_object(wheres, where)
    node_store: LockedStore | None = None
    if len(members) > 1:
        host, port = wheres[members[0]]
        label = f"the store of node {node} (rank {members[0]}'s, at {host}:{port})"
        if server is not None:
            node_store = LockedStore(server, label=label)
        else:
            try:
                client = dist.TCPStore(host, int(port), None, False, timeout)  # type: ignore[attr-defined]
                node_store = LockedStore(client, label=label)
            except RuntimeError as exc:
                log.warning(
                    "rank %d cannot reach %s (%s); private tiers commit through rank 0's "
                    "store, one item per rank (set TIERCKPT_NODE where the host name does not "
                    "tell the nodes apart)",
                    me,
                    label,
                    exc,
                )
    # every rank reached its node's store, or every rank goes without (the same everywhere)
    ok = torch.tensor([0 if len(members) > 1 and node_store is None else 1], dtype=torch.int64)
    ok = ok.to(collective_device())
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok.item()):
        stores = NodeStores.singleton(me, world, global_store)
        with _cache_lock:
            _cache.clear()
            _cache[id(base)] = (base, stores)
        return stores
    stores = NodeStores(
        rank=me,
        node=node,
        nodes=len(groups),
        members=members,
        node_store=node_store,
        global_store=global_store,
        node_members=groups,
    )
    with _cache_lock:
        _cache.clear()
        _cache[id(base)] = (base, stores)  # keeps the server alive as long as the group's store
    return stores
