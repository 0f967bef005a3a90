"""The private-tier commit (RAM, node RAM, node-local disks) through one store per node: rank
0's store sees one item per node, not one set per rank (docs/scale.md), and a failure on any
node still aborts the commit on every rank. Real gloo processes on simulated nodes
(``TIERCKPT_NODE`` per rank); the workers are in tests/private_commit_workers.py."""

from __future__ import annotations

from pathlib import Path

import dist_workers
import pytest


@pytest.mark.distributed
def test_private_records_reach_rank0s_store_as_one_item_per_node() -> None:
    """2 nodes x 2 ranks save to a RAM tier. On rank 0's store: one item per node (2 sets)
    plus the manifest (1 set), which only the other node's leader GETs; rank 0 waits on 2
    keys, not 4; the non-leaders wait on their node's store, not on rank 0's."""
    res = dist_workers.run("private_commit_workers:w_private_store_ops", 4, per_node=2, timeout=150)
    for r in res:
        assert r["steps"] == [1, 2] and r["diff"] == []
    calls = [r["calls"] for r in res]
    total = sum(c.get("set", 0) for c in calls)
    assert total == 2 + 1, calls  # the original: one record per rank + the manifest = 5
    assert sum(c.get("get", 0) for c in calls) == 1, calls  # rank 2 fetches it for node 1
    assert res[0]["checked"] and max(res[0]["checked"]) <= 2, res[0]  # N_nodes keys
    for rank in (1, 3):  # non-leaders: at most the forward of their node's records
        assert set(calls[rank]) <= {"set"} and calls[rank].get("set", 0) <= 1, calls[rank]


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [3, 2])
def test_a_failure_on_one_node_aborts_the_private_commit_on_every_node(
    tmp_path: Path, victim: int
) -> None:
    """2 nodes x 2 ranks; rank 3 (a non-leader of node 1) or rank 2 (its leader) fails at
    step 2 on the RAM tier and a shared local one: every rank of both nodes hears of it
    within seconds (the commit timeout is 120 s), nothing is committed, step 3 commits."""
    res = dist_workers.run(
        "private_commit_workers:w_private_fail_on_node",
        4,
        root=str(tmp_path),
        victim=victim,
        per_node=2,
        timeout=200,
    )
    for rank, r in enumerate(res):
        assert r["seconds"] < 60, r  # not the 120 s commit timeout
        assert r["manifest2"] is False
        assert r["steps"] == [1, 3] and r["diff3"] == []
        if rank == victim:
            assert r["error_types"] == {"local": "OSError", "memory": "OSError"}
        else:
            assert r["error_types"]["memory"] == "RankFailed", (rank, r)
            assert f"rank {victim}: OSError" in r["messages"]["memory"], (rank, r)
    assert res[0]["error_types"] == {"local": "RankFailed", "memory": "RankFailed"}


def test_simulated_32_ranks_put_one_item_per_node_into_rank0s_store() -> None:
    """The bench's simulation (real TCPStore servers, ranks as threads, the real commit
    functions) at a small size: 4 nodes of 8 against every rank its own node (the protocol
    before node stores)."""
    from tierckpt.bench.private_scale import run_private_scale

    flat = run_private_scale(ranks=32, layout="flat", spread_s=0.1)
    nodes = run_private_scale(ranks=32, layout="per_node", ranks_per_node=8, spread_s=0.1)
    assert flat.global_ops["set"] == 32 + 1 and flat.widest_check == 32
    assert flat.global_ops["get"] == 31  # every other rank fetched the manifest
    assert nodes.nodes == 4
    assert nodes.global_ops["set"] == 4 + 1 and nodes.widest_check == 4
    assert nodes.global_ops["get"] == 3  # the other nodes' leaders
    assert nodes.global_bytes_out < flat.global_bytes_out / 4


@pytest.mark.distributed
@pytest.mark.parametrize("victim", [3, 2])
def test_a_rank_killed_on_one_node_leaves_the_private_tier_uncommitted(
    tmp_path: Path, victim: int
) -> None:
    """2 nodes x 2 ranks; rank 3 (a non-leader) or rank 2 (node 1's leader, whose process
    hosts node 1's store) dies at step 2: rank 0 times out naming node 1's ranks (or hears
    from rank 3 that node 1's store is gone), every survivor's save fails on the RAM tier, and
    step 1 stays the newest everywhere."""
    res = dist_workers.run(
        "private_commit_workers:w_private_kill",
        4,
        root=str(tmp_path),
        victim=victim,
        per_node=2,
        expect_killed=(victim,),
        timeout=150,
    )
    for rank, r in enumerate(res):
        if rank == victim:
            continue
        assert r["error"] is not None and "memory" in r["error_types"], (rank, r)
        assert r["steps"] == [1], (rank, r)
    if victim == 3:
        assert res[0]["error_types"] == {"memory": "CommitTimeout"}
        assert "none from ranks 2, 3 (of 4" in res[0]["error"]
    else:  # node 1's store went with its leader: rank 3 says so, to rank 0 too if in time
        assert "the store of node 1" in res[3]["error"], res[3]
        assert res[0]["error_types"]["memory"] in ("CommitTimeout", "RankFailed")
        assert "the store of node 1" in res[0]["error"] or "none from ranks 2, 3" in res[0]["error"]
