"""``Stateful`` objects in the native API: what ``torch.distributed.checkpoint`` accepts.

DCP calls ``state_dict()`` on each top-level value of the state that has ``state_dict()`` and
``load_state_dict()`` (its ``Stateful`` protocol: a module, an optimizer, a user class), and
``load_state_dict()`` on the way back. ``Checkpointer.save`` / ``load(into=)`` do the same, so
``ck.save({"model": model, "optim": opt, "step": 7}, step=7)`` and
``ck.load(into={"model": model, "optim": opt, "step": 0})`` work as with ``tierckpt.dcp``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from tierckpt.errors import StateMismatch, UnsupportedObject
from tierckpt.restore import check_into, key_hint, log_skipped, restore_into

__all__ = ["expand_stateful", "has_stateful", "is_stateful", "load_stateful"]


def is_stateful(x: object) -> bool:
    """True for an object of DCP's ``Stateful`` protocol (not a tensor or a container)."""
    if isinstance(x, (torch.Tensor, dict, list, tuple, str, bytes)):
        return False
    return callable(getattr(x, "state_dict", None)) and callable(
        getattr(x, "load_state_dict", None)
    )


def has_stateful(state: Any) -> bool:
    """Whether ``state`` is a ``Stateful`` object, or a dict with one as a top-level value."""
    return is_stateful(state) or (
        isinstance(state, dict) and any(is_stateful(v) for v in state.values())
    )


def expand_stateful(state: Any) -> Any:
    """``state`` with each top-level ``Stateful`` value replaced by its ``state_dict()`` (a new
    dict; ``state`` itself is not changed); a ``Stateful`` ``state`` itself (``save(model)``,
    as ``load(into=model)`` takes it) by its ``state_dict()``. Anything else is returned as it
    is."""
    if is_stateful(state):
        return _state_dict_of(state, "state")
    if not has_stateful(state):
        return state
    return {
        k: _state_dict_of(v, f"state[{k!r}]") if is_stateful(v) else v for k, v in state.items()
    }


def _state_dict_of(obj: Any, path: str) -> Any:
    sd = obj.state_dict()
    if is_stateful(sd):
        raise UnsupportedObject(
            f"{path}.state_dict() returned another stateful object "
            f"({type(sd).__qualname__}); it must return a dict of tensors and plain values"
        )
    return sd


def load_stateful(into: Any, load: Callable[[], Any], *, strict: bool = True) -> Any:
    """Load the checkpoint (``load()``, no target) into ``into``: a ``Stateful`` object (a
    module, an optimizer: ``load(into=model)``), or a dict whose ``Stateful`` values get their
    part through ``load_state_dict()`` while the other values are restored in place as
    ``load(into=)`` does (:func:`~tierckpt.restore.restore_into`). Returns ``into``.

    Everything is checked before anything is handed over (:func:`~tierckpt.restore.check_into`,
    raising :class:`StateMismatch`): a module's part against its
    ``state_dict()`` (keys as ``strict`` asks, shapes, dtypes), so a failed load never leaves a
    model half overwritten, and says why as a ``StateMismatch``, not as torch's error.
    ``strict=False``: top-level keys and a module's keys held by one side only are left
    as they are. The stateful parts are loaded into fresh tensors, not into
    ``obj.state_dict()``: a fresh optimizer's ``state_dict()`` has no state yet, and
    ``load_state_dict()`` is what knows how to take one in (moving tensors to the parameters'
    devices, casting)."""
    loaded = load()
    if is_stateful(into):
        log_skipped(_check_part(into, loaded, "<root>", strict))
        _hand_over([(into, loaded, "<root>")], strict)
        return into
    if not isinstance(loaded, dict):
        raise StateMismatch(f"<root>: target is a dict, checkpoint a {type(loaded).__name__}")
    missing = [k for k in into if k not in loaded]
    extra = [k for k in loaded if k not in into]
    shared = len(missing) < len(into)
    if (missing or extra) and (strict or not shared):
        raise StateMismatch(
            f"<root>: keys differ — missing from checkpoint: {missing[:10]}, "
            f"not in target: {extra[:10]}" + key_hint(list(into), list(loaded), shared)
        )
    both = [k for k in into if k in loaded]
    skipped = [f"<root>[{k!r}]" for k in missing + extra]
    for k in both:  # all of it checked before anything is handed over
        check = _check_part if is_stateful(into[k]) else check_into
        skipped += check(into[k], loaded[k], f"<root>[{k!r}]", strict)
    log_skipped(skipped)
    _hand_over(
        [(into[k], loaded[k], f"<root>[{k!r}]") for k in both if is_stateful(into[k])], strict
    )
    for k in both:
        v = into[k]
        if not is_stateful(v):
            new = restore_into(v, loaded[k], f"<root>[{k!r}]", strict=strict)
            if new is not v:
                into[k] = new
    return into


def _check_part(obj: Any, part: Any, path: str, strict: bool) -> list[str]:
    """``part`` of the checkpoint can be handed to ``obj.load_state_dict()``: a dict, and for a
    module one that matches its ``state_dict()`` (keys, shapes, dtypes). Returns the keys
    ``strict=False`` leaves as they are."""
    if not isinstance(part, dict):
        raise StateMismatch(
            f"{path}: the checkpoint holds a {type(part).__name__} for this "
            f"{type(obj).__name__}, whose load_state_dict() takes a dict"
        )
    if isinstance(obj, torch.nn.Module):
        return check_into(obj.state_dict(), part, path, strict)
    return []


def _hand_over(parts: list[tuple[Any, Any, str]], strict: bool) -> None:
    """``obj.load_state_dict(part)`` for each part. Only a module's part is checked whole
    beforehand; an optimizer's ``load_state_dict()`` may still refuse its part (other
    parameter groups, another optimizer's state) after a first one took its own, or after it
    took half of it (Adam's ``__setstate__`` raising on SGD's state). So the other parts go
    first, each with what it held before kept, and where one refuses, every part handed over
    is put back and the error says which part refused; the modules go last."""
    modules = [p for p in parts if isinstance(p[0], torch.nn.Module)]
    done: list[tuple[Any, Any, str]] = []
    for obj, part, path in [p for p in parts if p not in modules] + modules:
        module = isinstance(obj, torch.nn.Module)
        before = None if module else _held(obj)
        try:
            obj.load_state_dict(part, strict=strict) if module else obj.load_state_dict(part)
        except Exception as exc:
            done.append((obj, before, path))
            kept = _put_back(done)
            raise StateMismatch(
                f"{path}: {type(obj).__name__}.load_state_dict() refused the checkpoint's part "
                f"({type(exc).__name__}: {exc}); "
                + (
                    "nothing of the state was changed (the parts handed over were put back)"
                    if not kept
                    else f"not put back as they were: {kept}"
                )
                + (
                    ". An optimizer must be built as the one saved (its parameter groups and "
                    "type); to start it afresh, leave it out of into= and pass strict=False"
                    if isinstance(obj, torch.optim.Optimizer)
                    else ""
                )
            ) from exc
        done.append((obj, before, path))  # a module's (None): cannot be put back


def _held(obj: Any) -> Any:
    """What ``obj`` holds now, to put back if a later part is refused: an optimizer's
    ``state_dict()`` as it is (``load_state_dict()`` replaces its state, never writes into
    it), another object's as a deep copy; None where it cannot be copied."""
    held = obj.state_dict()
    if isinstance(obj, torch.optim.Optimizer):
        return held
    try:
        return copy.deepcopy(held)
    except Exception:
        return None


def _put_back(done: list[tuple[Any, Any, str]]) -> list[str]:
    """Hand each object what it held before; the paths where that failed."""
    failed = []
    for obj, before, path in reversed(done):
        try:
            if before is None:
                raise ValueError("no copy")
            obj.load_state_dict(before)
        except Exception:
            failed.append(path)
    return failed
