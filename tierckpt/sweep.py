"""What this process knows of each tier's leftovers, for :func:`tierckpt.retention.gc_tier`:
whether it swept them since it started writing there or since one of its saves there failed
(:func:`note_failed_save`), and one retention pass's listings (:class:`Listing`), each made at
most once per pass and only when needed. The rule itself is in :mod:`tierckpt.retention`."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

from tierckpt.backends.base import Backend
from tierckpt.format import CheckpointId, parse_data_folder

__all__ = ["SWEEP_LOCK", "Listing", "SweepState", "note_failed_save", "sweep_state"]


class Listing:
    """One pass's listings of a tier, each made at most once and only when first needed: every
    object, every unfinished write (temporary file, open multipart upload)."""

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._objects: list[str] | None = None
        self._uploads: list[str] | None = None

    def objects(self) -> list[str]:
        if self._objects is None:
            self._objects = self._backend.list("")
        return self._objects

    def uploads(self) -> list[str]:
        if self._uploads is None:
            self._uploads = self._backend.incomplete("")
        return self._uploads

    def data_ids(self, uploads: bool = True) -> list[CheckpointId]:
        """As :func:`tierckpt.catalog.data_ids`, from these listings (``uploads``: also
        folders that hold only unfinished uploads)."""
        names = [*self.objects(), *(self.uploads() if uploads else ())]
        found = (parse_data_folder(n) for n in names)
        return sorted({cid for cid in found if cid is not None})


@dataclass(slots=True)
class SweepState:
    """What this process knows of one backend's leftovers."""

    #: a sweep since this process's last failed save there found nothing it had to spare
    clean: bool = False
    #: failed saves noted so far (a sweep that ran across one does not count as clean)
    failures: int = 0
    #: committed checkpoints a sweep saw unfinished uploads under (removed with them)
    stale: set[CheckpointId] = field(default_factory=set)
    #: checkpoints the last retention pass kept when it removed none (else 0): with many, the
    #: next pass asks the manifests alone first
    kept_all: int = 0


_SWEEPS: weakref.WeakKeyDictionary[Backend, SweepState] = weakref.WeakKeyDictionary()
#: guards every :class:`SweepState` (failures are noted from any pipeline thread)
SWEEP_LOCK = threading.Lock()


def sweep_state(backend: Backend) -> SweepState:
    """``backend``'s state, made on first use (forgotten with the backend object). A backend
    that cannot be remembered (a test double without hash or weak reference) gets a new,
    unswept one each time: every pass then sweeps, as before this state existed."""
    with SWEEP_LOCK:
        try:
            state = _SWEEPS.get(backend)
            if state is None:
                state = _SWEEPS[backend] = SweepState()
        except TypeError:
            return SweepState()
        return state


def note_failed_save(backend: Backend) -> None:
    """A save of this process on ``backend`` failed or was abandoned (its abort may have left
    files or uploads behind): the next ``gc_tier(..., sweep=None)`` there sweeps fully."""
    state = sweep_state(backend)
    with SWEEP_LOCK:
        state.clean = False
        state.failures += 1
