"""The private-tier commit at scale: N simulated ranks (threads), real ``TCPStore`` servers.

A private tier (RAM, node RAM, a node-local disk) commits through key-value stores
(:mod:`tierckpt.distributed._private`). This runs that code — ``_publish_private`` on the
"tier thread", ``_commit_private`` on the "commit thread" of each of ``ranks`` threads — with
one ``TCPStore`` server standing for rank 0's store and, per node of ``ranks_per_node``, one
standing for the node leader's; every simulated rank has its own client connections, as a
process would. Two layouts:

- ``per_node``: the nodes as a job has them; one item per node reaches rank 0's store;
- ``flat``: every rank its own node (what the commit did before node stores: one record per
  rank in rank 0's store, every rank fetching the manifest from it).

Each call on rank 0's store is counted (by operation, and the manifest bytes it served), and
rank 0's commit latency is taken from the last rank's publish to the manifest in rank 0's
store, and to the last rank having written it.
"""

from __future__ import annotations

import random
import secrets
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from tierckpt.backends.memory import MemoryBackend
from tierckpt.codecs import codec_from_config
from tierckpt.distributed import RankRecord
from tierckpt.distributed._nodestores import LockedStore, NodeStores
from tierckpt.distributed._private import _commit_private, _publish_private
from tierckpt.format import shard_name
from tierckpt.pipeline import Tier
from tierckpt.policy import MemoryTier

__all__ = ["PrivateScaleResult", "run_private_scale"]


@dataclass
class PrivateScaleResult:
    """One layout's measurements over ``repeats`` checkpoints (counts: the last one)."""

    ranks: int
    ranks_per_node: int
    layout: str
    nodes: int = 0
    #: calls on rank 0's store in one checkpoint, by operation
    global_ops: dict[str, int] = field(default_factory=dict)
    #: bytes rank 0's store served to ``get`` / ``multi_get`` in one checkpoint
    global_bytes_out: int = 0
    #: the most keys rank 0 waited on in one ``check``
    widest_check: int = 0
    #: from the last rank's publish to the manifest in rank 0's store / on every rank
    commit_s: list[float] = field(default_factory=list)
    everyone_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "ranks_per_node": self.ranks_per_node,
            "layout": self.layout,
            "nodes": self.nodes,
            "global_ops": self.global_ops,
            "global_ops_total": sum(self.global_ops.values()),
            "global_bytes_out": self.global_bytes_out,
            "widest_check": self.widest_check,
            "commit_s": self.commit_s,
            "commit_median_s": statistics.median(self.commit_s),
            "everyone_s": self.everyone_s,
            "everyone_median_s": statistics.median(self.everyone_s),
        }


class _Counting:
    """A client of rank 0's store that counts the calls made on it."""

    def __init__(self, store: Any, res: PrivateScaleResult, lock: threading.Lock) -> None:
        self._store = store
        self._res = res
        self._lock = lock
        self.calls: Counter[str] = Counter()

    def _count(self, op: str, nbytes: int = 0, width: int = 0) -> None:
        with self._lock:
            self.calls[op] += 1
            self._res.global_bytes_out += nbytes
            self._res.widest_check = max(self._res.widest_check, width)

    def set(self, key: str, value: bytes) -> None:
        self._count("set")
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        out = bytes(self._store.get(key))
        self._count("get", len(out))
        return out

    def check(self, keys: list[str]) -> bool:
        self._count("check", width=len(keys))
        return bool(self._store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        out = [bytes(b) for b in self._store.multi_get(keys)]
        self._count("multi_get", sum(len(b) for b in out))
        return out

    def add(self, key: str, n: int) -> int:
        self._count("add")
        return int(self._store.add(key, n))

    def delete_key(self, key: str) -> bool:
        self._count("delete_key")
        return bool(self._store.delete_key(key))


def _server() -> Any:
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, timedelta(seconds=300), wait_for_workers=False
    )


def _client(port: int) -> Any:
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, None, False, timedelta(seconds=300)
    )


def _checkpoint(
    step: int, attempt: str, tiers: list[Tier], stores: list[NodeStores], delays: list[float]
) -> tuple[list[float], list[float]]:
    """One checkpoint: every rank (a thread) publishes its record after its delay and runs the
    commit's waiting part; when each rank published and finished."""
    ranks = len(tiers)
    published = [0.0] * ranks
    done = [0.0] * ranks
    errors: list[BaseException] = []
    start = time.monotonic()

    def rank_work(r: int) -> None:
        try:
            job: Any = SimpleNamespace(
                step=step, rank=r, world_size=ranks, attempt=attempt, timeline=0, metadata={}
            )
            rec = RankRecord(
                step, r, ranks, attempt, "ram", shard_name(step, r, prefixes=0), 4096,
                "0123456789abcdef", 4096, 4096, "raw",
            )  # fmt: skip
            time.sleep(max(0.0, start + delays[r] - time.monotonic()))
            _publish_private(tiers[r], job, rec, stores[r])
            published[r] = time.monotonic()
            _commit_private(tiers[r], job, stores[r])
            done[r] = time.monotonic()
        except BaseException as exc:  # raised below
            errors.append(exc)

    threads = [threading.Thread(target=rank_work, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return published, done


def run_private_scale(
    *,
    ranks: int,
    ranks_per_node: int = 8,
    layout: str = "per_node",
    repeats: int = 1,
    spread_s: float = 0.5,
    seed: int = 0,
    log: Any = None,
) -> PrivateScaleResult:
    """Simulate ``repeats`` checkpoints of ``ranks`` ranks on a private (RAM) tier; the ranks
    publish their records over ``spread_s`` seconds, in a random order."""
    per_node = ranks_per_node if layout == "per_node" else 1
    nodes = (ranks + per_node - 1) // per_node
    res = PrivateScaleResult(ranks, per_node, layout, nodes=nodes)
    rnd = random.Random(seed)
    count_lock = threading.Lock()
    g_server = _server()
    n_servers = [_server() for _ in range(nodes)] if per_node > 1 else []
    # connecting takes ~0.2 s per client here (a reverse DNS lookup): many at once
    with ThreadPoolExecutor(64) as pool:
        g_clients = list(pool.map(lambda _r: _client(g_server.port), range(ranks)))
        n_clients = list(
            pool.map(lambda r: _client(n_servers[r // per_node].port), range(ranks))
            if n_servers
            else []
        )
    counting = [_Counting(c, res, count_lock) for c in g_clients]
    members = [list(range(n * per_node, min(ranks, (n + 1) * per_node))) for n in range(nodes)]
    stores: list[NodeStores] = []
    for r in range(ranks):
        node = r // per_node
        g = LockedStore(counting[r])
        ns = LockedStore(n_clients[r]) if n_servers else None
        stores.append(
            NodeStores(
                rank=r,
                node=node,
                nodes=nodes,
                members=members[node],
                node_store=ns,
                global_store=lambda g=g: g,  # type: ignore[misc]
                node_members=members,
            )
        )
    codec = codec_from_config({"id": "raw"})
    spec = MemoryTier(name="ram")
    run = secrets.token_hex(4)  # memory namespaces live as long as the process
    tiers = [Tier(spec, MemoryBackend(f"privscale-{run}-{r}"), codec) for r in range(ranks)]
    for rep in range(repeats):
        step = rep + 1
        attempt = f"{rnd.getrandbits(60):016x}-{step}"
        for c in counting:
            c.calls.clear()
        res.global_bytes_out = 0
        res.widest_check = 0
        delays = [rnd.uniform(0, spread_s) for _ in range(ranks)]
        published, done = _checkpoint(step, attempt, tiers, stores, delays)
        last = max(published)
        res.commit_s.append(done[0] - last)
        res.everyone_s.append(max(done) - last)
        total: Counter[str] = Counter()
        for c in counting:
            total.update(c.calls)
        res.global_ops = dict(total)
        if log is not None:
            log(
                f"  N={ranks} {layout} step {step}: rank 0 committed {res.commit_s[-1] * 1000:.0f}"
                f" ms after the last record, every rank {res.everyone_s[-1] * 1000:.0f} ms; "
                f"{sum(total.values())} calls on rank 0's store"
            )
    return res
