"""Per-rank functions of ``test_peer_rounds.py``, run by :func:`peer_workers.run` as
``"peer_round_workers:<function>"`` (each rank its own "node", as in ``peer_workers``)."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same
from peer_fault_workers import ROUND_TIMEOUT_S, replica_steps, saved_step1, saved_step3
from peer_workers import NUMEL

from tierckpt import Checkpointer, CheckpointFailed, NodeRamTier, PeerTier, UnsupportedObject
from tierckpt import distributed as tdist

#: step -> the loss saved with it (the node RAM keeps the best by loss)
LOSSES = {1: 5.0, 2: 0.1, 3: 4.0, 4: 3.0, 5: 6.0}


def pin_tiers(rank: int, shm: str) -> list[Any]:
    """Node RAM keeping its newest, the best by loss and what is pinned; replicas keeping
    their newest (``keep_last=1``) by their own rule."""
    return [
        NodeRamTier(
            path=os.path.join(shm, f"node-{rank}"),
            namespace="job",
            keep_last=1,
            keep_best=1,
            best_metric="loss",
            stale_after_s=None,
        ),
        PeerTier(replicas=1, keep_last=1, timeout_s=ROUND_TIMEOUT_S),
    ]


def _save(ck: Checkpointer, rank: int, step: int) -> None:
    ck.save(rank_state(rank, step, NUMEL), step, metrics={"loss": LOSSES[step]}).wait(timeout=60)


def w_pins(rank: int, world: int, shm: str) -> dict[str, Any]:
    """Steps 1-4, pinning 1 and 3 on every rank; then unpin 3 and save 5. Reports the steps
    in node RAM and the replicas this rank keeps of its source, after step 4 and step 5."""
    ck = Checkpointer(pin_tiers(rank, shm), chunk_bytes=64 << 10)
    assert ck._peer is not None
    out: dict[str, Any] = {}
    for step in (1, 2, 3, 4):
        _save(ck, rank, step)
        if step in (1, 3):
            ck.pin(step)
    assert ck._peer.wait_idle(60)
    out["noderam4"] = ck.steps("noderam")
    out["replicas4"] = replica_steps(ck)
    dist.barrier()
    ck.unpin(3)
    _save(ck, rank, 5)
    assert ck._peer.wait_idle(60)
    out["noderam5"] = ck.steps("noderam")
    out["replicas5"] = replica_steps(ck)
    out["broken"] = ck._peer._broken
    dist.barrier()
    ck.close()
    return out


def w_load_pinned(rank: int, world: int, shm: str, step: int) -> dict[str, Any]:
    """A restarted job loads ``step``: where each shard came from, and whether it is exact."""
    ck = Checkpointer(pin_tiers(rank, shm), chunk_bytes=64 << 10)
    got = ck.load(step=step)
    assert ck._peer is not None and ck._peer.last_restore is not None
    out = {
        "step": got["meta"]["step"],
        "diff": same(got, rank_state(rank, step, NUMEL)),
        "sources": list(ck._peer.last_restore.sources),
    }
    dist.barrier()
    ck.close()
    return out


def w_save_raises(rank: int, world: int, shm: str, disk: str, victim: int) -> dict[str, Any]:
    """Steps 1, 2 (``victim``'s save() raises: its state holds an object tierckpt cannot
    store) and 3, the job going on; then wait for the rounds and report what each rank
    replicated, and whether replication still works."""
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = saved_step1(rank, shm, disk)
        out: dict[str, Any] = {"raised2": None, "error2": None}
        state2 = rank_state(rank, 2, NUMEL)
        if rank == victim:
            state2["bad"] = object()  # refused by save() itself, before the pipeline
        t0 = time.monotonic()
        try:
            ck.save(state2, 2).wait(timeout=90)
        except UnsupportedObject as exc:
            out["raised2"] = type(exc).__name__
        except CheckpointFailed as exc:
            out["error2"] = sorted(exc.errors)
        out["seconds2"] = time.monotonic() - t0
        saved_step3(ck, rank, out)
        out["failed_events"] = sorted(
            s.tier for s in ck.stats(failures=True) if s.step == 2 and s.outcome == "failed"
        )
        dist.barrier()
        ck.close()
    return out


def w_kept_unknown(rank: int, world: int, shm: str) -> dict[str, Any]:
    """Steps 1-5 of :func:`pin_tiers`; this rank's node RAM cannot list its pins (EIO, the
    backend's method replaced) during the rounds of steps 2, 3 and 5. Reports the levels of
    the records saying whether node RAM can tell what it keeps, in order."""
    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if "checkpoints node RAM keeps" in msg or "which checkpoints it keeps" in msg:
                said.append(record.levelname)

    logger = logging.getLogger("tierckpt")
    logger.addHandler(Catch(logging.DEBUG))
    logger.setLevel(logging.DEBUG)
    ck = Checkpointer(pin_tiers(rank, shm), chunk_bytes=64 << 10)
    peer = ck._peer
    assert peer is not None
    ram = peer._ram_backend
    real = ram.list
    broken = threading.Event()

    def list_(prefix: str = "") -> list[str]:
        if broken.is_set() and prefix.startswith("pins"):
            raise OSError(errno.EIO, f"{ram.url}/{prefix}: Input/output error")
        return real(prefix)

    ram.list = list_  # type: ignore[method-assign]
    for step in (1, 2, 3, 4, 5):
        if step in (2, 3, 5):
            broken.set()
        _save(ck, rank, step)
        deadline = time.monotonic() + 60
        while peer.rounds < step:  # this step's round is done
            assert time.monotonic() < deadline, f"no round for step {step}"
            time.sleep(0.01)
        broken.clear()
    out = {"said": said, "broken": peer._broken, "rounds": peer.rounds}
    dist.barrier()
    ck.close()
    return out
