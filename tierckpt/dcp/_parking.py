"""The process-wide registry of DCP writers: the newest writer of a location takes it over
from older idle ones, and a writer dropped without ``close()`` (DCP's idiom: a new writer per
``dcp.save``) parks its warm pipeline for the next writer of the same tiers and settings.

Kept apart from :mod:`tierckpt.dcp._writer` (which implements DCP's protocol): this module
sees a writer only through :class:`ParkingWriter`, the few attributes it hands over.
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from tierckpt.errors import TierCkptError
from tierckpt.pipeline import Pipeline, Tier

log = logging.getLogger("tierckpt")


class ParkingWriter(Protocol):
    """What the registry reads and sets on a writer (``tierckpt.dcp.TierWriter``)."""

    _tiers: list[Tier]
    _pipeline: Pipeline | None
    _hook: HookTarget | None
    _closed: bool
    #: saves of the writer between their shard and their commit (overlapping saves: several)
    _in_save: int
    _taken_over: bool

    def _config(self) -> tuple[Any, ...]: ...

    def close(self) -> None: ...


class HookTarget:
    """The writer a pipeline's commit hook reports to (weakly: the pipeline must not keep its
    writer alive), moved to the next writer when a parked pipeline is adopted."""

    __slots__ = ("ref",)

    def __init__(self, writer: ParkingWriter) -> None:
        self.ref: weakref.ref[Any] = weakref.ref(writer)


@dataclass(eq=False)
class Parked:
    """A warm pipeline of a dropped writer, waiting for the next writer of its tiers."""

    config: tuple[Any, ...]
    urls: set[str]
    pipeline: Pipeline | None
    tiers: list[Tier]
    target: HookTarget
    #: close the pipeline (False: only the backends, the pipeline lives on adopted)
    owns_pipeline: bool = True

    def close(self) -> None:
        if self.owns_pipeline and self.pipeline is not None:
            self.pipeline.close(close_backends=True)  # each tier's, once its thread ended
            return
        for t in self.tiers:
            t.backend.close()


#: the newest live writer of this process per tier location (backend URL; see take_over)
LOCATIONS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
#: reentrant: dropping the last reference to a writer under it runs __del__ (park) there
LOCATIONS_LOCK = threading.RLock()
#: parked pipelines, oldest first; a few at most (each holds threads, a host buffer, leases)
PARKED: list[Parked] = []
MAX_PARKED = 2


def take_over(w: ParkingWriter) -> None:
    """Take ``w``'s locations over from older, idle writers of this process, and adopt a
    pipeline parked for its tiers and settings (see ``TierWriter._take_over``). Once it
    returns, the save that called it counts in ``w._in_save`` until :func:`save_ended`."""
    olds: list[ParkingWriter] = []
    stale: list[Parked] = []
    urls = {t.backend.url for t in w._tiers}
    with LOCATIONS_LOCK:
        if w._taken_over:
            raise TierCkptError(
                "this TierWriter was closed: a newer TierWriter of this process took its "
                "location over (save through the newest writer)"
            )
        w._in_save += 1  # until save_ended(w)
        for p in list(PARKED):
            if not urls & p.urls:
                continue
            PARKED.remove(p)
            if w._pipeline is None and p.config == w._config():
                fresh, w._tiers, w._pipeline = w._tiers, p.tiers, p.pipeline
                p.target.ref = weakref.ref(w)
                w._hook = p.target
                stale.append(Parked(p.config, set(), p.pipeline, fresh, p.target, False))
            else:
                stale.append(p)
        for t in w._tiers:
            old = LOCATIONS.get(t.backend.url)
            if old is not None and old is not w and not old._closed:
                if old._in_save:
                    continue  # a concurrent save: its lease refuses this writer
                old._taken_over = True
                if old not in olds:
                    olds.append(old)
            LOCATIONS[t.backend.url] = w
    try:
        for old in olds:
            log.info("a newer TierWriter of this process takes over; closing the older one")
            old.close()
        for p in stale:
            p.close()
    except BaseException:
        save_ended(w)  # counted only when this returns
        raise


def save_ended(w: ParkingWriter) -> None:
    """A save of ``w`` counted by :func:`take_over` is over (committed or failed)."""
    with LOCATIONS_LOCK:
        w._in_save -= 1


def park(w: ParkingWriter) -> bool:
    """Park ``w``'s idle pipeline (``w`` is being collected); False: not parked, close it."""
    pipeline, target = w._pipeline, w._hook
    if pipeline is None or target is None or w._in_save or w._taken_over or pipeline.in_flight():
        return False
    evicted: list[Parked] = []
    with LOCATIONS_LOCK:
        PARKED.append(
            Parked(w._config(), {t.backend.url for t in w._tiers}, pipeline, w._tiers, target)
        )
        while len(PARKED) > MAX_PARKED:
            evicted.append(PARKED.pop(0))
    w._pipeline = None
    w._closed = True
    for p in evicted:
        p.close()
    return True
