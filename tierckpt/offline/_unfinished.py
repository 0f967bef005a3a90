"""Whose are a tier's unfinished writes: a killed writer's, a live one's, or nobody can tell.

gc's sweep removes the unfinished writes that the store proves dead
(:meth:`~tierckpt.backends.base.Backend.remove_dead_incomplete`: on a local file system, a
temporary file no process holds the ``flock`` of), whatever the step they are of: a save
newer than the newest checkpoint that a killed writer left goes with them. :func:`unfinished`
asks the same question without removing anything — the test that a ``gc --dry-run`` and the
``inspect`` / ``verify`` hints use, so that they say what a real gc does
(:mod:`tierckpt.backends._templock`: a shared lock tried and at once dropped, where the sweep
takes an exclusive one and removes the file).
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

from tierckpt.backends import _templock
from tierckpt.backends.base import Backend
from tierckpt.format import CheckpointId, parse_data_folder


@dataclass(frozen=True, slots=True)
class Unfinished:
    """The unfinished writes (temporary files, open uploads) of one checkpoint's folder."""

    #: temporaries no process holds: their writer was killed; every gc removes them
    dead: int = 0
    #: temporaries a live writer holds (a save in progress): never removed while it lives
    live: int = 0
    #: unfinished writes whose writer the store cannot judge (an object store's open uploads,
    #: a network file system): only ``gc --abort-incomplete`` removes them
    unknown: int = 0

    @property
    def all_dead(self) -> bool:
        """Whether gc removes every one of them (there is at least one)."""
        return self.dead > 0 and not self.live and not self.unknown


#: no unfinished write
NONE = Unfinished()


def judges_writers(backend: Backend) -> bool:
    """Whether ``backend``'s store can tell a killed writer's unfinished write (its
    :meth:`~tierckpt.backends.base.Backend.remove_dead_incomplete` removes something): a
    folder on this machine's file system (the local and node-RAM tiers)."""
    # unwrapped: the object-store backend wraps the base's (tierckpt.backends.objstore)
    own = inspect.unwrap(type(backend).remove_dead_incomplete)
    if own is Backend.remove_dead_incomplete:
        return False
    return backend.local_path("x") is not None


def unfinished(backend: Backend, names: list[str] | None = None) -> dict[CheckpointId, Unfinished]:
    """The unfinished writes of each checkpoint's data folder (``names``: those of
    ``backend.incomplete("")``, listed by the caller), judged as gc's sweep judges them, read
    only: nothing is removed or kept locked."""
    names = backend.incomplete("") if names is None else names
    judge = judges_writers(backend)
    out: dict[CheckpointId, Unfinished] = {}
    for name in names:
        cid = parse_data_folder(name)
        if cid is None:
            continue
        dead, live, unknown = _judge(backend, name) if judge else (0, 0, 1)
        had = out.get(cid, Unfinished())
        out[cid] = Unfinished(had.dead + dead, had.live + live, had.unknown + unknown)
    return out


def _judge(backend: Backend, name: str) -> tuple[int, int, int]:
    """(dead, live, unknown) temporaries of ``name``, as the sweep judges them, read only."""
    path = backend.local_path(name)
    if path is None:
        return 0, 0, 1
    folder, _, target = path.rpartition(os.sep)
    return _templock.judge_temps(folder, target, remove=False)
