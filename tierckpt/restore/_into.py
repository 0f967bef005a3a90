"""``load(into=...)``: copy a loaded state into the caller's, after checking all of it."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from tierckpt.errors import (
    BackendError,
    CheckpointNotFound,
    CorruptCheckpoint,
    FormatError,
    StateMismatch,
    TierCkptError,
    UnknownCodec,
)

__all__ = ["RECOVERABLE", "is_recoverable", "restore_into"]

log = logging.getLogger("tierckpt")
#: errors that make the reader try the next tier (or step)
RECOVERABLE = (CorruptCheckpoint, FormatError, BackendError, CheckpointNotFound, UnknownCodec)


def restore_into(target: Any, loaded: Any, path: str = "<root>", *, strict: bool = True) -> Any:
    """Copy ``loaded`` into ``target`` in place (tensors keep their storage); returns target.

    Everything is checked before a byte is copied. ``strict=True``: the dicts must have the
    same keys (:class:`StateMismatch` otherwise). ``strict=False`` (``load_state_dict``'s
    and torchsnapshot's partial restore): only the keys both sides hold are restored; the
    others are left as they are and logged. Shapes must match either way. A tensor loads into
    a tensor of another floating-point dtype by casting (``copy_``, as ``load_state_dict``
    does: float32 into bfloat16 rounds); any other dtype difference is refused. A NumPy array
    loads into a writable array of the same dtype and shape in place, as a tensor does; a
    tuple is rebuilt (it cannot change in place), so its scalars are the checkpoint's too."""
    skipped: list[str] = []
    _check_into(target, loaded, path, strict, skipped)
    if skipped:
        log.info(
            "load(strict=False): %d keys not restored (in only one side): %s",
            len(skipped),
            ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10 else ""),
        )
    return _copy_into(target, loaded)


def check_into(target: Any, loaded: Any, path: str = "<root>", strict: bool = True) -> None:
    """:func:`restore_into`'s checks alone: raise :class:`StateMismatch` where ``loaded`` could
    not be restored into ``target``; nothing is copied."""
    _check_into(target, loaded, path, strict, [])


def _castable(a: torch.dtype, b: torch.dtype) -> bool:
    return a == b or (a.is_floating_point and b.is_floating_point)


def _check_into(target: Any, loaded: Any, path: str, strict: bool, skipped: list[str]) -> None:
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise StateMismatch(
                f"{path}: the checkpoint holds a {type(loaded).__name__}, the target a tensor"
            )
        if target.shape != loaded.shape or not _castable(target.dtype, loaded.dtype):
            raise StateMismatch(
                f"{path}: checkpoint has {loaded.dtype} {tuple(loaded.shape)}, target has "
                f"{target.dtype} {tuple(target.shape)}"
                + (
                    "; a tensor loads into another dtype only between floating-point dtypes"
                    if target.shape == loaded.shape
                    else ""
                )
            )
        if target.is_meta:  # copy_ into it does nothing, silently
            raise StateMismatch(
                f"{path}: the target tensor is on the meta device (it has no memory to load "
                "into): materialize the model first (model.to_empty(device=...)), or load "
                "without into= and use load_state_dict(..., assign=True)"
            )
        if target.numel() > 1 and torch._debug_has_internal_overlap(target) == 1:
            raise StateMismatch(
                f"{path}: the target tensor's elements share memory (an expand()ed or "
                "as_strided view), so it cannot hold the checkpoint's values: give it a tensor "
                "of its own (x.clone())"
            )
        return
    if isinstance(target, np.ndarray):
        if not isinstance(loaded, np.ndarray):
            raise StateMismatch(
                f"{path}: the checkpoint holds a {type(loaded).__name__}, the target a NumPy array"
            )
        if target.shape != loaded.shape or target.dtype != loaded.dtype:
            raise StateMismatch(
                f"{path}: checkpoint has a {loaded.dtype} array {loaded.shape}, target has "
                f"{target.dtype} {target.shape}"
            )
        if not target.flags.writeable:
            raise StateMismatch(
                f"{path}: the target NumPy array is read-only; make it writable "
                "(x.setflags(write=True) or a copy) or load without into="
            )
        return
    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise StateMismatch(f"{path}: target is a dict, checkpoint a {type(loaded).__name__}")
        missing = [k for k in target if k not in loaded]
        extra = [k for k in loaded if k not in target]
        if (missing or extra) and strict:
            raise StateMismatch(
                f"{path}: keys differ — missing from checkpoint: {missing[:10]}, "
                f"not in target: {extra[:10]} (load(..., strict=False) restores the keys both "
                "hold)"
            )
        skipped.extend(f"{path}[{k!r}]" for k in missing + extra)
        for k in target:
            if k in loaded:
                _check_into(target[k], loaded[k], f"{path}[{k!r}]", strict, skipped)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(target):
            raise StateMismatch(f"{path}: sequence length or type differs")
        for i, (a, b) in enumerate(zip(target, loaded, strict=True)):
            _check_into(a, b, f"{path}[{i}]", strict, skipped)


def _copy_into(target: Any, loaded: Any) -> Any:
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, np.ndarray):
        np.copyto(target, loaded)
        return target
    if isinstance(target, dict):
        for k in target:
            if k not in loaded:
                continue  # strict=False: a key the checkpoint does not hold stays as it is
            new = _copy_into(target[k], loaded[k])
            if new is not target[k]:
                target[k] = new
        return target
    if isinstance(target, list):
        for i in range(len(target)):
            new = _copy_into(target[i], loaded[i])
            if new is not target[i]:
                target[i] = new
        return target
    if isinstance(target, tuple):
        # tensors and arrays in it are restored in place; a tuple with the checkpoint's
        # scalars replaces it where its container can change (a dict, a list)
        items = [_copy_into(a, b) for a, b in zip(target, loaded, strict=True)]
        if all(a is b for a, b in zip(items, target, strict=True)):
            return target
        return type(target)(*items) if hasattr(target, "_fields") else type(target)(items)
    return loaded


def is_recoverable(exc: BaseException) -> bool:
    return isinstance(exc, RECOVERABLE) or (
        isinstance(exc, TierCkptError) and not isinstance(exc, StateMismatch)
    )
