"""The spare node-RAM segment (``tierckpt.peer._spare``): a rank whose node RAM lacks the
newest checkpoint its partner holds a replica of allocates, at setup, a spare segment of the
shard's size; its partner pull receives into it. 3 gloo ranks in real processes, each its
own "node" (``peer_spare_workers``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import peer_workers
import pytest
import torch
from peer_spare_workers import the_spare

pytestmark = [pytest.mark.distributed]

WORLD = 3
W = "peer_spare_workers:"


def _save(shm: Path, disk: Path) -> int:
    """Steps 1 and 2 saved on every node, replicas included; the size of a shard."""
    res = peer_workers.run(W + "w_save", WORLD, shm=str(shm), disk=str(disk))
    assert all(r["rounds"] == 2 for r in res)
    return int(res[1]["shard"])


def _lose(shm: Path, disk: Path | None, rank: int = 1) -> None:
    shutil.rmtree(shm / f"node-{rank}")
    if disk is not None:
        shutil.rmtree(disk / f"node-{rank}")


def _load(shm: Path, disk: Path, **kw: Any) -> list[Any]:
    return list(peer_workers.run(W + "w_load", WORLD, shm=str(shm), disk=str(disk), **kw))


def test_the_workers_know_where_the_spare_is(shm: Path) -> None:
    from tierckpt.peer._spare import spare_path

    assert the_spare(str(shm), 1) == spare_path(str(shm / "node-1" / "job.replicas"), 1)


def test_a_lost_node_pulls_into_its_spare_and_restores_bit_exact(shm: Path, tmp_path: Path) -> None:
    shard = _save(shm, tmp_path)
    _lose(shm, tmp_path)
    res = _load(shm, tmp_path)
    for rank, r in enumerate(res):
        assert r["step"] == 2 and r["diff"] == [], rank
        assert r["calls"]["local"] == 0, rank
    assert res[1]["sources"] == ["noderam", "peer:2", "noderam"]
    sp = res[1]["spare"]
    # setup allocated a spare of the shard's size, counted in the node-RAM budget, and
    # not a checkpoint
    assert sp is not None and sp["size"] == shard
    assert sp["allocated"] >= shard and sp["usage"] >= shard
    assert res[1]["steps_before"]["noderam"] == []
    # the pull received into it: the committed shard is the spare's file (its inode)
    assert sp["ino"] in res[1]["shard_inodes"]
    assert not res[1]["spare_exists_after"] and res[1]["tmp_files"] == []
    # the ranks that restore from their own node RAM made none
    assert res[0]["spare"] is None and res[2]["spare"] is None


def test_a_rank_with_its_own_copy_removes_a_stale_spare_and_reuses_its_own(
    shm: Path, tmp_path: Path
) -> None:
    _save(shm, tmp_path)
    stale = the_spare(str(shm), 0)  # rank 0 needs none: its node RAM has step 2
    os.makedirs(os.path.dirname(stale))
    Path(stale).write_bytes(b"x" * 100_000)
    _lose(shm, tmp_path)
    mine = the_spare(str(shm), 1)  # a crashed predecessor's spare of rank 1
    os.makedirs(os.path.dirname(mine))
    Path(mine).write_bytes(b"y" * 4096)
    ino = os.stat(mine).st_ino
    res = _load(shm, tmp_path)
    assert res[0]["spare"] is None and not res[0]["spare_exists_before"]
    assert not os.path.exists(stale)
    assert res[1]["spare"]["ino"] == ino  # reused, grown to the shard's size
    assert res[1]["diff"] == [] and res[1]["sources"][1] == "peer:2"


def test_the_spare_stays_inside_the_budget(shm: Path, tmp_path: Path) -> None:
    shard = _save(shm, tmp_path)
    # no room for the shard: no spare is made (the budget holds), the pull is declined and
    # the shard comes from the local disk
    _lose(shm, None)
    res = _load(shm, tmp_path, max_bytes=shard // 2)
    assert res[1]["spare"] is None and not res[1]["spare_exists_before"]
    assert any("no spare segment" in w for w in res[1]["warnings"])
    assert res[1]["diff"] == [] and res[1]["pulled"] == 0 and res[1]["calls"]["local"] > 0
    assert res[1]["usage"] <= res[1]["max_bytes"]
    # room for one shard (+ leases): the spare fits, and the pull into it is not counted
    # twice (it becomes the file)
    _lose(shm, tmp_path)
    res = _load(shm, tmp_path, max_bytes=shard + shard // 2)
    assert res[1]["spare"] is not None and res[1]["sources"][1] == "peer:2"
    assert res[1]["diff"] == [] and res[1]["usage"] <= res[1]["max_bytes"]


def test_a_pull_killed_midway_leaves_nothing_a_later_load_trusts(shm: Path, tmp_path: Path) -> None:
    _save(shm, tmp_path)
    _lose(shm, tmp_path)
    res = peer_workers.run(
        W + "w_pull_killed", WORLD, shm=str(shm), disk=str(tmp_path), expect_killed=(1,)
    )
    assert res[1] is None
    ram = shm / "node-1" / "job"
    # the spare was taken: it is a temporary file now, named by no manifest
    assert not os.path.exists(the_spare(str(shm), 1))
    assert list(ram.rglob("*.tmp")) and not list(ram.rglob("manifests/*"))
    res = _load(shm, tmp_path)
    assert res[1]["step"] == 2 and res[1]["diff"] == []
    assert res[1]["sources"] == ["noderam", "peer:2", "noderam"]


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_a_spare_taken_for_another_size_becomes_a_file_of_that_size(
    shm: Path, factor: float
) -> None:
    """The agreed checkpoint may not be the one the spare was sized for: the file taken is
    cut or grown to the pull's size, and every byte written through the map lands in it."""
    from tierckpt.peer._spare import SpareSegment

    spare = SpareSegment(str(shm / "spare" / "rank-000001.seg"), 1 << 20)
    spare.start()
    size = int((1 << 20) * factor)
    dest = str(shm / "pulled.tmp")
    taken = spare.take(dest, size)
    assert taken is not None and spare.error is None
    fd, mm, t = taken
    t.copy_(torch.arange(size, dtype=torch.int64).to(torch.uint8))
    del t
    mm.close()
    os.close(fd)
    spare.discard()  # after a take: removes nothing more
    assert not os.path.exists(spare.path)
    data = Path(dest).read_bytes()
    assert len(data) == size and data == bytes(i % 256 for i in range(size))
