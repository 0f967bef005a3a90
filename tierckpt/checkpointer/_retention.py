"""What retention must keep beyond each tier's rules, for :class:`~tierckpt.Checkpointer`:
the steps integrations protect (``protect_steps``) and the checkpoint a ``pin(step)`` names.
The pin markers and the rules themselves are :mod:`tierckpt.retention`'s."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager

from tierckpt.errors import BackendError, CheckpointNotFound
from tierckpt.format import CheckpointId
from tierckpt.pipeline import SaveJob

__all__ = ["Protectors", "pin_target"]


class Protectors:
    """The callables that name steps retention must keep on every tier (``protect_steps``).

    Added and removed from any thread; asked on the pipeline's commit threads. A retention
    pass asks again right before each deletion (:meth:`deleting`), and a load that names a
    step it reads (:meth:`reading`) while that step's deletion is under way waits for it to
    end: a step named before its deletion begins is never deleted, whatever the pass chose
    before. Only a load of the step being deleted waits; other tiers' passes and other
    loads never wait for a deletion (a hung store's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deleted = threading.Condition(self._lock)
        self._fns: list[Callable[[], Iterable[int]]] = []
        #: step -> how many deletions of a checkpoint of that step are under way
        self._deleting: Counter[int] = Counter()

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
        this process's retention from its return on (it first waits for a deletion of one
        of them that is under way); ``remove()`` ends it."""
        held: set[int] = set()

        def named() -> tuple[int, ...]:
            with self._lock:
                return tuple(held)

        def hold(steps: Iterable[int]) -> None:
            wanted = set(steps)
            with self._lock:
                while any(self._deleting[s] for s in wanted):
                    self._deleted.wait()
                held.update(wanted)

        return hold, self.add(named)

    @contextmanager
    def deleting(self, cid: CheckpointId) -> Iterator[bool]:
        """Around the deletion of ``cid``: yields True when its step is protected now (the
        pass must keep it after all). ``BackendError`` as :meth:`steps`."""
        with self._lock:
            self._deleting[cid.step] += 1
        try:
            yield cid.step in self.steps()  # asked once the step is marked: no load slips by
        finally:
            with self._lock:
                self._deleting[cid.step] -= 1
                if not self._deleting[cid.step]:
                    del self._deleting[cid.step]
                self._deleted.notify_all()


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
