"""The saves of one ``TierWriter``: each ``dcp.save`` / ``dcp.async_save`` is a
:class:`SaveState` of its own, from its ``reset()`` (or its first call) to its commit.

DCP makes every call of one save on one thread: ``dcp.save``'s caller, or the background
thread (or process) of ``dcp.async_save``. So the save a call belongs to is the one in progress
on the calling thread, and two ``async_save`` calls in flight on one reused writer each keep
their own step, save id, plan and job however DCP's threads interleave; nothing of a save is
read back from the writer object, which only holds what every save shares (the pipeline, the
leases, the timeline).

Every value a save hands from one rank to another (the local plans, the coordinator's plans,
the ranks' shard reports) carries its step and save id, and each is checked against the save
receiving it: a save whose DCP collectives were matched with another save's (two
``async_save`` calls on one process group whose ranks issued them in different orders) fails
on every rank instead of mixing the two checkpoints.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from tierckpt.dcp._metadata import _PlanInfo
from tierckpt.errors import TierCkptError
from tierckpt.format import CheckpointId
from tierckpt.pipeline import SaveJob

#: how far DCP got with a save on this rank (the order of its calls)
RESET, META, SETUP, LOCAL, GLOBAL, WRITTEN = range(6)


@dataclass(eq=False)
class SaveState:
    """One save of a writer on this rank: what its calls read, and nothing another save sets."""

    step: int | None
    save_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    thread: threading.Thread = field(default_factory=threading.current_thread)
    stage: int = RESET
    rank: int = 0
    is_coordinator: bool = True
    #: the coordinator's: the checkpoint it chose (set in prepare_global_plan)
    cid: CheckpointId | None = None
    #: this rank's plan info (write_data): the coordinator's save id and timeline
    info: _PlanInfo | None = None
    #: this rank's job in the pipeline (its commit protects the other saves in flight)
    job: SaveJob | None = None
    #: counted in the writer's saves in flight (``_in_save``, see ``take_over``)
    counted: bool = False
    #: this rank held no lease before this save took its own (given back if it is refused)
    fresh_leases: bool = False
    ended: bool = False


@dataclass(frozen=True, slots=True)
class LocalPlanInfo:
    """What each rank's local plan tells the coordinator: the step it saves, and why its
    leases were refused (another live writer holds the location) if they were."""

    step: int
    refused: str | None = None


class Saves:
    """The saves of one writer in this process, and the one of each thread. ``on_end`` is
    called once for each save that ends: committed, failed in the writer, replaced by the next
    save of its thread, or left by a thread that ended (DCP failed it elsewhere)."""

    def __init__(self, on_end: Callable[[SaveState], None]) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()
        self._open: list[SaveState] = []
        # weakly (a writer's bound method): the writer must stay free of reference cycles, so
        # that a writer dropped after dcp.save is collected, and parks its pipeline, at once
        self._on_end = weakref.WeakMethod(on_end)  # type: ignore[arg-type]

    def begin(self, step: int | None) -> SaveState:
        """A new save on this thread (``reset()``, or DCP's first call when it made none):
        the thread's previous save is over (a thread makes one save at a time)."""
        s = SaveState(step)
        old: SaveState | None = getattr(self._local, "save", None)
        self._local.save = s
        self._close([old] if old is not None else [], add=s)
        return s

    def current(self, step: int | None, since: int, until: int) -> SaveState:
        """This thread's save if DCP's calls for it got from stage ``since`` to ``until``
        (a call that comes after them), else a new save of ``step``: a save made without
        ``reset()`` (no ``checkpoint_id``) starts at its first call."""
        s: SaveState | None = getattr(self._local, "save", None)
        if s is None or s.ended or not since <= s.stage <= until:
            return self.begin(step)
        return s

    def of_thread(self, first: int, what: str) -> SaveState:
        """This thread's save, which DCP's calls must have taken to stage ``first`` or later."""
        s: SaveState | None = getattr(self._local, "save", None)
        if s is None or s.ended or s.stage < first:
            raise TierCkptError(f"TierWriter.{what} called without the calls of its save before")
        return s

    def end(self, s: SaveState) -> None:
        """``s`` is over on this rank (committed, failed, or this rank's part done)."""
        self._close([s])

    def others(self, s: SaveState | None) -> list[SaveState]:
        """The saves in progress in this process besides ``s``."""
        self._close([])
        with self._lock:
            return [o for o in self._open if o is not s]

    def steps(self) -> frozenset[int]:
        """The steps of the saves in progress (retention keeps them; see ``_protected_steps``)."""
        return frozenset(o.step for o in self.others(None) if o.step is not None)

    def _close(self, done: list[SaveState], add: SaveState | None = None) -> None:
        """End ``done`` and the saves whose thread ended; ``on_end`` each, outside the lock."""
        with self._lock:
            ended = [o for o in self._open if o in done or not o.thread.is_alive()]
            ended += [o for o in done if not o.ended and o not in ended]
            for o in ended:
                o.ended = True
            self._open = [o for o in self._open if not o.ended]
            if add is not None:
                self._open.append(add)
        on_end = self._on_end()
        for o in ended:
            if on_end is not None:
                on_end(o)


def need_step(step: int | None) -> int:
    if step is None:
        raise ValueError("TierWriter needs a step: TierWriter(tiers, step) or checkpoint_id")
    return step


def mixed(what: str, got: object, want: object) -> TierCkptError:
    """A value of another save reached this one through DCP's collectives."""
    return TierCkptError(
        f"TierWriter: {what} of another save ({got}) reached the save of {want}: two saves "
        "overlap on one process group and DCP matched their collectives across ranks. Nothing "
        "of this save is committed. Give each dcp.async_save in flight its own process group "
        "(dist.new_group(backend='gloo')), or wait for one save's future before the next"
    )
