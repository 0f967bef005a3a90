"""What retention must keep beyond each tier's rules, for :class:`~tierckpt.Checkpointer`:
the steps integrations protect (``protect_steps``) and the checkpoint a ``pin(step)`` names.
The pin markers and the rules themselves are :mod:`tierckpt.retention`'s."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager

from tierckpt.errors import BackendError, CheckpointNotFound
from tierckpt.format import CheckpointId
from tierckpt.pipeline import SaveJob

__all__ = ["Protectors", "pin_target"]


class Protectors:
    """The callables that name steps retention must keep on every tier (``protect_steps``).

    Added and removed from any thread; asked on the pipeline's commit threads. A retention
    pass asks again right before each deletion, holding this object's lock through it
    (:meth:`deleting`); a load names the steps it reads under the same lock (:meth:`reading`),
    so a step named before its deletion starts is never deleted, whatever the pass chose
    before."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # held around each deletion (reentrant: steps())
        self._fns: list[Callable[[], Iterable[int]]] = []

    def add(self, fn: Callable[[], Iterable[int]]) -> Callable[[], None]:
        """Ask ``fn`` from now on; returns a function that removes it."""
        with self._lock:
            self._fns.append(fn)

        def remove() -> None:
            with self._lock:
                self._fns[:] = [f for f in self._fns if f is not fn]

        return remove

    def steps(self) -> Collection[int]:
        """Every step some callable protects now. ``BackendError`` when one raises: the
        retention that asked is then skipped rather than guessing."""
        with self._lock:
            fns = list(self._fns)
        steps: set[int] = set()
        for fn in fns:
            try:
                steps.update(int(s) for s in fn())
            except Exception as exc:
                raise BackendError(
                    f"cannot tell which steps {fn!r} protects ({exc}); retention skipped"
                ) from exc
        return steps

    def reading(self) -> tuple[Callable[[Iterable[int]], None], Callable[[], None]]:
        """A load's protection: ``(hold, remove)``. ``hold(steps)`` keeps ``steps`` from
        this process's retention from its return on (it waits for a deletion in progress);
        ``remove()`` ends it."""
        held: set[int] = set()
        remove = self.add(lambda: tuple(held))

        def hold(steps: Iterable[int]) -> None:
            with self._lock:
                held.update(steps)

        return hold, remove

    @contextmanager
    def deleting(self, cid: CheckpointId) -> Iterator[bool]:
        """Held around the deletion of ``cid``: yields True when its step is protected now
        (the pass must keep it after all). ``BackendError`` as :meth:`steps`."""
        with self._lock:
            yield cid.step in self.steps()


def pin_target(
    step: int,
    timeline: int | None,
    *,
    in_flight: Iterable[SaveJob],
    last_saved: CheckpointId | None,
    committed: Callable[[], Sequence[CheckpointId]],
    tier_names: Sequence[str],
) -> CheckpointId:
    """The checkpoint ``pin(step, timeline=...)`` names: that timeline's when given, else the
    save of ``step`` in flight or last started by this checkpointer, else the newest committed
    checkpoint of ``step`` (``committed()``: every committed one, oldest first)."""
    if timeline is not None:
        return CheckpointId(step, timeline)
    for job in in_flight:
        if job.step == step:
            return job.id
    if last_saved is not None and last_saved.step == step:
        return last_saved
    held = [c for c in committed() if c.step == step]
    if not held:
        raise CheckpointNotFound(
            f"cannot pin step {step}: it is neither being saved nor committed on any tier "
            f"({', '.join(tier_names)})"
        )
    return held[-1]
