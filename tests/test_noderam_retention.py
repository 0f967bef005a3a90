"""Retention rules beyond keep_last (keep_every_n_steps, keep_best) on NodeRamTier and on the
replicas PeerTier keeps in partners' node RAM; decided from what is stored, so a restarted
job (a new Checkpointer, a new process) keeps the same checkpoints."""

from __future__ import annotations

import os
from pathlib import Path

import peer_workers
import pytest
import torch

from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier


def _save(ck: Checkpointer, step: int, loss: float | None = None) -> None:
    metrics = {"loss": loss} if loss is not None else None
    ck.save({"w": torch.full((64,), float(step))}, step, metrics=metrics).wait(timeout=60)


def test_node_ram_keep_every_n_steps_across_restarts(shm: Path) -> None:
    tier = NodeRamTier(path=shm, namespace="run", keep_last=1, keep_every_n_steps=3)
    with Checkpointer([tier]) as ck:
        for s in range(1, 5):
            _save(ck, s)
        assert ck.steps() == [3, 4]
    with Checkpointer([tier]) as ck:  # a restarted worker: the rule comes from the manifests
        for s in range(5, 8):
            _save(ck, s)
        assert ck.steps() == [3, 6, 7]


def test_node_ram_keep_best_by_metric(shm: Path, tmp_path: Path) -> None:
    tiers = [
        NodeRamTier(path=shm, namespace="run", keep_last=1, keep_best=1, best_metric="loss"),
        LocalTier(tmp_path, keep_last=None),
    ]
    with Checkpointer(tiers) as ck:
        for s, loss in {1: 5.0, 2: 1.0, 3: 4.0}.items():
            _save(ck, s, loss)
        assert ck.tier_steps() == {"noderam": [2, 3], "local": [1, 2, 3]}
    with Checkpointer(tiers) as ck:
        _save(ck, 4, 0.5)
        _save(ck, 5)  # no metric: kept as the newest only
        assert ck.steps("noderam") == [4, 5]
    # max mode, on another run's folder
    with Checkpointer(
        [
            NodeRamTier(
                path=shm,
                namespace="acc",
                keep_last=1,
                keep_best=2,
                best_metric="acc",
                best_mode="max",
            )
        ]
    ) as ck:
        for s, acc in [(1, 0.5), (2, 0.9), (3, 0.7), (4, 0.8), (5, 0.1)]:
            ck.save({"w": torch.ones(4)}, s, metrics={"acc": acc}).wait(timeout=60)
        assert ck.steps() == [2, 4, 5]


def test_retention_rules_are_checked_on_node_ram_and_peer_tiers(shm: Path) -> None:
    with pytest.raises(ValueError, match="tier 'noderam'.*keep_best needs best_metric"):
        NodeRamTier(path=shm, keep_best=1)
    with pytest.raises(ValueError, match="tier 'peer'.*keep_every_n_steps"):
        PeerTier(keep_every_n_steps=0)
    with pytest.raises(ValueError, match="best_mode"):
        PeerTier(keep_best=1, best_metric="loss", best_mode="lowest")  # type: ignore[arg-type]
    spec = PeerTier(keep_last=1, keep_every_n_steps=10, keep_best=2, best_metric="loss")
    rule = spec.retention
    assert (rule.keep_last, rule.keep_every_n_steps, rule.keep_best) == (1, 10, 2)


@pytest.mark.distributed
def test_peer_replicas_keep_every_n_steps_and_the_best(shm: Path) -> None:
    """2 ranks, each its own node: each keeps its partner's replicas by the PeerTier's rules
    (keep_last=1, every 2nd step, the best by loss), also after a restart."""
    losses = {"1": 3.0, "2": 9.0, "3": 0.5, "4": 8.0, "5": 7.0}
    kw = {"keep_last": 1, "keep_every_n_steps": 2, "keep_best": 1, "best_metric": "loss"}
    res = peer_workers.run(
        "peer_retention_workers:w_replica_retention",
        2,
        shm=str(shm),
        peer_kw=kw,
        losses=losses,
    )
    for r in res:
        # 2, 4: multiples of 2; 3: the best loss; 5: the newest
        assert r["first"] == [2, 3, 4, 5], r
        # step 6 (loss 99) is newest and a multiple of 2; 5 goes; 3 stays the best
        assert r["after_restart"] == [2, 3, 4, 6], r
    assert os.path.isdir(shm / "node-0" / "job.replicas")
