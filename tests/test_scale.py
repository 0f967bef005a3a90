"""Format v2 at scale (docs/scale.md): shard files and records spread over hashed prefixes,
rank 0 commits from LIST pages alone, the manifest is read once per node at load.

The request counts come from the fault proxy (no faults), so they are the server's view: a
simulation of many ranks as threads through the real commit code (tierckpt/bench/scale.py,
also behind benchmarks/bench_scale.py), and real gloo processes.
"""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import dist_workers
import pytest

from tierckpt import distributed as tdist
from tierckpt.backends.memory import MemoryBackend
from tierckpt.bench.scale import classify, run_scale
from tierckpt.distributed._listcommit import (
    listed_failure_name,
    wait_for_listed_records,
    write_listed_record,
)
from tierckpt.errors import CommitTimeout, RankFailed
from tierckpt.format import shard_name
from tierckpt.layout import hash_prefix
from tierckpt.testing.faultproxy import FaultProxy
from tierckpt.testing.s3servers import S3Server


def _empty_bucket(server: S3Server, bucket: str) -> None:
    admin = server.admin
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            admin.delete_object(Bucket=bucket, Key=o["Key"])
    admin.delete_bucket(Bucket=bucket)


@pytest.fixture
def weed_bucket(seaweedfs_server: S3Server) -> Iterator[str]:
    bucket = f"tierckpt-scale-{secrets.token_hex(4)}"
    seaweedfs_server.admin.create_bucket(Bucket=bucket)
    yield bucket
    _empty_bucket(seaweedfs_server, bucket)


@pytest.mark.s3
def test_v2_commit_lists_only_spreads_writes_and_reads_the_manifest_once_per_node(
    seaweedfs_server: S3Server, weed_bucket: str
) -> None:
    ranks, prefixes, per_node = 48, 16, 8
    r = run_scale(
        seaweedfs_server.endpoint_url,
        weed_bucket,
        ranks=ranks,
        prefixes=prefixes,
        ranks_per_node=per_node,
        workers=16,
    )
    # rank 0 learned every record from LIST pages: no GET of a record at all
    assert r.record_gets == 0 and r.requests.get("GET", 0) == 0
    assert r.requests.get("LIST", 0) >= 1
    # each rank's shard and record under its own hashed prefix, the manifest in manifests/
    expect = Counter(hash_prefix(rank, prefixes) for rank in range(ranks))
    assert r.writes_by_prefix == {**{hh: 2 * n for hh, n in expect.items()}, "manifests": 1}
    assert r.max_write_share == max(expect.values()) * 2 / (2 * ranks + 1)
    # at load the leader of each node of 8 read the manifest, where every rank read it twice
    assert r.nodes == ranks // per_node == 6
    assert r.manifest_gets_per_node_load == 6
    assert r.manifest_gets_per_rank_load == 2 * ranks


@pytest.mark.s3
def test_v1_commit_reads_every_record_from_one_prefix(
    seaweedfs_server: S3Server, weed_bucket: str
) -> None:
    """The baseline the v2 counts are measured against (format v1 names, prefixes=0)."""
    ranks = 48
    r = run_scale(seaweedfs_server.endpoint_url, weed_bucket, ranks=ranks, prefixes=0, workers=16)
    assert r.record_gets == ranks  # rank 0 GETs every record, its own included
    assert r.writes_by_prefix == {"steps": 2 * ranks, "manifests": 1}


@pytest.mark.distributed
@pytest.mark.s3
@pytest.mark.parametrize("world", [4, 3])
def test_gloo_ranks_commit_by_listing_and_read_the_manifest_once_per_node(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], world: int
) -> None:
    """Real processes on 2 simulated nodes (TIERCKPT_NODE; of 2 ranks, or 2 and 1): the
    commit GETs no record, and a load reads the manifest twice (once per node), not once or
    twice per rank."""
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        s3 = {"bucket": bucket, "endpoint": proxy.endpoint_url}
        res = dist_workers.run("w_scale_native", world, s3=s3, per_node=2, timeout=180)
        seen = [classify(rec, bucket) for rec in proxy.requests]
    assert all(r["diff"] == [] and r["steps"] == [1, 2] for r in res)
    record_gets = [rel for kind, _top, rel in seen if kind == "GET" and "/records/" in rel]
    manifest_gets = [rel for kind, top, rel in seen if kind == "GET" and top == "manifests"]
    assert record_gets == []
    assert len(manifest_gets) == 2, manifest_gets
    tops = {top for kind, top, _rel in seen if kind in ("PUT", "CreateMPU") and top != "leases"}
    assert {hash_prefix(rank, 16) for rank in range(world)} <= tops


@pytest.fixture(scope="module")
def dcp_saved_v2(moto_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("dcp-v2")
    bucket = f"tierckpt-dcpv2-{secrets.token_hex(4)}"
    moto_server.admin.create_bucket(Bucket=bucket)
    s3 = {"bucket": bucket, "endpoint": moto_server.endpoint_url}
    dist_workers.run("w_dcp_save", 4, root=str(root), s3=s3, step=10, timeout=150)
    yield {"root": str(root), "s3": s3, "bucket": bucket}
    _empty_bucket(moto_server, bucket)


@pytest.mark.distributed
@pytest.mark.s3
def test_dcp_saved_by_4_gloo_ranks_in_v2_loads_onto_2_bit_exact(
    moto_server: Any, dcp_saved_v2: dict[str, Any]
) -> None:
    import json

    bucket = dcp_saved_v2["bucket"]
    body = json.loads(
        moto_server.admin.get_object(Bucket=bucket, Key="dcp/manifests/step-000000000010.json")[
            "Body"
        ].read()
    )
    # format v2 on S3: every rank's file under its hashed prefix
    assert body["version"] == 2
    assert [s["file"] for s in body["shards"]] == [
        f"{hash_prefix(r, 256)}/steps/000000000010/rank-{r:06d}.tck" for r in range(4)
    ]
    res = dist_workers.run(
        "w_dcp_load",
        2,
        root=dcp_saved_v2["root"],
        s3=dcp_saved_v2["s3"],
        steps=[10],
        source="s3",
        timeout=150,
    )
    assert res[0]["diff-10"] == []  # resharded 4 -> 2, equal to the unsharded state
    assert all(r["extra-10"] == {"epoch": 3, "tag": "run-a"} for r in res)


@pytest.mark.s3
@pytest.mark.parametrize(("local_ranks", "most"), [("8", 2), ("", 8)])
def test_a_rank_reads_with_at_most_its_share_of_the_nodes_connections(
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    monkeypatch: pytest.MonkeyPatch,
    local_ranks: str,
    most: int,
) -> None:
    """8 ranks on a node with a budget of 16 connections: each reads with at most 2 ranged
    GETs at once (alone on its node: the backend's 8 readers)."""
    from tierckpt.backends.s3 import S3Backend
    from tierckpt.testing.faultproxy import Fault

    bucket = s3_bucket(moto_server)
    monkeypatch.setenv("TIERCKPT_NODE_S3_CONNECTIONS", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    part = 5 << 20
    data = bytes(range(256)) * (16 * part // 256)
    moto_server.admin.put_object(Bucket=bucket, Key="run/big", Body=data)
    # the first ``most`` GETs are held long enough that, however loaded the machine, every
    # reader has issued its GET meanwhile: a share not used shows as fewer in flight, a share
    # exceeded as more (a GET beyond the share starts while the held ones are in flight); the
    # others wait a little, so that those issued together are in flight together
    faults = [
        Fault("delay", method="GET", nth=range(1, most + 1), seconds=3.0),
        Fault("delay", method="GET", seconds=0.2),
    ]
    with FaultProxy(moto_server.endpoint_url, faults) as p:
        b = S3Backend(f"s3://{bucket}/run", endpoint_url=p.endpoint_url, part_size=part)
        try:
            out = bytearray(len(data))
            b.read_into("big", 0, memoryview(out))
        finally:
            b.close()
        assert out == data
        assert p.max_in_flight == most


# -- the LIST-only wait in one process ---------------------------------------------------------


class _Listing(MemoryBackend):
    """Records every ``list_after`` (prefix, start_after) and every GET."""

    def __init__(self) -> None:
        super().__init__(f"listing-{secrets.token_hex(4)}")
        self.lists: list[tuple[str, str]] = []
        self.gets: list[str] = []

    def list_after(self, prefix: str, start_after: str = "") -> list[str]:
        self.lists.append((prefix, start_after))
        return super().list_after(prefix, start_after)

    def get(self, name: str) -> bytes:
        self.gets.append(name)
        return super().get(name)


def _rec(rank: int, world: int, attempt: str, prefixes: int) -> tdist.RankRecord:
    return tdist.RankRecord(
        step=7,
        rank=rank,
        world_size=world,
        attempt=attempt,
        tier="s3",
        file=shard_name(7, rank, prefixes=prefixes),
        size=4160 + rank,
        index_checksum=f"{rank:016x}",
        raw_bytes=4096,
        stored_bytes=4000,
        codec="zstd",
    )


def test_listed_wait_ignores_other_attempts_lists_past_what_it_has_and_gets_nothing() -> None:
    world, prefixes = 12, 4
    b = _Listing()
    for r in range(world):
        write_listed_record(b, _rec(r, world, "old-1", prefixes), prefixes)  # a killed attempt
    for r in range(world - 1):
        write_listed_record(b, _rec(r, world, "new-2", prefixes), prefixes)
    timer = threading.Timer(
        0.3, lambda: write_listed_record(b, _rec(world - 1, world, "new-2", prefixes), prefixes)
    )
    with tdist.knobs(poll_initial=0.02, poll_max=0.05, commit_timeout=30):
        timer.start()
        got = wait_for_listed_records(b, "s3", 7, world, "new-2", prefixes)
    assert [(r.rank, r.attempt, r.size, r.index_checksum) for r in got] == [
        (r, "new-2", 4160 + r, f"{r:016x}") for r in range(world)
    ]
    assert all(r.file == shard_name(7, r.rank, prefixes=prefixes) for r in got)
    assert b.gets == []  # everything came from the names
    # later polls list only the prefix still missing a record, past its ranks seen before
    last_hh = hash_prefix(world - 1, prefixes)
    late = b.lists[-1]
    assert late[0] == f"{last_hh}/steps/000000000007/records/"
    before = [r for r in range(world - 1) if hash_prefix(r, prefixes) == last_hh]
    if before:
        assert late[1] == f"{late[0]}rank-{max(before):06d}.~"
    assert {p for p, _ in b.lists[-2:]} == {late[0]}


def test_listed_wait_stops_at_a_failure_record_of_this_attempt() -> None:
    world, prefixes = 4, 2
    b = _Listing()
    write_listed_record(b, _rec(0, world, "a-1", prefixes), prefixes)
    b.put_atomic(
        listed_failure_name(7, 2, prefixes),
        tdist.encode_failure(7, 2, "a-1", "s3", "disk full"),
        overwrite=True,
    )
    with tdist.knobs(poll_initial=0.02, poll_max=0.05, commit_timeout=30):
        with pytest.raises(RankFailed, match=r"rank\(s\) 2 .*disk full"):
            wait_for_listed_records(b, "s3", 7, world, "a-1", prefixes)
        # a failure of another attempt does not count: the wait times out naming the ranks
        with tdist.knobs(commit_timeout=0.3), pytest.raises(CommitTimeout, match="1, 2, 3"):
            wait_for_listed_records(b, "s3", 7, world, "b-2", prefixes)
