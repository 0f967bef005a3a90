"""Per-rank functions of the node-RAM and peer-tier tests, and their launcher.

Every rank plays a node of its own: its node RAM is ``<shm>/node-<r>`` and its disk
``<disk>/node-<r>`` (so ``TIERCKPT_PRIVATE_TIERS=local``). ``run(fn, world, ...)`` launches
the functions of this module with :func:`dist_workers.launch` (gloo on 127.0.0.1, a forkserver
that imported torch once). Reads are counted per tier by wrapping each backend's read calls.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import torch.distributed as dist
from dist_workers import launch, rank_state, same

from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier, S3Tier
from tierckpt import distributed as tdist

NUMEL = 4096  # 4096 x 8 fp32 and the rest: ~140 KiB per rank


def run(
    fn: str,
    world: int,
    *,
    timeout: float = 120,
    expect_killed: tuple[int, ...] = (),
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` (a function of this module, or ``"module:function"`` for a worker of another
    test module) on ``world`` ranks (``dist_workers.launch``, with
    ``TIERCKPT_PRIVATE_TIERS=local``); every rank's result."""
    env = {"TIERCKPT_PRIVATE_TIERS": "local"}
    module, _, name = fn.rpartition(":")
    return launch(
        module or "peer_workers",
        name,
        world,
        timeout=timeout,
        expect_killed=expect_killed,
        env=env,
        **kwargs,
    )


# -- pieces ------------------------------------------------------------------------------------


def node_tiers(
    rank: int, shm: str, disk: str, s3: dict[str, str] | None, *, peer: bool = True
) -> list[Any]:
    """The documented recipe, with this rank's node folders."""
    out: list[Any] = [
        NodeRamTier(path=os.path.join(shm, f"node-{rank}"), namespace="job", stale_after_s=None)
    ]
    if peer:
        out.append(PeerTier(replicas=1, timeout_s=60))
    out.append(LocalTier(os.path.join(disk, f"node-{rank}"), keep_last=2))
    if s3:
        out.append(S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"]))
    return out


class ReadCounter:
    """Counts the read calls and bytes of each tier's backend (a wrapper on the instance)."""

    def __init__(self, ck: Checkpointer) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        for name in ck.tier_names:
            self._wrap(name, ck.backend(name))

    def _wrap(self, name: str, backend: Any) -> None:
        self.calls[name] = 0
        self.bytes[name] = 0
        read, read_into, get = backend.read, backend.read_into, backend.get
        pieces = backend.read_into_pieces  # the zero-copy load's scatter read

        def count(n: int) -> None:
            self.calls[name] += 1
            self.bytes[name] += n

        def c_read(obj: str, offset: int, length: int) -> Any:
            count(length)
            return read(obj, offset, length)

        def c_read_into(obj: str, offset: int, out: memoryview) -> None:
            count(out.nbytes)
            read_into(obj, offset, out)

        def c_get(obj: str) -> bytes:
            data = get(obj)
            count(len(data))
            return data

        def c_pieces(obj: str, offset: int, outs: Any) -> None:
            count(sum(memoryview(o).nbytes for o in outs))
            pieces(obj, offset, outs)

        backend.read, backend.read_into, backend.get = c_read, c_read_into, c_get
        backend.read_into_pieces = c_pieces


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- workers -----------------------------------------------------------------------------------


def w_save(
    rank: int,
    world: int,
    shm: str,
    disk: str,
    s3: dict[str, str] | None,
    victim: int,
    peer: bool = True,
) -> dict[str, Any]:
    """Save steps 1 and 2 on every tier, wait for the replicas, then ``victim`` SIGKILLs
    itself; the others end without closing (torchrun kills them)."""
    ck = Checkpointer(node_tiers(rank, shm, disk, s3, peer=peer), chunk_bytes=64 << 10)
    for step in (1, 2):
        ck.save(rank_state(rank, step, NUMEL), step).wait(timeout=60)
    if s3:
        tdist.wait_committed(ck.backend("s3"), 2, timeout=60)
    out: dict[str, Any] = {"steps": ck.tier_steps()}
    if ck._peer is not None:
        assert ck._peer.wait_idle(60)
        out["rounds"] = ck._peer.rounds
        out["received"] = ck._peer.received_bytes
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


def w_load(
    rank: int, world: int, shm: str, disk: str, s3: dict[str, str] | None, peer: bool = True
) -> dict[str, Any]:
    """A restarted rank: load the newest checkpoint, count where the bytes came from."""
    warned = Warnings()
    logging.getLogger("tierckpt").addHandler(warned)
    ck = Checkpointer(node_tiers(rank, shm, disk, s3, peer=peer), chunk_bytes=64 << 10)
    counter = ReadCounter(ck)
    got = ck.load()
    report = ck._peer.last_restore if ck._peer is not None else None
    out = {
        "step": got["meta"]["step"],
        "diff": same(got, rank_state(rank, 2, NUMEL)),
        "calls": dict(counter.calls),  # the load's reads (the save below reads leases)
        "bytes": dict(counter.bytes),
        "sources": list(report.sources) if report else None,
        "pulled": report.pulled_bytes if report else 0,
        "warnings": warned.messages,
    }
    # the restored job saves on: every tier, replicas included, goes on working
    ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
    if ck._peer is not None:
        assert ck._peer.wait_idle(60)
    out["steps_after"] = ck.tier_steps()
    dist.barrier()
    ck.close()
    return out
