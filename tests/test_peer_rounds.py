"""PeerTier replicas follow what the source's node RAM keeps (pins, keep_best), and a save()
that raises on one rank before the pipeline keeps the replication rounds paired; gloo ranks in
real processes, each its own "node" (``peer_workers``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import peer_workers
import pytest

VICTIM = 1


@pytest.mark.distributed
def test_pinned_and_best_steps_are_kept_on_the_partners_replicas(shm: Path) -> None:
    """2 ranks, each its own node. Node RAM keeps its newest, the best by loss (step 2) and
    the pinned steps (1 and 3); the partner's replicas (PeerTier keep_last=1) must keep the
    same, and let step 3 go once it is unpinned. Then node 1 is lost: its pinned step 1 is
    restored from its partner's RAM."""
    res = peer_workers.run("peer_round_workers:w_pins", 2, timeout=240, shm=shm)
    for rank, r in enumerate(res):
        src = str(1 - rank)
        assert r["broken"] is None, (rank, r)
        assert r["noderam4"] == [1, 2, 3, 4], (rank, r)
        assert r["replicas4"] == {src: [1, 2, 3, 4]}, (rank, r)  # before: {src: [4]}
        assert r["noderam5"] == [1, 2, 5], (rank, r)
        assert r["replicas5"] == {src: [1, 2, 5]}, (rank, r)  # the unpin reached them
    shutil.rmtree(os.path.join(shm, f"node-{VICTIM}"))  # node lost: its RAM and replicas
    loads = peer_workers.run("peer_round_workers:w_load_pinned", 2, timeout=240, shm=shm, step=1)
    for rank, r in enumerate(loads):
        assert r["step"] == 1 and r["diff"] == [], (rank, r)
        assert r["sources"] == ["noderam", "peer:0"], (rank, r)


@pytest.mark.distributed
def test_a_save_that_raises_on_one_rank_keeps_the_rounds_paired(shm: Path, tmp_path: Path) -> None:
    """4 ranks: the victim's save() of step 2 raises (its state holds an object tierckpt
    cannot store) before the pipeline; the job goes on. Step 2 commits nowhere (the others
    are told at once, not after their commit timeout), every rank runs three rounds, none
    waits out its timeout, step 3 replicates everywhere, and a node lost afterwards restores
    step 3 from its partner (before: the victim ran two rounds, the others three, so the
    third round of the victim's partners waited for it and replication broke for the run)."""
    world = 4
    res = peer_workers.run(
        "peer_round_workers:w_save_raises",
        world,
        timeout=240,
        shm=shm,
        disk=str(tmp_path),
        victim=VICTIM,
    )
    for rank, r in enumerate(res):
        if rank == VICTIM:
            assert r["raised2"] == "UnsupportedObject", r
            assert r["failed_events"] == ["local", "noderam"], r
        else:
            assert r["error2"] is not None and "noderam" in r["error2"], (rank, r)
            assert r["seconds2"] < 45, (rank, r)  # told, not the 60 s commit timeout
        assert r["idle"] and r["broken"] is None, (rank, r)
        assert r["rounds"] == 3, (rank, r)
        assert r["noderam"] == [1, 3], (rank, r)
        assert r["replicas"] == {str((rank - 1) % world): [1, 3]}, (rank, r)
    shutil.rmtree(os.path.join(shm, f"node-{VICTIM}"))
    shutil.rmtree(tmp_path / f"node-{VICTIM}")
    loads = peer_workers.run(
        "peer_fault_workers:w_load_step3", world, timeout=240, shm=shm, disk=str(tmp_path)
    )
    for rank, r in enumerate(loads):
        assert r["step"] == 3 and r["diff"] == [], (rank, r)
        assert r["sources"] == ["noderam", f"peer:{VICTIM + 1}", "noderam", "noderam"]
        assert r["calls"]["local"] == 0, (rank, r)


@pytest.mark.distributed
def test_node_ram_that_cannot_tell_what_it_keeps_is_said_once_per_outage(shm: Path) -> None:
    """2 ranks; each rank's node RAM cannot list its pins during the rounds of steps 2, 3
    and 5. Each such round said so with a WARNING; now the first of each outage does (the
    next at DEBUG), and the round after it says at INFO that node RAM tells again."""
    res = peer_workers.run("peer_round_workers:w_kept_unknown", 2, timeout=240, shm=shm)
    for rank, r in enumerate(res):
        assert r["broken"] is None and r["rounds"] == 5, (rank, r)
        assert r["said"] == ["WARNING", "DEBUG", "INFO", "WARNING"], (rank, r)
