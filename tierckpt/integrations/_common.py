"""Helpers shared by the framework integrations."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from tierckpt.tree import numpy_storable

__all__ = ["closure_guard_hook", "sanitize_state"]

log = logging.getLogger("tierckpt")

_PLAIN = (type(None), bool, int, float, str, bytes, torch.Size, torch.dtype, torch.device)


def sanitize_state(
    obj: Any, *, unsupported: Literal["error", "repr"] = "repr", path: str = ""
) -> Any:
    """Turn a framework's checkpoint dict into values tierckpt stores without pickle.

    Dict subclasses (``AttributeDict``, ``defaultdict``) become dicts (``OrderedDict`` stays),
    namedtuples and list subclasses become tuples and lists, paths become strings, enums their
    values, dataclasses dicts; NumPy arrays and scalars of numeric or bool dtypes stay as they
    are (tierckpt stores them). With ``unsupported="repr"`` any other object is stored as its
    ``repr()`` string (logged once per path; it cannot be restored as an object); with
    ``"error"`` it is left alone, so ``save()`` refuses it with ``UnsupportedObject``.
    """
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return obj
    if isinstance(obj, (np.ndarray, np.generic)) and numpy_storable(obj):
        return obj  # stored as it is (a NumPy array or scalar of a numeric or bool dtype)
    if isinstance(obj, Mapping):
        items = [
            (
                sanitize_state(k, unsupported=unsupported, path=f"{path}<key>"),
                sanitize_state(v, unsupported=unsupported, path=f"{path}.{k}"),
            )
            for k, v in obj.items()
        ]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, tuple):
        return tuple(
            sanitize_state(v, unsupported=unsupported, path=f"{path}.{i}")
            for i, v in enumerate(obj)
        )
    if isinstance(obj, (list, set, frozenset)):
        return [
            sanitize_state(v, unsupported=unsupported, path=f"{path}.{i}")
            for i, v in enumerate(obj)
        ]
    if isinstance(obj, (bool, int, float, str, bytes)):  # subclasses (IntEnum handled here)
        base: type = next(t for t in (bool, int, float, str, bytes) if isinstance(obj, t))
        return base(obj)
    if isinstance(obj, enum.Enum):
        return sanitize_state(obj.value, unsupported=unsupported, path=path)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sanitize_state(dataclasses.asdict(obj), unsupported=unsupported, path=path)
    if unsupported == "repr":
        log.warning(
            "checkpoint value at %s (%s) stored as its repr() text: tierckpt stores "
            "no pickled objects",
            path or "<root>",
            type(obj).__qualname__,
        )
        return repr(obj)
    return obj


def closure_guard_hook(wait: Callable[[], None]) -> Callable[..., Any]:
    """An optimizer step pre-hook that waits for pending captures right before the update.

    Frameworks such as Lightning call ``optimizer.step(closure)`` with the forward and
    backward pass inside the closure. Waiting at the start of ``step()`` would give the
    capture no time to overlap them; instead the hook wraps the closure so the wait happens
    after it returns, just before the optimizer changes the parameters. Without a closure it
    waits at once.
    """

    def hook(_opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # args are step()'s positional arguments, the optimizer itself first
        closure = kwargs.get("closure")
        positional = closure is None and len(args) > 1 and callable(args[1])
        if positional:
            closure = args[1]
        if closure is None:
            wait()
            return None

        def guarded() -> Any:
            out = closure()
            wait()
            return out

        if positional:
            return (args[0], guarded, *args[2:]), kwargs
        return args, {**kwargs, "closure": guarded}

    return hook
