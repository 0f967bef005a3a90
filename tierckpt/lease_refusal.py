"""What a writer is told when another holds its lease (:mod:`tierckpt.lease`): the
:class:`~tierckpt.WriterConflict` of a holder known live, of one only presumed live (its
lease's age), and of an object at the lease's name that is no lease tierckpt can read."""

from __future__ import annotations

from tierckpt.errors import WriterConflict
from tierckpt.liveness import LeaseRecord

__all__ = ["held_lease", "unreadable_lease"]


def held_lease(
    where: str,
    rank: int,
    name: str,
    rec: LeaseRecord,
    why: str,
    presumed: bool,
    tier: str,
    url: str,
    hint: str,
) -> WriterConflict:
    """The refusal of rank ``rank``'s lease ``name`` on ``where``, held by ``rec``'s writer,
    live for ``why``; ``presumed``: by its lease's age alone (save() does not raise it)."""
    if not presumed:
        return WriterConflict(
            f"{where} already has a writer: rank {rank}'s lease {name} is held by "
            f"{rec.describe()}, and {why}. Two writers on one location would overwrite each "
            f"other's checkpoints, so this save wrote nothing. {hint}",
            tier=tier,
            url=url,
            holder=rec,
        )
    return WriterConflict(
        f"{where}: rank {rank}'s lease {name} is held by {rec.describe()}, and {why}. This "
        "writer cannot tell whether that job still runs (a job restarted on another node or in "
        "a new container finds its own dead predecessor's lease so): its copies there are "
        "skipped, nothing written, until the lease expires, then it takes the location over; "
        f"if the lease is renewed meanwhile, that job runs and save() raises. {hint}",
        tier=tier,
        url=url,
        holder=rec,
        presumed=True,
    )


def unreadable_lease(
    where: str,
    name: str,
    exc: BaseException,
    age: float | None,
    ttl: float,
    changed: bool,
    tier: str,
    url: str,
    hint: str,
) -> WriterConflict:
    """The refusal of an object at lease ``name`` that is no lease tierckpt can read
    (``exc``), which the store wrote ``age`` seconds ago (None: it keeps no times);
    ``changed``: its bytes changed while this writer watched (a writer renews it)."""
    if changed:
        return WriterConflict(
            f"{where}: {name} is not a lease tierckpt can read ({exc}), and it changed while "
            "this writer watched: another writer (a newer tierckpt?) renews it. Two writers on "
            f"one location would overwrite each other's checkpoints, so this save wrote "
            f"nothing. {hint}",
            tier=tier,
            url=url,
        )
    when = (
        "the store keeps no modification times, so it is not taken over by its age"
        if age is None
        else f"the store wrote it {max(age, 0.0):.0f} s ago; it is taken over once that is "
        f"{ttl:.0f} s (the ttl) unless it changes"
    )
    return WriterConflict(
        f"{where}: {name} exists but is not a lease tierckpt can read ({exc}): damaged, or a "
        f"newer tierckpt's; {when}. Until then this tier's copies are skipped, nothing "
        f"written. {hint}",
        tier=tier,
        url=url,
        presumed=True,
    )
