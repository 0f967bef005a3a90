"""``Stateful`` objects in the native API: what ``torch.distributed.checkpoint`` accepts.

DCP calls ``state_dict()`` on each top-level value of the state that has ``state_dict()`` and
``load_state_dict()`` (its ``Stateful`` protocol: a module, an optimizer, a user class), and
``load_state_dict()`` on the way back. ``Checkpointer.save`` / ``load(into=)`` do the same, so
``ck.save({"model": model, "optim": opt, "step": 7}, step=7)`` and
``ck.load(into={"model": model, "optim": opt, "step": 0})`` work as with ``tierckpt.dcp``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierckpt.errors import StateMismatch, UnsupportedObject

__all__ = ["expand_stateful", "has_stateful", "is_stateful", "load_stateful"]


def is_stateful(x: object) -> bool:
    """True for an object of DCP's ``Stateful`` protocol (not a tensor or a container)."""
    if isinstance(x, (torch.Tensor, dict, list, tuple, str, bytes)):
        return False
    return callable(getattr(x, "state_dict", None)) and callable(
        getattr(x, "load_state_dict", None)
    )


def has_stateful(state: Any) -> bool:
    return isinstance(state, dict) and any(is_stateful(v) for v in state.values())


def expand_stateful(state: Any) -> Any:
    """``state`` with each top-level ``Stateful`` value replaced by its ``state_dict()`` (a new
    dict; ``state`` itself is not changed). Anything else is returned as it is."""
    if not has_stateful(state):
        return state
    out: dict[Any, Any] = {}
    for k, v in state.items():
        if is_stateful(v):
            sd = v.state_dict()
            if is_stateful(sd):
                raise UnsupportedObject(
                    f"state[{k!r}].state_dict() returned another stateful object "
                    f"({type(sd).__qualname__}); it must return a dict of tensors and plain values"
                )
            out[k] = sd
        else:
            out[k] = v
    return out


def load_stateful(
    into: dict[Any, Any], load: Callable[[], Any], restore: Callable[[Any, Any, str], Any]
) -> Any:
    """Load the checkpoint (``load()``, no target) and hand each ``Stateful`` value of ``into``
    its part through ``load_state_dict()``; the other values are restored in place as
    ``load(into=)`` does (``restore(target, loaded, path)``). Returns ``into``.

    The stateful parts are loaded into fresh tensors, not into ``obj.state_dict()``: a fresh
    optimizer's ``state_dict()`` has no state yet, and ``load_state_dict()`` is what knows
    how to take one in (moving tensors to the parameters' devices, casting)."""
    loaded = load()
    if not isinstance(loaded, dict):
        raise StateMismatch(f"<root>: target is a dict, checkpoint a {type(loaded).__name__}")
    missing = [k for k in into if k not in loaded]
    extra = [k for k in loaded if k not in into]
    if missing or extra:
        raise StateMismatch(
            f"<root>: keys differ — missing from checkpoint: {missing[:10]}, "
            f"not in target: {extra[:10]}"
        )
    for k, v in into.items():
        if is_stateful(v):
            v.load_state_dict(loaded[k])
        else:
            new = restore(v, loaded[k], f"<root>[{k!r}]")
            if new is not v:
                into[k] = new
    return into
