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

import fcntl
import inspect
import os
from dataclasses import dataclass

from tierckpt.backends import _templock
from tierckpt.backends.base import Backend
from tierckpt.backends.local import TMP_SUFFIX
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
    """(dead, live, unknown) temporaries of ``name``: the twin of
    :func:`~tierckpt.backends._templock.remove_dead_temps` that removes nothing."""
    path = backend.local_path(name)
    if path is None:
        return 0, 0, 1
    folder, _, target = path.rpartition(os.sep)
    try:
        temps = [
            n
            for n in os.listdir(folder)
            if n.endswith(TMP_SUFFIX) and n[: -len(TMP_SUFFIX)].rsplit(".", 1)[0] == target
        ]
    except OSError:
        return 0, 0, 0  # gone meanwhile
    if not temps:
        return 0, 0, 0  # renamed into place or removed meanwhile
    if not _templock.locks_prove_liveness(folder):  # the sweep's own test
        return 0, 0, len(temps)  # a lock here proves nothing: the sweep leaves them
    dead = live = 0
    for temp in temps:
        try:
            fd = os.open(os.path.join(folder, temp), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # renamed into place or removed meanwhile
        try:
            # its writer holds an exclusive lock from its creation until it is renamed or
            # removed: a shared one is refused while it lives (and dropped at once below)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            dead += 1
        except BlockingIOError:
            live += 1
        except OSError:
            live += 1  # the sweep counts what it cannot lock as held
        finally:
            os.close(fd)
    return dead, live, 0
