"""Nothing a killed partner pull or replica receive leaves in node RAM outlives the restarted
job's first save: a temporary file there is the node's memory, held until someone removes it.
3 gloo ranks in real processes, each its own "node" (``peer_leftover_workers``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import peer_workers
import pytest
from peer_leftover_workers import leftovers

pytestmark = [pytest.mark.distributed]

WORLD = 3
S = "peer_spare_workers:"
W = "peer_leftover_workers:"


def _save(shm: Path, disk: Path) -> int:
    """Steps 1 and 2 saved on every node, replicas included; the size of a shard."""
    res = peer_workers.run(S + "w_save", WORLD, shm=str(shm), disk=str(disk))
    assert all(r["rounds"] == 2 for r in res)
    return int(res[1]["shard"])


def _killed_pull(shm: Path, disk: Path) -> None:
    """Node 1 lost; its replacement is killed while its partner pull is arriving."""
    shutil.rmtree(shm / "node-1")
    shutil.rmtree(disk / "node-1")
    peer_workers.run(S + "w_pull_killed", WORLD, shm=str(shm), disk=str(disk), expect_killed=(1,))
    assert leftovers(str(shm), 1), "the killed pull left no temporary file: nothing to test"


def test_a_pull_killed_midway_is_removed_by_the_restarted_jobs_first_save(
    shm: Path, tmp_path: Path
) -> None:
    _save(shm, tmp_path)
    _killed_pull(shm, tmp_path)
    res = peer_workers.run(
        W + "w_load_and_save", WORLD, shm=str(shm), disk=str(tmp_path), extra_saves=3
    )
    assert res[1]["before"] and res[1]["diff"] == []
    # gone at the restarted pull, not only once retention deletes the checkpoint it sits in
    assert [r["after_first"] for r in res] == [[], [], []]
    assert [r["after"] for r in res] == [[], [], []]


def test_a_replica_receive_killed_midway_is_removed_by_the_restarted_jobs_first_save(
    shm: Path, tmp_path: Path
) -> None:
    _save(shm, tmp_path)
    peer_workers.run(
        W + "w_save_receiver_killed", WORLD, shm=str(shm), disk=str(tmp_path), expect_killed=(2,)
    )
    left = leftovers(str(shm), 2)
    assert left, "the killed receive left no temporary file: nothing to test"
    res = peer_workers.run(W + "w_load_and_save", WORLD, shm=str(shm), disk=str(tmp_path))
    assert res[2]["before"] == left
    assert [r["after"] for r in res] == [[], [], []]


def test_a_pull_killed_midway_does_not_take_the_next_pulls_budget(
    shm: Path, tmp_path: Path
) -> None:
    """Node RAM with room for one shard and a half: the dead pull's file (a whole shard)
    would leave no room for the next pull, which would then be declined (and with the node's
    disk lost, the shard would be read from nowhere)."""
    shard = _save(shm, tmp_path)
    _killed_pull(shm, tmp_path)
    res = peer_workers.run(
        W + "w_load_and_save",
        WORLD,
        shm=str(shm),
        disk=str(tmp_path),
        max_bytes=shard + shard // 2,
        save=False,  # a save needs room for keep_last + 1 checkpoints: not this budget
    )
    assert res[1]["sources"][1] == "peer:2" and res[1]["diff"] == []
    assert [r["after"] for r in res] == [[], [], []]


def test_a_load_from_node_ram_first_makes_no_node_groups(shm: Path, tmp_path: Path) -> None:
    """Node groups share the manifests of shared tiers listed before any private one; with
    node RAM first there are none, so the restart's critical path has no collectives for
    them (checked here, with the peer tests' setup, rather than in a test of its own)."""
    _save(shm, tmp_path)
    res = peer_workers.run(W + "w_load_node_groups", WORLD, shm=str(shm), disk=str(tmp_path))
    assert [r["diff"] for r in res] == [[], [], []]
    assert [r["node_groups"] for r in res] == [False, False, False]


@pytest.mark.parametrize("first", ["load_local", "save"])
def test_a_spare_nobody_pulls_into_is_given_back_at_the_first_load_or_save(
    shm: Path, tmp_path: Path, first: str
) -> None:
    """Node 1 lost its RAM (not its disk): its restart allocates a spare segment for a pull,
    then loads from its local disk by name, or saves without loading: the spare, a shard of
    node RAM counted in the budget, goes then, not at close()."""
    _save(shm, tmp_path)
    shutil.rmtree(shm / "node-1")
    res = peer_workers.run(
        W + "w_spare_released", WORLD, shm=str(shm), disk=str(tmp_path), first=first
    )
    assert res[1]["had_spare"] and res[1]["spare_file_before"]
    assert not res[1]["spare_file_after"] and not res[1]["spare_after"]
    if first == "load_local":
        assert [r["diff"] for r in res] == [[], [], []]
