"""PeerTier after a failed commit, with 4 gloo ranks in real processes (each its own "node").

A save whose node-RAM copy fails on one rank must leave no replica of that rank's shard of
the failed step anywhere, and replication must stay in step: every rank runs one round per
node-RAM save, committed or not, so the next step's round pairs every rank with its partners
again (before the fix, a rank whose commit failed skipped its round, so its partners' rounds
paired with the wrong ones and waited out their timeout: replication broke for the run).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import peer_workers
import pytest

WORLD = 4
VICTIM = 1


def _run(fn: str, **kw: object) -> list[dict[str, object]]:
    return peer_workers.run(f"peer_fault_workers:{fn}", WORLD, timeout=240, **kw)


@pytest.mark.distributed
def test_shard_failure_on_one_rank_makes_no_replica_and_the_next_step_replicates(
    shm: Path, tmp_path: Path
) -> None:
    """The victim cannot write its step-2 shard to node RAM: step 2 commits nowhere in node
    RAM, so no rank holds a replica of step 2; step 3 replicates everywhere."""
    res = _run("w_failed_step", shm=shm, disk=str(tmp_path), how="shard", victim=VICTIM)
    for rank, r in enumerate(res):
        assert r["error2"] is not None and "noderam" in r["error2"], (rank, r)
        assert r["noderam"] == [1, 3], (rank, r)
        assert r["idle"] and r["broken"] is None, (rank, r)
        # ring: rank r keeps the replicas of rank r-1
        assert r["replicas"] == {str((rank - 1) % WORLD): [1, 3]}, (rank, r)


@pytest.mark.distributed
def test_manifest_failure_on_one_node_keeps_replication_in_step(shm: Path, tmp_path: Path) -> None:
    """The victim's node cannot write step 2's manifest after rank 0 assembled it: the other
    nodes commit step 2, the victim's does not. Its partner gets no replica of its step 2
    (the victim's shard is not committed anywhere), the others' step 2 is replicated, and
    step 3 replicates on every rank: no round waits out its timeout. A node lost afterwards
    restores step 3 from its partner."""
    res = _run("w_failed_step", shm=shm, disk=str(tmp_path), how="manifest", victim=VICTIM)
    for rank, r in enumerate(res):
        assert r["idle"] and r["broken"] is None, (rank, r)
        assert r["rounds"] == 3, (rank, r)
        src = (rank - 1) % WORLD
        want = [1, 3] if src == VICTIM else [1, 2, 3]
        assert r["replicas"] == {str(src): want}, (rank, r)
        assert r["noderam"] == ([1, 3] if rank == VICTIM else [1, 2, 3]), (rank, r)
        if rank == VICTIM:
            assert r["error2"] is not None and "noderam" in r["error2"], r
        else:
            assert r["error2"] is None, (rank, r)
    # the victim's node is lost: its replacement pulls step 3 from its partner's RAM
    shutil.rmtree(os.path.join(shm, f"node-{VICTIM}"))
    shutil.rmtree(tmp_path / f"node-{VICTIM}")
    loads = _run("w_load_step3", shm=shm, disk=str(tmp_path))
    for rank, r in enumerate(loads):
        assert r["step"] == 3 and r["diff"] == [], (rank, r)
        assert r["sources"] == ["noderam", f"peer:{VICTIM + 1}", "noderam", "noderam"]
        assert r["calls"]["local"] == 0, (rank, r)
