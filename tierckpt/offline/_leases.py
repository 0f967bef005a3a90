"""Writer leases of a tier: who holds them, whether that writer is alive, and breaking a dead
one's."""

from __future__ import annotations

from dataclasses import dataclass

from tierckpt.backends.base import Backend
from tierckpt.errors import WriterConflict
from tierckpt.lease import LeaseRecord, judge_holder, lease_name, list_leases


# -- writer leases -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """One writer lease on a location (``leases/rank-<r>.json``) and whether its owner looks
    alive from here; an unreadable lease object counts as alive (nobody can tell).

    ``presumed``: alive only by the lease's age (its holder runs on another machine, or names
    no process or lock file this machine can ask): dead or not, it counts as live until its
    ttl has passed. Otherwise a live verdict is *known*: its process (or a process holding its
    lock file) runs on this machine (:attr:`known_live`)."""

    rank: int
    record: LeaseRecord | None
    alive: bool
    why: str
    presumed: bool = False

    @property
    def known_live(self) -> bool:
        """Whether this machine saw the holder run: its process, or its lock file held."""
        return self.alive and not self.presumed and self.record is not None

    def describe(self) -> str:
        if self.record is None:
            return f"an unreadable lease ({self.why})"
        state = "dead"
        if self.alive:
            state = "presumed live by its lease's age" if self.presumed else "live"
        return f"{self.record.describe()}; {state}: {self.why}"


def leases(backend: Backend) -> list[LeaseInfo]:
    """The writer leases on ``backend``, by rank."""
    out = []
    for rank, rec, error in list_leases(backend):
        if rec is None:
            out.append(LeaseInfo(rank, None, True, error))
            continue
        alive, why, presumed = judge_holder(backend, lease_name(rank), rec)
        out.append(LeaseInfo(rank, rec, alive, why, presumed=presumed))
    return out


def unlock(backend: Backend, rank: int | None = None, *, force: bool = False) -> list[LeaseInfo]:
    """Remove the writer lease of ``rank`` (every rank's if None) and return what was removed.

    For a writer that died on another machine, so a new job need not wait for the lease's
    ttl: a holder presumed live only by its lease's age is unlocked. A holder this machine
    knows is live (its process runs here, or a process holds its lock file) is refused with
    :class:`WriterConflict`, nothing removed, unless ``force``: a writer still running loses
    the location at its next lease check, and its later saves on that tier fail.
    """
    found = leases(backend)
    if rank is not None:
        found = [info for info in found if info.rank == rank]
    live = [info for info in found if info.known_live]
    if live and not force:
        first = live[0]
        others = f" (and {len(live) - 1} more rank(s))" if len(live) > 1 else ""
        raise WriterConflict(
            f"{backend.url}: rank {first.rank}'s writer lease is held by a live writer: "
            f"{first.describe()}{others}. Removing it would make that job fail on this tier "
            "at every save until it ends; nothing was removed. Stop that job first, or pass "
            "--force (force=True) to take the lease from it anyway",
            url=backend.url,
            holder=first.record,
        )
    for info in found:
        backend.delete(lease_name(info.rank))
    return found
