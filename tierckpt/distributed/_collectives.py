"""Collectives in the training thread: whether the process group matches this rank's view of
the job, and the device a collective's tensors live on."""

from __future__ import annotations

import logging
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
