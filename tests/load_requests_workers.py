"""Per-rank functions of tests/test_load_requests.py (launched by ``peer_workers.run``)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same
from peer_workers import NUMEL, node_tiers

from tierckpt import Checkpointer
from tierckpt import distributed as tdist


def w_lists_per_load(
    rank: int, world: int, shm: str, disk: str, s3: dict[str, str]
) -> dict[str, Any]:
    """The node-RAM recipe (node RAM, peer, local, S3): save steps 1 and 2, then a restarted
    job's load, counting each tier's listings (``list`` on its backend) during the load."""
    with Checkpointer(node_tiers(rank, shm, disk, s3), chunk_bytes=64 << 10) as ck:
        for step in (1, 2):
            ck.save(rank_state(rank, step, NUMEL), step).wait(timeout=60)
        tdist.wait_committed(ck.backend("s3"), 2, timeout=60)
        assert ck._peer is not None and ck._peer.wait_idle(60)
        dist.barrier()
    ck = Checkpointer(node_tiers(rank, shm, disk, s3), chunk_bytes=64 << 10)
    calls = {name: 0 for name in ck.tier_names}
    for name in ck.tier_names:
        backend = ck.backend(name)
        real = backend.list

        def counted(prefix: str = "", _real: Any = real, _name: str = name) -> list[str]:
            if prefix.startswith("manifests"):
                calls[_name] += 1
            return list(_real(prefix))

        backend.list = counted
    got = ck.load()
    out = {"step": got["meta"]["step"], "diff": same(got, rank_state(rank, 2, NUMEL))}
    out["lists"] = dict(calls)
    dist.barrier()
    ck.close()
    return out
