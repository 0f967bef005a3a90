"""Several Lightning saves at one step: the same checkpoint, or another one.

Lightning writes a file per ``save_checkpoint`` call, and several calls often come at one
global step (a top-k file and ``last.ckpt``; a weights-only and a full ``ModelCheckpoint``; a
``trainer.save_checkpoint`` after ``fit``). tierckpt keeps one checkpoint per step and
timeline, so :class:`~tierckpt.integrations.lightning.TierCkptIO` compares each call with the
checkpoint it stored at that step:

* the same tensors (by storage, shape and in-place version: nothing written since) and the same
  other values: the pointer names that checkpoint;
* the same tensors, other small values (the callbacks' bookkeeping and the loops' progress,
  which Lightning updates between the calls): the pointer names that checkpoint and carries
  the values that differ, which a load puts back (:func:`describe`, :func:`restore`);
* other tensors, or other keys (a weights-only and a full checkpoint): a checkpoint of its
  own, on a new timeline at the same step.

Before, every call after the first at a step was given the first one's checkpoint: a full
checkpoint after a weights-only one was lost, and a resume got the first call's loop state.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SMALL_TENSOR", "Described", "describe", "restore"]

#: tensors up to this many elements are values (compared and carried by value: a step
#: counter, a best score); larger ones are compared by storage, shape and version
SMALL_TENSOR = 16
#: the most bytes of values a pointer carries; more make a checkpoint of their own
MAX_OVERRIDES = 32 << 10


class _NotValue(Exception):
    """A value that cannot be carried in a pointer (compared by its repr only)."""


@dataclass(frozen=True, slots=True)
class Described:
    """One Lightning checkpoint dict, described for comparison."""

    #: top-level key -> its value flattened: structure, plain values, and each large tensor
    #: as (data pointer, version, dtype, shape, strides): the same memory, not written since
    flat: dict[str, list[Any]]
    #: top-level key -> its value as JSON, where a pointer can carry it (no large tensor,
    #: every value encodable)
    carried: dict[str, Any]

    def overrides(self, base: Described) -> dict[str, Any] | None:
        """The values a pointer must carry for ``base``'s checkpoint to load as this one,
        or None when this one needs a checkpoint of its own."""
        if self.flat.keys() != base.flat.keys():
            return None
        changed = [k for k in self.flat if self.flat[k] != base.flat[k]]
        if any(k not in self.carried for k in changed):
            return None
        out = {k: self.carried[k] for k in changed}
        return out if len(json.dumps(out)) <= MAX_OVERRIDES else None


def describe(checkpoint: dict[str, Any]) -> Described:
    flat: dict[str, list[Any]] = {}
    carried: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if not isinstance(key, str):
            continue
        out: list[Any] = []
        if not _flatten(value, out):  # no large tensor: small, so encoded for a pointer
            try:
                carried[key] = _encode(value)
            except _NotValue:
                pass
        flat[key] = out
    return Described(flat, carried)


def _flatten(x: Any, out: list[Any]) -> bool:
    """Append ``x`` flattened to ``out``; whether it holds a large tensor. One pass of plain
    appends: it runs on the training thread at every save (thousands of tensors)."""
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:  # sparse and the like: the object itself
            out.append((id(x), x._version))
            return True
        if x.numel() > SMALL_TENSOR or x.is_complex():
            out.append((x.data_ptr(), x._version, x.dtype, x.shape, x.stride()))
            return True
        out.append((x.dtype, x.shape, x.tolist()))
        return False
    if isinstance(x, dict):
        out.append(("{", len(x)))
        big = False
        for k, v in x.items():
            out.append(k)
            big = _flatten(v, out) or big
        return big
    if isinstance(x, (list, tuple)):
        out.append(("[" if isinstance(x, list) else "(", len(x)))
        big = False
        for v in x:
            big = _flatten(v, out) or big
        return big
    if x is None or isinstance(x, (bool, int, float, str)):
        out.append(x)
    else:
        out.append(f"{type(x).__qualname__}:{x!r}")
    return False


def _encode(x: Any) -> Any:
    """``x`` as JSON for a pointer (:func:`restore` gives it back); :class:`_NotValue` where a
    value is not one of those."""
    if isinstance(x, torch.Tensor):
        return {"$tensor": [str(x.dtype), list(x.shape), x.detach().cpu().flatten().tolist()]}
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$float": repr(x)}
    if isinstance(x, dict):
        if not all(k is None or isinstance(k, (str, int, float, bool)) for k in x):
            raise _NotValue
        return {"$dict": [[k, _encode(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {"$list" if isinstance(x, list) else "$tuple": [_encode(v) for v in x]}
    raise _NotValue


def restore(doc: Any) -> Any:
    """A value carried in a pointer, as :func:`describe` encoded it."""
    if not isinstance(doc, dict):
        return doc
    ((kind, body),) = doc.items()
    if kind == "$dict":
        return {k: restore(v) for k, v in body}
    if kind == "$list":
        return [restore(v) for v in body]
    if kind == "$tuple":
        return tuple(restore(v) for v in body)
    if kind == "$float":
        return float(body)
    if kind == "$tensor":
        dtype, shape, data = body
        return torch.tensor(data, dtype=getattr(torch, dtype.removeprefix("torch."))).reshape(shape)
    raise ValueError(f"a Lightning pointer carries an unknown value {kind!r}")
