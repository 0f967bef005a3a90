"""What a caller passes as a step, a rank and a load's device, checked: :func:`as_step`,
:func:`resolve_rank`, :func:`as_map_location`."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from tierckpt.redact import shown

__all__ = ["as_map_location", "as_step", "resolve_rank"]


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the world size: the arguments, else ``torch.distributed``'s
    when it is initialized, else 0 and 1."""
    import torch.distributed as dist

    dist_rank, dist_world = 0, 1
    if dist.is_available() and dist.is_initialized():
        dist_rank, dist_world = dist.get_rank(), dist.get_world_size()
    rank = dist_rank if rank is None else rank
    world_size = dist_world if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return rank, world_size


def as_step(step: object, call: str = "save") -> int:
    """A step as the caller gave it: an ``int``, or an integer that indexes as one (a NumPy
    integer, a one-element integer tensor: Python's own indexing takes them, via
    ``__index__``); never a ``bool`` or a float. Raises ``ValueError`` otherwise, naming what
    was given in a few words (not a whole state's repr) and, for a state where the step
    belongs (Orbax's ``save(step, state)``, DCP's ``load(state)``), the order ``call`` takes."""
    try:
        value = -1 if isinstance(step, bool) else operator.index(step)  # type: ignore[arg-type]
    except TypeError:
        value = -1
    if value >= 0:
        return value
    hint = ""
    if isinstance(step, (Mapping, list, tuple, torch.nn.Module, torch.optim.Optimizer)):
        hint = {
            "save": "; save(state, step) takes the state first, then the step",
            "load": "; to load into objects you have, pass them as load(into=state)",
        }.get(call, "")
    raise ValueError(
        "step must be a non-negative int (or an integer NumPy/torch scalar), got "
        f"{shown(step)}{hint}"
    )


def as_map_location(given: object) -> str | torch.device | None:
    """``load(map_location=)``: one device for every tensor (``"cpu"``, ``"cuda:1"``, a
    ``torch.device``, or None: the CPU). Of ``torch.load``'s other forms, a dict whose values
    all name one device (``{"cuda:0": "cpu"}``) means that device; a dict that maps devices
    apart, a function, or anything else is refused with what it takes."""
    if given is None or isinstance(given, (str, torch.device)):
        return given
    if isinstance(given, Mapping) and given:
        try:
            targets = {torch.device(v) for v in given.values()}
        except (TypeError, RuntimeError):
            targets = set()
        if len(targets) == 1:
            return targets.pop()
    raise TypeError(
        "load(map_location=) takes one device for every tensor ('cpu', 'cuda:1', a "
        f"torch.device; or a dict whose values all name one device), got {shown(given)}: a "
        "load puts every tensor on one device (the device each had at save is "
        "recorded, not used), so torch.load's per-device maps and functions are not taken"
    )
