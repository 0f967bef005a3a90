"""Per-rank functions of ``test_peer_spare.py``: the spare node-RAM segment a replacement
rank allocates at setup and its partner pull receives into (``tierckpt.peer._spare``).

Every rank is a "node" as in ``peer_workers`` (its node RAM ``<shm>/node-<r>``, its disk
``<disk>/node-<r>``), without S3.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same
from peer_workers import NUMEL, ReadCounter, Warnings

from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier
from tierckpt.noderam import node_ram_usage
from tierckpt.peer import _wire


def tiers(rank: int, shm: str, disk: str, max_bytes: int | None = None) -> list[Any]:
    """The recipe without S3; ``max_bytes``: rank 1's node-RAM budget."""
    ram = NodeRamTier(
        path=os.path.join(shm, f"node-{rank}"),
        namespace="job",
        stale_after_s=None,
        max_bytes=max_bytes if rank == 1 else None,
    )
    return [
        ram,
        PeerTier(replicas=1, timeout_s=60),
        LocalTier(os.path.join(disk, f"node-{rank}"), keep_last=2),
    ]


def the_spare(shm: str, rank: int) -> str:
    """Where ``rank``'s spare segment is (``tierckpt.peer._spare.spare_path``; spelled out
    so that these tests run, and fail, on code without spares)."""
    return os.path.join(shm, f"node-{rank}", "job.replicas", "spare", f"rank-{rank:06d}.seg")


def _inodes(folder: str) -> dict[int, str]:
    return {
        os.stat(os.path.join(d, f)).st_ino: os.path.join(d, f)
        for d, _dirs, files in os.walk(folder)
        for f in files
    }


def die_at_wait(n: int) -> None:
    """This process SIGKILLs itself entering its ``n``-th wait for a file's pieces (the
    first three are a round's handshakes): while a file is arriving."""
    calls = [0]
    wait = _wire._wait

    def dying_wait(works: Any) -> None:
        calls[0] += 1
        if calls[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        wait(works)

    _wire._wait = dying_wait  # type: ignore[assignment]


def w_save(rank: int, world: int, shm: str, disk: str) -> dict[str, Any]:
    """Save steps 1 and 2 on every tier, replicas included; the shard size of step 2."""
    ck = Checkpointer(tiers(rank, shm, disk), chunk_bytes=64 << 10)
    for step in (1, 2):
        ck.save(rank_state(rank, step, NUMEL), step).wait(timeout=60)
    assert ck._peer is not None and ck._peer.wait_idle(60)
    dist.barrier()
    folder = os.path.join(shm, f"node-{rank}", "job")
    sizes = [os.path.getsize(p) for p in _inodes(folder).values() if p.endswith(".tck")]
    ck.close()
    return {"shard": max(sizes), "rounds": ck._peer.rounds}


def w_load(
    rank: int, world: int, shm: str, disk: str, max_bytes: int | None = None
) -> dict[str, Any]:
    """A restarted rank: what its setup did about a spare, then a load and where it came
    from (which file the pulled shard is)."""
    warned = Warnings()
    logging.getLogger("tierckpt").addHandler(warned)
    ck = Checkpointer(tiers(rank, shm, disk, max_bytes), chunk_bytes=64 << 10)
    assert ck._peer is not None
    spare = getattr(ck._peer, "spare", None)
    out: dict[str, Any] = {"spare": None}
    path = the_spare(shm, rank)
    if spare is not None:
        spare.wait()
        st = os.stat(path)
        out["spare"] = {
            "size": spare.size,
            "allocated": st.st_blocks * 512,
            "ino": st.st_ino,
            "usage": ck.backend("noderam").usage(),  # type: ignore[attr-defined]
        }
    out["spare_exists_before"] = os.path.exists(path)
    out["steps_before"] = ck.tier_steps()  # the spare is no checkpoint
    counter = ReadCounter(ck)
    got = ck.load()
    report = ck._peer.last_restore
    ram = os.path.join(shm, f"node-{rank}", "job")
    out.update(
        step=got["meta"]["step"],
        diff=same(got, rank_state(rank, 2, NUMEL)),
        sources=list(report.sources) if report else None,
        pulled=report.pulled_bytes if report else 0,
        calls=dict(counter.calls),
        spare_exists_after=os.path.exists(path),
        shard_inodes=[i for i, p in _inodes(ram).items() if p.endswith(".tck")],
        usage=node_ram_usage(ram),
        max_bytes=ck.backend("noderam").max_bytes,  # type: ignore[attr-defined]
        warnings=warned.messages,
        tmp_files=[p for p in _inodes(ram).values() if p.endswith(".tmp")],
    )
    del got
    dist.barrier()
    ck.close()
    return out


def w_pull_killed(rank: int, world: int, shm: str, disk: str) -> dict[str, Any] | None:
    """Every rank runs the load's agreement and pulls; rank 1 SIGKILLs itself while its
    pull's file is arriving (entering the wait for the file's pieces, after the three
    handshakes); the sender sees the broken peer."""
    ck = Checkpointer(tiers(rank, shm, disk), chunk_bytes=64 << 10)
    assert ck._peer is not None
    if rank == 1:
        spare = getattr(ck._peer, "spare", None)
        if spare is not None:
            spare.wait()
        die_at_wait(4)
    try:
        ck._peer.prepare_load(None, None)
    except Exception as exc:  # the sender: its receiver died
        return {"error": str(exc)}
    return {"error": None}
