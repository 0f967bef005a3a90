"""Per-rank functions of ``test_noderam_retention.py``, run by :func:`peer_workers.run` as
``"peer_retention_workers:<function>"`` (each rank its own "node", as in ``peer_workers``)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state

from tierckpt import Checkpointer, NodeRamTier, PeerTier
from tierckpt.catalog import committed_steps


def w_replica_retention(
    rank: int, world: int, shm: str, peer_kw: dict[str, Any], losses: dict[str, float]
) -> dict[str, Any]:
    """Save the steps of ``losses`` (each with its loss as a metric) with a PeerTier of
    ``peer_kw``; then a new Checkpointer (a restarted job) saves one more step. Returns, per
    phase, the steps whose replica this rank keeps for its source rank."""
    tiers = [
        NodeRamTier(path=os.path.join(shm, f"node-{rank}"), namespace="job", keep_last=None),
        PeerTier(replicas=1, timeout_s=60, **peer_kw),
    ]
    out: dict[str, Any] = {}
    ck = Checkpointer(tiers, chunk_bytes=64 << 10)
    assert ck._peer is not None
    (src,) = ck._peer.placement.sources(rank)
    for step, loss in sorted((int(s), v) for s, v in losses.items()):
        ck.save(rank_state(rank, step, 256), step, metrics={"loss": loss}).wait(timeout=60)
    assert ck._peer.wait_idle(60)
    out["first"] = committed_steps(ck._peer.replica_backend(src))
    dist.barrier()
    ck.close()
    # a restarted job: what it keeps is decided from the replicated manifests alone
    ck = Checkpointer(tiers, chunk_bytes=64 << 10)
    assert ck._peer is not None
    nxt = max(int(s) for s in losses) + 1
    ck.save(rank_state(rank, nxt, 256), nxt, metrics={"loss": 99.0}).wait(timeout=60)
    assert ck._peer.wait_idle(60)
    out["after_restart"] = committed_steps(ck._peer.replica_backend(src))
    dist.barrier()
    ck.close()
    return out
