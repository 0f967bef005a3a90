"""Per-rank functions of ``test_peer_leftovers.py``: what a partner pull or a replica receive
killed midway leaves in node RAM, and whether the restarted job removes it (tmpfs pages are
the node's RAM: a leftover nobody removes holds memory for the rest of the job).

Every rank is a "node" as in ``peer_spare_workers`` (node RAM ``<shm>/node-<r>``, disk
``<disk>/node-<r>``), without S3.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same
from peer_spare_workers import die_at_wait, the_spare, tiers
from peer_workers import NUMEL

from tierckpt import Checkpointer
from tierckpt.noderam import node_ram_usage


def leftovers(shm: str, rank: int) -> list[str]:
    """Every unfinished file in ``rank``'s node RAM: its run folder and its replicas."""
    node = os.path.join(shm, f"node-{rank}")
    return sorted(
        os.path.relpath(os.path.join(d, f), node)
        for d, _dirs, files in os.walk(node)
        for f in files
        if f.endswith(".tmp")
    )


def w_load_and_save(
    rank: int,
    world: int,
    shm: str,
    disk: str,
    extra_saves: int = 0,
    max_bytes: int | None = None,
    save: bool = True,
) -> dict[str, Any]:
    """A restarted rank loads, trains on and saves step 3 (replicas included); what is left
    unfinished in its node RAM before and after, and what its node RAM holds. ``max_bytes``:
    rank 1's node-RAM budget; ``save``: False to only load."""
    before = leftovers(shm, rank)
    ck = Checkpointer(tiers(rank, shm, disk, max_bytes), chunk_bytes=64 << 10)
    assert ck._peer is not None
    got = ck.load()
    report = ck._peer.last_restore
    sources = list(report.sources) if report else None
    diff = same(got, rank_state(rank, 2, NUMEL))
    del got
    if save:
        ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
        assert ck._peer.wait_idle(60)
    dist.barrier()
    after_first = leftovers(shm, rank)
    for step in range(4, 4 + extra_saves):
        ck.save(rank_state(rank, step, NUMEL), step).wait(timeout=60)
        assert ck._peer.wait_idle(60)
    dist.barrier()
    ck.close()
    dist.barrier()
    node = os.path.join(shm, f"node-{rank}")
    return {
        "before": before,
        "after_first": after_first,
        "after": leftovers(shm, rank),
        "diff": diff,
        "sources": sources,
        "usage": node_ram_usage(node),
        "steps": sorted(
            f for d, _dirs, files in os.walk(node) for f in files if f.endswith(".json")
        ),
    }


def w_save_receiver_killed(rank: int, world: int, shm: str, disk: str) -> dict[str, Any] | None:
    """Every rank saves step 3; rank 2 SIGKILLs itself while its partner's replica is
    arriving (its fourth wait for pieces in the replication round)."""
    ck = Checkpointer(tiers(rank, shm, disk), chunk_bytes=64 << 10)
    assert ck._peer is not None
    if rank == 2:
        die_at_wait(4)
    try:
        ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
        ck._peer.wait_idle(30)
    except Exception as exc:  # a partner died: its round fails
        return {"error": str(exc)}
    return {"error": None, "left": leftovers(shm, rank)}


def w_load_node_groups(rank: int, world: int, shm: str, disk: str) -> dict[str, Any]:
    """A restarted rank loads from its node RAM (listed first, as in the recipe): whether
    the load made the node groups that share manifests of shared tiers (it has none to read
    first: two collectives and a broadcast of nothing, at the first load)."""
    ck = Checkpointer(tiers(rank, shm, disk), chunk_bytes=64 << 10)
    got = ck.load()
    out = {
        "diff": same(got, rank_state(rank, 2, NUMEL)),
        "node_groups": ck._strategy._node is not None,  # type: ignore[attr-defined]
    }
    del got
    dist.barrier()
    ck.close()
    return out


def w_spare_released(rank: int, world: int, shm: str, disk: str, first: str) -> dict[str, Any]:
    """A restarted rank whose node lost its RAM (it gets a spare segment for a pull) first
    loads from one named tier (``first="load_local"``: no pull) or saves without loading
    (``first="save"``): whether its spare is still there afterwards."""
    ck = Checkpointer(tiers(rank, shm, disk), chunk_bytes=64 << 10)
    assert ck._peer is not None
    spare = ck._peer.spare
    had = spare is not None
    if spare is not None:
        spare.wait()
    out: dict[str, Any] = {
        "had_spare": had,
        "spare_file_before": os.path.exists(the_spare(shm, rank)),
    }
    if first == "load_local":
        got = ck.load(tier="local")
        out["diff"] = same(got, rank_state(rank, 2, NUMEL))
        del got
    else:
        ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
    out["spare_file_after"] = os.path.exists(the_spare(shm, rank))
    out["spare_after"] = ck._peer.spare is not None
    dist.barrier()
    ck.close()
    return out
