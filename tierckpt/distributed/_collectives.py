"""Collectives in the training thread: whether the process group matches this rank's view of
the job, and the device a collective's tensors live on."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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


#: how long a rank may be in the collectives of its first save, or of a load, before it says
#: what it waits for
PATIENCE_S = 30.0


@contextmanager
def patience(rank: int, call: str) -> Iterator[None]:
    """Around the collectives of ``call`` (a first ``save()``, a ``load()``): a rank still in
    them after :data:`PATIENCE_S` logs what it waits for (once; it waits on). The usual cause
    is ``call`` made on rank 0 only (the ``torch.save`` habit with a replicated model), which
    a checkpointer of the process group cannot do: the other ranks never come."""

    def say() -> None:
        log.warning(
            "rank %d has waited %.0f s in %s for the job's other ranks: every rank must call "
            "%s together. To use one on rank 0 alone (a replicated model), give that "
            "checkpointer rank=0, world_size=1 (docs/faq.md)",
            rank,
            PATIENCE_S,
            call,
            call,
        )

    timer = threading.Timer(PATIENCE_S, say)
    timer.name, timer.daemon = "tierckpt-patience", True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
