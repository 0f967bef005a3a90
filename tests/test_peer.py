"""PeerTier: replicas of each rank's node-RAM shard in a partner node's RAM, and restores after
each kind of failure, with 4 gloo ranks in real processes (each its own "node": its own
shared-memory and disk folders, see ``peer_workers``).

Reads are counted per tier in the restarted ranks: a restore from node RAM reads nothing from
the local disk or S3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import peer_workers
import pytest

from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier, TierPolicy
from tierckpt.peer import Placement, ring_placement

WORLD = 4


@pytest.fixture
def s3(moto_server: Any, s3_bucket: Callable[[Any], str]) -> dict[str, str]:
    return {"bucket": s3_bucket(moto_server), "endpoint": moto_server.endpoint_url}


def _wipe_node(shm: Path, disk: Path, rank: int) -> None:
    """The node is lost: its replacement starts with empty memory and an empty disk."""
    shutil.rmtree(os.path.join(shm, f"node-{rank}"))
    shutil.rmtree(disk / f"node-{rank}")


def _restart(shm: Path, disk: Path, s3: dict[str, str], lost: tuple[int, ...] = ()) -> list[Any]:
    """Save steps 1 and 2 (rank 1 SIGKILLed after), lose the nodes ``lost`` (memory and disk
    wiped), then restart every rank as torchrun would: each one's load result."""
    _save_then_kill(shm, disk, s3)
    for rank in lost:
        _wipe_node(shm, disk, rank)
    return list(peer_workers.run("w_load", WORLD, shm=shm, disk=str(disk), s3=s3))


def _save_then_kill(shm: Path, disk: Path, s3: dict[str, str], victim: int = 1) -> None:
    res = peer_workers.run(
        "w_save",
        WORLD,
        shm=shm,
        disk=str(disk),
        s3=s3,
        victim=victim,
        expect_killed=(victim,),
    )
    for r in res:
        if r is not None:
            assert r["steps"]["noderam"] == [1, 2] and r["steps"]["local"] == [1, 2]
            assert r["rounds"] == 2 and r["received"] > 0  # one replica per step
    # each rank's partner (the next node) holds its step-2 shard in RAM
    for r in range(WORLD):
        holder = (r + 1) % WORLD
        replica = Path(shm, f"node-{holder}", f"job.replicas/rank-{r:06d}")
        assert (replica / "manifests").is_dir() and list(replica.rglob("rank-*.tck"))


# -- pure placement ---------------------------------------------------------------------------


def test_ring_places_replicas_on_the_next_nodes() -> None:
    # 3 nodes of 2 ranks: the same local rank of the next node, then the one after
    keys = [7, 7, 9, 9, 5, 5]
    p = ring_placement(keys, 1)
    assert p.partners == ((2,), (3,), (4,), (5,), (0,), (1,))
    assert p.sources(0) == [4]
    p2 = ring_placement(keys, 2)
    assert p2.partners[0] == (2, 4) and p2.max_sources() == 2
    # one node: no partner at all (a replica on the same node survives nothing more)
    assert ring_placement([1, 1, 1], 1).partners == ((), (), ())
    with pytest.raises(ValueError, match="not another rank"):
        Placement.fixed([[0], [0]], 2)


def test_peer_tier_needs_a_node_ram_tier_and_is_left_out_of_the_pipeline(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="list a NodeRamTier before it"):
        Checkpointer([LocalTier(tmp_path / "d"), PeerTier()], rank=0, world_size=2)
    with pytest.raises(ValueError, match="replicas must be an int >= 1"):
        PeerTier(replicas=0)
    with pytest.raises(TypeError, match="no backend of its own"):
        PeerTier().make_backend()
    # a job of one process: nobody to copy to; the policy still works
    with Checkpointer(
        TierPolicy([NodeRamTier(path=tmp_path / "shm", namespace="one"), PeerTier()])
    ) as ck:
        assert ck.tier_names == ["noderam"] and ck._peer is None


# -- failures, 4 ranks ------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.s3
def test_killed_rank_restart_restores_every_rank_from_node_ram(
    shm: Path, tmp_path: Path, s3: dict[str, str]
) -> None:
    res = _restart(shm, tmp_path, s3)
    for r in res:
        assert r["step"] == 2 and r["diff"] == []
        assert r["sources"] == ["noderam"] * WORLD
        assert r["calls"]["local"] == 0 and r["calls"]["s3"] == 0  # nothing from disk or S3
        assert r["bytes"]["noderam"] > 0 and r["pulled"] == 0
        assert r["steps_after"]["noderam"] == [2, 3]


@pytest.mark.distributed
@pytest.mark.s3
def test_lost_node_restores_its_shard_from_its_partner(
    shm: Path, tmp_path: Path, s3: dict[str, str]
) -> None:
    res = _restart(shm, tmp_path, s3, lost=(1,))
    for rank, r in enumerate(res):
        assert r["step"] == 2 and r["diff"] == [], rank
        assert r["sources"] == ["noderam", "peer:2", "noderam", "noderam"]
        assert r["calls"]["local"] == 0 and r["calls"]["s3"] == 0, rank
        assert r["bytes"]["noderam"] > 0
    assert res[1]["pulled"] > 0
    assert any("pulled" in w and "partner rank 2" in w for w in res[1]["warnings"])
    # the replacement's node RAM holds the pulled checkpoint, and saves go on there
    assert res[1]["steps_after"]["noderam"] == [2, 3]


@pytest.mark.distributed
@pytest.mark.s3
def test_two_lost_partners_fall_back_to_s3_and_say_so(
    shm: Path, tmp_path: Path, s3: dict[str, str]
) -> None:
    res = _restart(shm, tmp_path, s3, lost=(1, 2))  # 2: rank 1's partner, its replica gone too
    for rank, r in enumerate(res):
        assert r["step"] == 2 and r["diff"] == [], rank
        assert r["sources"] == ["noderam", "s3", "peer:3", "noderam"]
        assert r["calls"]["local"] == 0, rank
    assert res[1]["calls"]["s3"] > 0
    for rank in (0, 2, 3):
        assert res[rank]["calls"]["s3"] == 0
    assert any("falling back to tier 's3'" in w for w in res[1]["warnings"])


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_recovery_benchmark_quick_mode_prints_its_table(tmp_path: Path) -> None:
    """``benchmarks/bench_recovery.py --quick``: every failure kind restored, bit-exact (the
    bench checks each restore), the sources named, the baselines measured."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "bench_recovery.py"),
            "--quick",
            "--json",
            str(out),
        ],
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| process crash | NodeRamTier" in proc.stdout
    # the local disk both cold (evicted, checked with mincore) and warm
    assert "| all RAM lost, cold | LocalTier" in proc.stdout
    assert "| all RAM lost, warm | LocalTier" in proc.stdout
    s = json.loads(out.read_text())
    assert s["crash_sources"] == ["noderam", "noderam"]
    assert s["node_lost_sources"] == ["noderam", "peer:0"]
    assert s["memcpy_gbps"] > 0 and s["loopback_gbps"] > 0
    # the pull against the loopback like for like: alone, and a send into fresh node RAM too
    assert s["pull_alone_gbps"] > 0 and s["pull_gbps"] > 0 and s["loopback_fresh_gbps"] > 0
    assert "partner pull alone (the other ranks idle" in proc.stdout
    for k in ("node_ram_vs_local", "node_ram_vs_local_warm", "pull_spare_vs_loopback"):
        assert s["ratios"][k]["med"] > 0 and s["ratios"][k]["min"] > 0, k
    # every try kept, baselines in the same rounds as the contenders (median and fastest)
    assert len(s["tries"]["memcpy_tries"]) == len(s["tries"]["crash_tries"]) == 2
    assert len(s["tries"]["loopback_tries"]) == 4 and s["spare_alloc_s"]["med"] > 0
    assert "targets judged on the medians" in proc.stdout
    # the mapped restore also timed to the end of a read of every byte, and the copying read
    assert "| process crash, node RAM copied | NodeRamTier(map=False)" in proc.stdout
    for row in s["rows"].values():
        assert row["touch_seconds"]["min"] >= row["seconds"]["min"] > 0, row
    cold = s["cache_state"]["rank 0"]["cold"]
    assert cold and all(c.startswith(("fadvise", "drop_caches")) for c in cold), cold
