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

__all__ = [
    "RECOVERABLE",
    "check_into",
    "is_recoverable",
    "key_hint",
    "log_skipped",
    "restore_into",
]

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
    log_skipped(check_into(target, loaded, path, strict))
    return _copy_into(target, loaded)


def check_into(target: Any, loaded: Any, path: str = "<root>", strict: bool = True) -> list[str]:
    """:func:`restore_into`'s checks alone: raise :class:`StateMismatch` where ``loaded`` could
    not be restored into ``target``; nothing is copied. Returns the paths ``strict=False``
    leaves as they are (held by one side only)."""
    skipped: list[str] = []
    _check_into(target, loaded, path, strict, skipped)
    return skipped


def log_skipped(skipped: list[str]) -> None:
    """Say which keys a ``strict=False`` load left as they were."""
    if skipped:
        log.info(
            "load(strict=False): %d keys not restored (in only one side): %s",
            len(skipped),
            ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10 else ""),
        )


def _castable(a: torch.dtype, b: torch.dtype) -> bool:
    return a == b or (a.is_floating_point and b.is_floating_point)


def _check_into(
    target: Any, loaded: Any, path: str, strict: bool, skipped: list[str], whole: bool = True
) -> None:
    """``whole``: ``target`` is the whole state of the call (not a part within it), where a
    dict that shares no key with the checkpoint's is refused even with ``strict=False`` (it
    would restore nothing, and say so only in a log)."""
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
        _stateless_optimizer(target, loaded, path)
        missing = [k for k in target if k not in loaded]
        extra = [k for k in loaded if k not in target]
        shared = len(missing) < len(target)
        if (missing or extra) and (strict or (whole and not shared and target and loaded)):
            raise StateMismatch(
                f"{path}: keys differ — missing from checkpoint: {missing[:10]}, "
                f"not in target: {extra[:10]}" + key_hint(list(target), list(loaded), shared)
            )
        skipped.extend(f"{path}[{k!r}]" for k in missing + extra)
        for k in target:
            if k in loaded:
                _check_into(target[k], loaded[k], f"{path}[{k!r}]", strict, skipped, False)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(target):
            raise StateMismatch(f"{path}: sequence length or type differs")
        for i, (a, b) in enumerate(zip(target, loaded, strict=True)):
            _check_into(a, b, f"{path}[{i}]", strict, skipped, False)


def key_hint(target: list[Any], loaded: list[Any], shared: bool) -> str:
    """What to do about a target's keys that differ from the checkpoint's (a message's end)."""
    moved = _prefix_moved(target, loaded)
    if moved is not None:
        return f" — {moved}"
    if shared:
        return " (load(..., strict=False) restores the keys both hold)"
    return (
        " — no key in common, so strict=False would restore nothing: the checkpoint is laid "
        "out otherwise (load() without into= and take its part, e.g. load()['model'], or pass "
        "into= a dict laid out as it is: into={'model': model, 'optimizer': optimizer, ...})"
    )


def _prefix_moved(target: list[Any], loaded: list[Any]) -> str | None:
    """Where one side's keys are the other's with a prefix (``_orig_mod.`` of a
    ``torch.compile``d model, ``module.`` of DDP), what to do about it; else None."""
    for longer, shorter, holder in ((loaded, target, "checkpoint"), (target, loaded, "target")):
        names = [k for k in shorter if isinstance(k, str)]
        if not names or not all(isinstance(k, str) for k in longer):
            continue
        first = names[0]
        for k in longer:
            if len(k) > len(first) and k.endswith(first):
                prefix = k[: -len(first)]
                rest = {k[len(prefix) :] for k in longer if k.startswith(prefix)}
                if len(rest & set(names)) * 2 >= len(names):
                    break
        else:
            continue
        if holder == "checkpoint":
            return (
                f"the checkpoint's keys carry the prefix {prefix!r} that the target's do not "
                "(saved from a wrapped model: torch.compile, DDP): load() without into= and "
                f"strip it ({{k.removeprefix({prefix!r}): v for k, v in state.items()}}), or "
                "load into the wrapped model"
            )
        return (
            f"the target's keys carry the prefix {prefix!r} that the checkpoint's do not (a "
            "model wrapped since the save: torch.compile, DDP): load into the model inside "
            "(model._orig_mod, model.module)"
        )
    return None


def _stateless_optimizer(target: dict[Any, Any], loaded: dict[Any, Any], path: str) -> None:
    """Refuse an optimizer's ``state_dict()`` without state as the target of a checkpoint's
    optimizer state: nothing of it could be restored in place (strict=False: silently)."""
    if set(target) != {"state", "param_groups"} or target["state"]:
        return
    held = loaded.get("state")
    if isinstance(held, dict) and held:
        raise StateMismatch(
            f"{path}: the target is an optimizer's state_dict() that holds no state yet (a "
            f"fresh optimizer's), which cannot take the checkpoint's state of {len(held)} "
            "parameters in place: pass the optimizer itself (into={..., 'optimizer': "
            "optimizer}), whose load_state_dict() takes it in"
        )


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
