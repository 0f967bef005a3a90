"""The multi-rank commit and load at scale, simulated against a real S3 server.

``N`` ranks are threads of this process, ``ranks_per_node`` to a simulated node (one
:class:`~tierckpt.backends.s3.S3Backend`, so one connection pool, per node). Each rank writes
a small shard file through ``open_writer`` and hands it to the real
:class:`~tierckpt.distributed.MultiRankCommit` ``commit()`` — the code a training rank runs:
it writes the rank's completion record, and on rank 0 waits for every record and writes the
manifest (v1: records GET by rank 0; v2: LIST-only, :mod:`tierckpt.distributed._listcommit`).
The job handed to it is a stand-in carrying the fields ``commit()`` reads (step, rank, world
size, attempt, timeline, metadata). All requests go through
:class:`~tierckpt.testing.faultproxy.FaultProxy` (no faults), which records each one, so the
counts by type and by key prefix are the server's view.

Load: each rank reads the manifest as a multi-rank load does. ``per_node``: through
:func:`~tierckpt.distributed._nodeshare.read_manifests_per_node`, the function
``MultiRankCommit.agree_on_step`` calls, with the node's ranks sharing the leader's bytes
through a thread barrier instead of ``torch.distributed`` (the real group is tested with gloo
processes in tests/test_scale.py); ``per_rank``: every rank reads it twice, as tierckpt did
before (the load agreement, then the load).
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import xxhash

from tierckpt.backends.s3 import S3Backend
from tierckpt.codecs import codec_from_config
from tierckpt.distributed import MultiRankCommit
from tierckpt.distributed._nodeshare import read_manifests_per_node
from tierckpt.format import CheckpointId, ShardRef, step_prefix
from tierckpt.layout import shard_file
from tierckpt.pipeline import Tier
from tierckpt.policy import S3Tier
from tierckpt.restore import read_manifest
from tierckpt.testing.faultproxy import FaultProxy, RequestRecord

__all__ = ["ScaleResult", "ThreadNodeComm", "classify", "run_scale"]

ROOT = "run"


@dataclass
class ScaleResult:
    """One configuration's measurements (medians over repeats where it says so)."""

    ranks: int
    prefixes: int
    repeats: int
    #: requests of one checkpoint by type (the last repeat)
    requests: dict[str, int] = field(default_factory=dict)
    #: writes (PUT/POST) of one checkpoint by top-level prefix
    writes_by_prefix: dict[str, int] = field(default_factory=dict)
    max_write_share: float = 0.0
    max_write_prefix: str = ""
    prefixes_used: int = 0
    record_gets: int = 0
    commit_latency_s: list[float] = field(default_factory=list)
    checkpoint_s: list[float] = field(default_factory=list)
    #: manifest GETs of one load of all ranks: per node (leader shares) and per rank (before)
    manifest_gets_per_node_load: int = 0
    manifest_gets_per_rank_load: int = 0
    nodes: int = 0

    @property
    def commit_latency_median(self) -> float:
        return statistics.median(self.commit_latency_s)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ranks": self.ranks,
            "prefixes": self.prefixes,
            "format": 2 if self.prefixes else 1,
            "repeats": self.repeats,
            "requests": self.requests,
            "max_write_share": self.max_write_share,
            "max_write_prefix": self.max_write_prefix,
            "prefixes_used": self.prefixes_used,
            "record_gets": self.record_gets,
            "commit_latency_s": self.commit_latency_s,
            "commit_latency_median_s": self.commit_latency_median,
            "checkpoint_s": self.checkpoint_s,
            "nodes": self.nodes,
            "manifest_gets_per_node_load": self.manifest_gets_per_node_load,
            "manifest_gets_per_rank_load": self.manifest_gets_per_rank_load,
        }


def classify(rec: RequestRecord, bucket: str) -> tuple[str, str, str]:
    """``(type, top-level prefix under the tier root, key or list prefix)`` of a request."""
    parts = urlsplit(rec.target)
    query = parse_qs(parts.query, keep_blank_values=True)
    path = unquote(parts.path).lstrip("/")
    key = path[len(bucket) + 1 :] if path.startswith(bucket + "/") else ""
    if rec.method == "GET" and ("list-type" in query or not key):
        key = query.get("prefix", [""])[0]
        kind = "LIST"
    elif rec.method == "PUT":
        kind = "UploadPart" if "partNumber" in query else "PUT"
    elif rec.method == "POST":
        kind = "CreateMPU" if "uploads" in query else "CompleteMPU"
    else:
        kind = rec.method
    rel = key[len(ROOT) + 1 :] if key.startswith(ROOT + "/") else key
    top = rel.split("/", 1)[0] if "/" in rel else rel
    if top.startswith(".tierckpt-probe"):
        top = "probe"
    return kind, top, rel


class ThreadNodeComm:
    """:class:`~tierckpt.distributed._nodeshare.NodeComm` of threads: the node's ranks meet
    at a barrier, where the leader's bytes are handed over (the stand-in for the node group's
    ``broadcast_object_list``)."""

    def __init__(self, node: _ThreadNode, leader: bool) -> None:
        self._node = node
        self._leader = leader

    @property
    def is_leader(self) -> bool:
        return self._leader

    def share(self, payload: bytes | None) -> bytes:
        if self._leader:
            self._node.payload = payload
        self._node.barrier.wait(timeout=120)
        assert self._node.payload is not None
        return self._node.payload


class _ThreadNode:
    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.payload: bytes | None = None


def _backends(
    endpoint: str, bucket: str, prefix: str, nodes: int, conns: int
) -> Iterator[S3Backend]:
    for _ in range(nodes):
        yield S3Backend(
            f"s3://{bucket}/{prefix}",
            endpoint_url=endpoint,
            max_concurrency=conns,
            conditional_put=False,
        )


def run_scale(
    upstream: str,
    bucket: str,
    *,
    ranks: int,
    prefixes: int,
    repeats: int = 1,
    ranks_per_node: int = 8,
    shard_bytes: int = 4096,
    workers: int = 64,
    seed: int = 0,
    log: Any = None,
) -> ScaleResult:
    """Simulate ``repeats`` checkpoints (steps 1..repeats) of ``ranks`` ranks writing to
    ``s3://bucket/run`` on the S3 server ``upstream`` (through a counting proxy), format v1
    (``prefixes=0``) or v2, then one load of the last one by every rank, both ways."""
    res = ScaleResult(ranks, prefixes, repeats)
    nodes = (ranks + ranks_per_node - 1) // ranks_per_node
    res.nodes = nodes
    rnd = random.Random(seed)
    with FaultProxy(upstream) as proxy:
        backends = list(
            _backends(proxy.endpoint_url, bucket, ROOT, nodes, max(4, workers // nodes))
        )
        spec = S3Tier(f"s3://{bucket}/{ROOT}", name="s3", prefixes=prefixes)
        codec = codec_from_config({"id": "raw"})
        tiers = [Tier(spec, b, codec) for b in backends]
        commit_pool = ThreadPoolExecutor(4, thread_name_prefix="scale-commit")
        strategies = [
            MultiRankCommit(
                [tiers[r // ranks_per_node]],
                rank=r,
                world_size=ranks,
                on_busy="block",
                repopulate=False,
                defer=lambda fn: commit_pool.submit(fn),
            )
            for r in range(ranks)
        ]
        try:
            for rep in range(repeats):
                step = rep + 1
                proxy.requests.clear()
                t0 = time.monotonic()
                lat, landed = _one_checkpoint(
                    strategies, tiers, ranks_per_node, step, shard_bytes, workers, rnd
                )
                res.checkpoint_s.append(time.monotonic() - t0)
                res.commit_latency_s.append(lat)
                if log is not None:
                    log(
                        f"  N={ranks} prefixes={prefixes} step {step}: committed "
                        f"{lat * 1000:.0f} ms after the last record ({res.checkpoint_s[-1]:.1f} s "
                        f"in all, last record at {landed:.1f} s)"
                    )
            _count(res, list(proxy.requests), bucket)
            cid = CheckpointId(repeats)
            proxy.requests.clear()
            _load(tiers, ranks, ranks_per_node, cid, per_node_read=True)
            res.manifest_gets_per_node_load = _manifest_gets(proxy.requests, bucket)
            proxy.requests.clear()
            _load(tiers, ranks, ranks_per_node, cid, per_node_read=False)
            res.manifest_gets_per_rank_load = _manifest_gets(proxy.requests, bucket)
        finally:
            commit_pool.shutdown(wait=True)
            for b in backends:
                b.close()
    return res


def _one_checkpoint(
    strategies: list[MultiRankCommit],
    tiers: list[Tier],
    per_node: int,
    step: int,
    shard_bytes: int,
    workers: int,
    rnd: random.Random,
) -> tuple[float, float]:
    """One checkpoint by every rank; rank 0's commit latency after the last record landed
    (seconds) and when that was (seconds after the start)."""
    ranks = len(strategies)
    attempt = f"{rnd.getrandbits(62) + 1:016x}-{step}"
    landed = [0.0] * ranks
    start = time.monotonic()
    committed: list[Future[None] | None] = [None]

    def rank_work(r: int) -> None:
        tier = tiers[r // per_node]
        prefixes = tier.spec.prefixes or 0
        name = shard_file(step_prefix(step), r, prefixes)
        body = r.to_bytes(8, "little") * (shard_bytes // 8)
        w = tier.backend.open_writer(name)
        w.write(0, body)
        w.commit()
        ref = ShardRef(r, name, len(body), xxhash.xxh3_64_hexdigest(body))
        job = SimpleNamespace(
            step=step, rank=r, world_size=ranks, attempt=attempt, timeline=0, metadata={}
        )
        fut = strategies[r].commit(tier, job, ref, len(body), len(body))  # type: ignore[arg-type]
        landed[r] = time.monotonic()
        if r == 0:
            committed[0] = fut

    rank_work(0)  # rank 0 first: its wait runs while the others write
    order = list(range(1, ranks))
    rnd.shuffle(order)
    with ThreadPoolExecutor(workers, thread_name_prefix="scale-rank") as pool:
        list(pool.map(rank_work, order))
    fut = committed[0]
    assert fut is not None
    fut.result(timeout=600)
    done = time.monotonic()
    last = max(landed)
    return done - last, last - start


def _count(res: ScaleResult, reqs: list[RequestRecord], bucket: str) -> None:
    kinds: Counter[str] = Counter()
    writes: Counter[str] = Counter()
    record_gets = 0
    for rec in reqs:
        kind, top, rel = classify(rec, bucket)
        if top == "probe":
            continue
        kinds[kind] += 1
        if kind in ("PUT", "UploadPart", "CreateMPU", "CompleteMPU"):
            writes[top] += 1
        if kind == "GET" and (".done" in rel or "/records/" in rel):
            record_gets += 1
    res.requests = dict(sorted(kinds.items()))
    res.writes_by_prefix = dict(writes)
    total = sum(writes.values())
    top, n = writes.most_common(1)[0] if writes else ("", 0)
    res.max_write_share = n / total if total else 0.0
    res.max_write_prefix = top
    res.prefixes_used = len(writes)
    res.record_gets = record_gets


def _manifest_gets(reqs: Any, bucket: str) -> int:
    n = 0
    for rec in list(reqs):
        kind, top, _rel = classify(rec, bucket)
        if kind == "GET" and top == "manifests":
            n += 1
    return n


def _load(
    tiers: list[Tier], ranks: int, per_node: int, cid: CheckpointId, *, per_node_read: bool
) -> None:
    """Every rank gets the manifest of ``cid`` as a multi-rank load does."""

    def node_work(node: int) -> None:
        members = list(range(node * per_node, min(ranks, (node + 1) * per_node)))
        tier = tiers[node]
        shared = _ThreadNode(len(members))

        def rank_work(i: int) -> None:
            if per_node_read:
                comm = ThreadNodeComm(shared, leader=i == 0)
                cache = read_manifests_per_node(comm, [(tier.name, tier.backend, cid)])
                m = cache.get(tier.name, cid)
            else:
                for _ in range(2):  # the load agreement, then the load
                    m = read_manifest(tier.backend, cid.step, tier.name, timeline=cid.timeline)
            assert m.world_size == ranks

        with ThreadPoolExecutor(len(members)) as pool:
            list(pool.map(rank_work, range(len(members))))

    with ThreadPoolExecutor(16, thread_name_prefix="scale-load") as pool:
        list(pool.map(node_work, range(len(tiers))))


def request_costs(
    upstream: str, bucket: str, *, samples: int = 30, through_proxy: bool = True
) -> dict[str, float]:
    """Median seconds of one request of each kind the commit makes, on this server, from one
    client (through the counting proxy, as in :func:`run_scale`, or straight to the server
    with ``through_proxy=False``): a record PUT (~300 B), a
    GET of one, a HEAD, a LIST page of 1,000 keys, a LIST of a 32-key folder, and a LIST past
    ``StartAfter`` that returns nothing (rank 0's poll of a complete prefix)."""
    out: dict[str, list[float]] = {}
    body = b"x" * 300
    with FaultProxy(upstream) as proxy:
        endpoint = proxy.endpoint_url if through_proxy else upstream
        b = S3Backend(f"s3://{bucket}/costs", endpoint_url=endpoint, conditional_put=False)
        try:
            with ThreadPoolExecutor(32) as pool:
                list(
                    pool.map(
                        lambda i: b.put_atomic(f"big/k-{i:05d}", body, overwrite=True), range(1000)
                    )
                )
                list(
                    pool.map(
                        lambda i: b.put_atomic(f"small/k-{i:05d}", body, overwrite=True), range(32)
                    )
                )

            def timed(kind: str, fn: Any) -> None:
                t0 = time.perf_counter()
                fn()
                out.setdefault(kind, []).append(time.perf_counter() - t0)

            for i in range(samples):
                key = f"small/k-{i % 32:05d}"
                timed("PUT record", lambda: b.put_atomic("rec/k", body, overwrite=True))
                timed("GET record", lambda k=key: b.get(k))  # type: ignore[misc]
                timed("HEAD", lambda k=key: b.size(k))  # type: ignore[misc]
                timed("LIST 32 keys", lambda: b.list("small/"))
                timed("LIST past StartAfter, empty", lambda: b.list_after("small/", "small/k-~"))
                if i < 10:
                    timed("LIST 1,000 keys (1 page)", lambda: b.list("big/"))
        finally:
            b.close()
    return {k: statistics.median(v) for k, v in out.items()}
