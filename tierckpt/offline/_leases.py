"""Writer leases of a tier: who holds them, whether that writer is alive, and breaking a dead
one's."""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.backends.base import Backend
from tierckpt.lease import LeaseRecord, judge_owner, lease_name, list_leases


# -- writer leases -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """One writer lease on a location (``leases/rank-<r>.json``) and whether its owner looks
    alive from here; an unreadable lease object counts as alive (nobody can tell)."""

    rank: int
    record: LeaseRecord | None
    alive: bool
    why: str

    def describe(self) -> str:
        if self.record is None:
            return f"an unreadable lease ({self.why})"
        return f"{self.record.describe()}; {'live' if self.alive else 'dead'}: {self.why}"


def leases(backend: Backend) -> list[LeaseInfo]:
    """The writer leases on ``backend``, by rank."""
    out = []
    for rank, rec, error in list_leases(backend):
        if rec is None:
            out.append(LeaseInfo(rank, None, True, error))
        else:
            alive, why = judge_owner(backend, lease_name(rank), rec)
            out.append(LeaseInfo(rank, rec, alive, why))
    return out


def unlock(backend: Backend, rank: int | None = None) -> list[LeaseInfo]:
    """Remove the writer lease of ``rank`` (every rank's if None) and return what was removed.

    For a writer that died on another machine, so a new job need not wait for the lease's
    ttl. A writer still running loses the location at its next lease check: it stops writing
    and deleting there, and its later saves on that tier fail.
    """
    found = leases(backend)
    if rank is not None:
        found = [info for info in found if info.rank == rank]
    for info in found:
        backend.delete(lease_name(info.rank))
    return found
