"""What ``guard()`` tells ``save()``: which tensors may be captured lazily, which are copied at
``save()`` (see :mod:`tierckpt.snapshot`), and the one-time warnings when that copy looks like
parameters that should have stayed lazy."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from tierckpt.handle import SaveHandle
from tierckpt.snapshot import EAGER_WARN_BYTES, LazySources, Snapshot, snapshot_eager

__all__ = ["GuardedSources", "as_modules", "watch_unguarded"]

log = logging.getLogger("tierckpt")


class GuardedSources:
    """The optimizers and modules ``guard()`` named (held weakly) and the warnings given."""

    def __init__(self) -> None:
        #: what guard() named: its tensors are captured lazily, the rest copied at save()
        self._lazy = LazySources()
        self._warned: set[str] = set()

    @property
    def guarded(self) -> bool:
        """Whether ``guard()`` (or an integration) named an optimizer or a module."""
        return self._lazy.guarded

    def learn(
        self, optimizer: torch.optim.Optimizer | None, modules: Sequence[torch.nn.Module] = ()
    ) -> None:
        """Add what ``guard(optimizer, model)`` named."""
        self._lazy.add(optimizer, modules)

    def snapshot(
        self,
        tensors: list[torch.Tensor],
        handle: SaveHandle,
        copies: list[int] | None = None,
        state: Any = None,
    ) -> list[torch.Tensor]:
        """Copy what the next forward pass may write (see :mod:`tierckpt.snapshot`).
        ``copies``: indices of tensors that are private copies already (NumPy arrays).
        ``state``: what was saved (modules as their state_dict()), asked whether it holds a
        module's state, the only state a forward pass writes."""
        if not self._lazy.guarded:
            # nothing tells parameters from buffers: copying all would copy the model at
            # every save, so the whole state stays lazy, as the caller's wait_captured() implies
            if (
                "no-guard" not in self._warned
                and len(tensors) > len(copies or ())
                and holds_module_state(state)
            ):
                self._warn_once(
                    "no-guard",
                    "save() without guard(): tierckpt cannot tell parameters from buffers, so "
                    "the whole state is captured lazily and must not change until "
                    "wait_captured() returns (every optimizer's step() waits for it) — but the "
                    "next forward pass writes module buffers (BatchNorm statistics, counters), "
                    "which may then be saved with their values from after save(). Call "
                    "ck.guard(optimizer, model) once: buffers are then copied at save(), "
                    "parameters and optimizer state captured lazily",
                )
            return tensors
        snap = snapshot_eager(tensors, self._lazy.storages(), copies)
        handle.eager_bytes = snap.eager_bytes
        self._warn_eager(snap)
        return snap.tensors

    def _warn_eager(self, snap: Snapshot) -> None:
        """Say, once each, when save() copied what may be parameters, and what to pass."""
        mib = snap.eager_bytes / 2**20
        large = snap.eager_bytes > EAGER_WARN_BYTES
        if not self._lazy.has_modules:
            if large:
                self._warn_once(
                    "optimizer-only-large",
                    f"guard(optimizer) without the model: {mib:.0f} MiB of tensors that are not "
                    "in the optimizer were copied at save() — frozen parameters are being "
                    "copied eagerly at every save. ck.guard(optimizer, model) keeps them lazy",
                )
            elif snap.eager_tensors:
                self._warn_once(
                    "optimizer-only",
                    f"guard(optimizer) without the model: {snap.eager_tensors} tensors "
                    f"({mib:.1f} MiB) of the state are neither optimizer parameters nor "
                    "optimizer state, so they were copied at save() (needed for buffers that "
                    "forward writes, needless for frozen parameters). Pass the model, "
                    "ck.guard(optimizer, model), so frozen parameters are captured lazily",
                )
        elif large:
            self._warn_once(
                "large",
                f"{mib:.0f} MiB of tensors that are neither parameters of a guarded module nor "
                "optimizer state were copied at save() (module buffers and loose tensors are). "
                "If they change only in optimizer.step() (another model's weights), pass "
                "their module too: ck.guard(optimizer, [model, other])",
            )

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)


#: how deep :func:`holds_module_state` looks into nested containers
MODULE_STATE_DEPTH = 3


def holds_module_state(state: Any, depth: int = MODULE_STATE_DEPTH) -> bool:
    """Whether ``state`` holds a module's ``state_dict()`` (which carries ``_metadata``: a
    forward pass writes its buffers) within ``depth`` levels of containers; a plain dict of
    tensors does not, and gets no warning about buffers."""
    if isinstance(state, Mapping):
        if hasattr(state, "_metadata"):
            return True
        values: Iterable[Any] = state.values()
    elif isinstance(state, (list, tuple)):
        values = state
    else:
        return False
    return depth > 0 and any(
        holds_module_state(v, depth - 1) for v in values if isinstance(v, (Mapping, list, tuple))
    )


def as_modules(
    model: torch.nn.Module | Sequence[torch.nn.Module] | None,
) -> list[torch.nn.Module]:
    if model is None:
        return []
    try:
        modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    except TypeError:
        modules = [model]  # type: ignore[list-item]  # refused below with a clear message
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"guard(optimizer, model): model must be a torch.nn.Module or a list of them, "
                f"got {type(m).__qualname__} (pass the module, not its parameters)"
            )
    return modules


class _Unguarded(Protocol):
    def _wait_unguarded(self) -> None: ...


#: writers whose saves were captured lazily without ``guard()`` (held weakly)
_UNGUARDED: weakref.WeakSet[Any] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hook: Any = None


def watch_unguarded(owner: _Unguarded) -> None:
    """``owner`` saved without ``guard()``: from now on every optimizer's ``step()`` in this
    process first waits for ``owner``'s pending captures (``owner._wait_unguarded()``). The
    step is what changes parameters and optimizer state in place; without this, a
    ``torch.save``-style loop (save, then step at once) raced the lazy copy, and a committed
    checkpoint could mix two steps or fail its own checksums. One process-wide hook
    (``register_optimizer_step_pre_hook``), installed at the first such save; a step with
    nothing pending costs a pass over a (usually one-element) weak set."""
    global _hook
    _UNGUARDED.add(owner)
    if _hook is None:
        with _hook_lock:
            if _hook is None:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                _hook = register_optimizer_step_pre_hook(_before_any_step)


def _before_any_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
    for owner in list(_UNGUARDED):
        owner._wait_unguarded()
