"""What a writer is told when another holds its lease (:mod:`tierckpt.lease`): the
:class:`~tierckpt.WriterConflict` of a holder known live, of one only presumed live (its
lease's age), of an object at the lease's name that is no lease tierckpt can read, and of
another tier of the same writer (:func:`tier_owner`)."""

from __future__ import annotations

import hashlib
from typing import Protocol

from tierckpt.backends.base import Backend
from tierckpt.errors import LeaseLost, WriterConflict
from tierckpt.liveness import LeaseRecord


class WriterLease(Protocol):
    """What these refusals read of a :class:`tierckpt.lease.WriterLease`."""

    @property
    def owner(self) -> str: ...
    @property
    def where(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def tier(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def backend(self) -> Backend: ...


__all__ = [
    "held_lease",
    "lost_lease",
    "other_tier",
    "tier_owner",
    "unlock_hint",
    "unreadable_lease",
]


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


#: what two tiers of one writer on one location do (the policy compares paths and URLs only)
_ALIAS = (
    "two of its tiers reach this one location: a bind mount or a link, or two names of one "
    "store (localhost and 127.0.0.1). Their shard files and manifests would replace each "
    "other's (a committed checkpoint lost) and each one's retention would delete what the "
    "other keeps"
)


def tier_owner(writer: str, tier: str) -> str:
    """The owner id of ``writer``'s lease on its tier named ``tier``: the writer's id, a dot
    and 8 hex digits of the name, so that two tiers of one writer that reach one location (a
    bind mount, two names of one endpoint: the policy cannot see it) tell each other apart."""
    return f"{writer}.{hashlib.sha256(tier.encode()).hexdigest()[:8]}"


def other_tier(lease: WriterLease, rec: LeaseRecord) -> WriterConflict | None:
    """The refusal of ``lease`` where ``rec``, the lease found at its name, is held by another
    tier of the same writer (:func:`tier_owner`): two tiers of one job reach one location,
    which the policy could not see (it compares paths and URLs); else None."""
    mine, theirs = lease.owner.split("."), rec.owner.split(".")
    if len(mine) != 2 or len(theirs) != 2 or mine[0] != theirs[0]:
        return None
    return WriterConflict(
        f"{lease.where}: another tier of this same job already holds the lease {lease.name} "
        f"here, so {_ALIAS}; this save wrote nothing. Give each tier its own folder or prefix",
        tier=lease.tier,
        url=lease.backend.url,
        holder=rec,
    )


def lost_lease(
    lease: WriterLease, why: str, removed: bool, holder: LeaseRecord | None = None
) -> LeaseLost:
    """What ``lease``'s writer is told once it lost the lease: taken over by another writer
    (``holder``: its lease), or ``removed`` (by hand, or ``tierckpt unlock --force`` on this
    running job)."""
    if removed:
        remedy = (
            "If no other job is pointed here (the lease file was deleted by hand, `tierckpt "
            "unlock --force` was run on this running job, or the folder or bucket was deleted "
            "and made again), restart this job: it takes the lease again at its first save "
            "and loads the newest checkpoint"
        )
    elif holder is not None and other_tier(lease, holder) is not None:
        # a store without conditional PUT let two tiers of this job take it
        remedy = f"Another tier of this same job took it: {_ALIAS}. Give each its own location"
    else:
        remedy = "Two jobs are pointed at one location: stop one of them"
    return LeaseLost(
        f"{lease.where}: this writer lost rank {lease.rank}'s lease {lease.name}: {why}. It no "
        f"longer writes or deletes anything there; its later saves fail on this tier. {remedy}",
        tier=lease.tier,
        url=lease.backend.url,
    )


#: what to do about a writer of this very process on the location (a notebook's second fit)
_SAME_PROCESS = (
    "close() that writer first (a Checkpointer, dcp.TierWriter, or an integration's "
    "TierCkptIO / TierCkptCallback made earlier in this process, which something still "
    "refers to), or use it again instead of a new one"
)


def unlock_hint(backend: Backend, *, same_process: bool = False) -> str:
    """What an operator does about a live holder of a lease on ``backend``'s location
    (``same_process``: a writer of this very process holds it)."""
    if same_process:
        return _SAME_PROCESS
    if not backend.is_durable:
        return (
            "close() the other Checkpointer (or TierWriter) of this process first, or give "
            "this one another namespace"
        )
    if backend.is_node_local:  # node RAM: the folder is named by the namespace
        folder = getattr(backend, "root", backend.url)
        return (
            "give this job another NodeRamTier(namespace=...), or stop the other job; if that "
            f"job is dead, wait for its lease to expire (ttl) or run `tierckpt unlock {folder}`"
        )
    return (
        "point this job at another folder or prefix, or stop the other job; if that job is "
        f"dead, wait for its lease to expire (ttl) or run `tierckpt unlock {backend.url}`"
    )
