"""Per-rank functions of ``test_peer_faults.py``, run by :func:`peer_workers.run` as
``"peer_fault_workers:<function>"`` (each rank its own "node", as in ``peer_workers``).

A save of step 2 fails on one rank's node RAM, injected the way ``dist_workers.w_fail_save``
does it (the backend's method replaced on that rank):

* ``"shard"``: the shard file cannot be created (ENOSPC): no rank commits step 2 there;
* ``"manifest"``: the shard is written but the node's manifest cannot be (ENOSPC), after rank
  0 assembled it: the other nodes commit step 2 in their RAM, the victim's node does not.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same
from peer_workers import NUMEL, ReadCounter

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, NodeRamTier, PeerTier
from tierckpt import distributed as tdist
from tierckpt.catalog import committed_steps
from tierckpt.format import CheckpointId, manifest_name, parse_data_folder

#: a round whose partner never comes gives up after this (the original code's failure mode)
ROUND_TIMEOUT_S = 15


def fault_tiers(rank: int, shm: str, disk: str, peer_kw: dict[str, Any] | None = None) -> list[Any]:
    return [
        NodeRamTier(
            path=os.path.join(shm, f"node-{rank}"),
            namespace="job",
            keep_last=None,
            stale_after_s=None,
        ),
        PeerTier(replicas=1, timeout_s=ROUND_TIMEOUT_S, **(peer_kw or {"keep_last": None})),
        LocalTier(os.path.join(disk, f"node-{rank}"), keep_last=None),
    ]


def _inject(ck: Checkpointer, how: str) -> None:
    backend = ck.backend("noderam")
    if how == "shard":
        real_open = backend.open_writer

        def refuse_shard(name: str) -> Any:
            if parse_data_folder(name) == CheckpointId(2):
                raise OSError(28, "No space left on device (injected)")
            return real_open(name)

        backend.open_writer = refuse_shard
    elif how == "manifest":
        real_put = backend.put_atomic

        def refuse_manifest(name: str, data: Any, **kw: Any) -> None:
            if name == manifest_name(2):
                raise OSError(28, "No space left on device (injected)")
            real_put(name, data, **kw)

        backend.put_atomic = refuse_manifest
    else:
        raise ValueError(how)


def replica_steps(ck: Checkpointer) -> dict[str, list[int]]:
    """Per source rank, the steps whose replica this rank holds."""
    peer = ck._peer
    assert peer is not None
    return {
        str(s): committed_steps(peer.replica_backend(s)) for s in peer.placement.sources(ck.rank)
    }


def saved_step1(rank: int, shm: str, disk: str) -> Checkpointer:
    """A checkpointer of :func:`fault_tiers` that saved step 1, its replicas made on every
    rank (call inside ``tdist.knobs``)."""
    ck = Checkpointer(fault_tiers(rank, shm, disk), chunk_bytes=64 << 10)
    assert ck._peer is not None
    ck.save(rank_state(rank, 1, NUMEL), 1).wait(timeout=60)
    assert ck._peer.wait_idle(60)
    dist.barrier()
    return ck


def saved_step3(ck: Checkpointer, rank: int, out: dict[str, Any]) -> dict[str, Any]:
    """Save step 3, wait for the rounds, and add to ``out`` whether replication still works
    and what this rank holds (its node RAM's steps, its sources' replicas)."""
    assert ck._peer is not None
    ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
    # a round that waits for a partner that never comes fails after ROUND_TIMEOUT_S
    out["idle"] = ck._peer.wait_idle(3 * ROUND_TIMEOUT_S)
    out["broken"] = ck._peer._broken
    out["rounds"] = ck._peer.rounds
    out["noderam"] = ck.steps("noderam")
    out["replicas"] = replica_steps(ck)
    return out


def w_failed_step(
    rank: int, world: int, shm: str, disk: str, how: str, victim: int
) -> dict[str, Any]:
    """Steps 1, 2 (fails on ``victim``'s node RAM as ``how`` says) and 3; then wait for the
    rounds and report what each rank replicated, and whether replication still works."""
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = saved_step1(rank, shm, disk)
        if rank == victim:
            _inject(ck, how)
        out: dict[str, Any] = {"error2": None}
        try:
            ck.save(rank_state(rank, 2, NUMEL), 2).wait(timeout=90)
        except CheckpointFailed as exc:
            out["error2"] = {t: type(e).__name__ for t, e in exc.errors.items()}
        saved_step3(ck, rank, out)
        dist.barrier()
        ck.close()
    return out


def w_load_step3(rank: int, world: int, shm: str, disk: str) -> dict[str, Any]:
    """A restarted rank: load the newest checkpoint (step 3), say where it came from."""
    ck = Checkpointer(fault_tiers(rank, shm, disk), chunk_bytes=64 << 10)
    counter = ReadCounter(ck)
    got = ck.load()
    assert ck._peer is not None and ck._peer.last_restore is not None
    out = {
        "step": got["meta"]["step"],
        "diff": same(got, rank_state(rank, 3, NUMEL)),
        "sources": list(ck._peer.last_restore.sources),
        "calls": dict(counter.calls),
    }
    dist.barrier()
    ck.close()
    return out
