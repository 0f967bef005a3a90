"""Collectives in the training thread: whether the process group matches this rank's view of
the job, and the device a collective's tensors live on."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

__all__ = ["collective_device"]

log = logging.getLogger("tierckpt")


def _group_ok(rank: int, world_size: int) -> bool:
    """Whether the default process group is up and matches this rank and world size."""
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == world_size
        and dist.get_rank() == rank
    )


def collective_device() -> torch.device:
    """The device the tensors of a collective on the default process group must live on.

    NCCL moves only CUDA tensors: there it is the current CUDA device. Gloo (and any backend
    string naming ``cpu``, such as ``"cpu:gloo,cuda:nccl"``) takes CPU tensors, and so does a
    machine without CUDA. The small vectors the commit, the load agreement and the DCP
    reader exchange are built there. Needs an initialized process group.
    """
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "gloo" not in backend and "cpu" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


#: how long a rank waits in its first save's all-reduce before it says what it waits for
FIRST_SAVE_PATIENCE_S = 30.0


def all_reduce_max_patiently(t: torch.Tensor, rank: int) -> None:
    """``dist.all_reduce(t, MAX)`` for a job's first save: a rank still waiting for the others
    after :data:`FIRST_SAVE_PATIENCE_S` logs what it waits for, once, and waits on. The usual
    cause is ``save()`` called on rank 0 only (the ``torch.save`` habit with a replicated
    model), which a checkpointer of the process group cannot do."""
    import torch.distributed as dist

    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    assert work is not None
    end = time.monotonic() + FIRST_SAVE_PATIENCE_S
    pause = 0.0005
    while not work.is_completed():
        if time.monotonic() >= end:
            log.warning(
                "rank %d has waited %.0f s in its first save() for the job's other ranks: every "
                "rank must call save() with the same steps. To save on rank 0 alone (a "
                "replicated model), give that checkpointer rank=0, world_size=1 (docs/faq.md)",
                rank,
                FIRST_SAVE_PATIENCE_S,
            )
            break
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    work.wait()
