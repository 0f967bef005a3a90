"""Garbage collection of a tier: keep the newest checkpoints, remove older ones and the
leftovers of saves that never committed (refused while a live writer holds the lease)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tierckpt.backends.base import Backend
from tierckpt.catalog import committed_ids, data_ids
from tierckpt.errors import (
    WriterConflict,
)
from tierckpt.format import (
    CheckpointId,
)
from tierckpt.layout import data_folder_part
from tierckpt.offline._leases import leases
from tierckpt.retention import gc_tier, pinned_ids


# -- gc ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GcPlan:
    """What gc deletes: old committed checkpoints (retention) and leftovers of uncommitted
    saves."""

    retained: list[CheckpointId]
    expired: list[CheckpointId]
    leftovers: list[CheckpointId]
    #: uncommitted saves gc keeps: not older than the newest committed checkpoint (a save in
    #: progress, or a killed one; ``abort_incomplete`` discards their unfinished writes)
    kept_uncommitted: list[CheckpointId] = field(default_factory=list)
    #: the retained checkpoints kept only because they are pinned (``Checkpointer.pin``)
    kept_pinned: list[CheckpointId] = field(default_factory=list)


def gc(
    backend: Backend,
    keep_last: int,
    *,
    dry_run: bool = False,
    abort_incomplete: bool = False,
    force: bool = False,
) -> GcPlan:
    """Keep the newest ``keep_last`` committed checkpoints; remove older ones and leftovers.

    Newest means by timeline, then step: checkpoints of a timeline a run abandoned (it went
    back to an older step) are older than every checkpoint of the newer timeline. Leftovers are
    data folders without a manifest older than the newest committed checkpoint (saves that
    never committed). ``abort_incomplete`` also discards unfinished writes (temporary files,
    open multipart uploads) — only when no job is writing to this location.

    While a live writer holds the location's lease this raises :class:`WriterConflict`
    (its saves in progress look like leftovers) unless ``force``; ``dry_run`` never refuses.
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    live = [info for info in leases(backend) if info.alive]
    if live and not dry_run and not force:
        first = live[0]
        raise WriterConflict(
            f"{backend.url} has a live writer: rank {first.rank}'s lease is held by "
            f"{first.describe()}. Its own retention runs after every commit; a gc now could "
            "delete its saves in progress. Stop that job first, or pass --force (force=True)",
            url=backend.url,
            holder=first.record,
        )
    committed = committed_ids(backend)
    newest = committed[-1] if committed else None
    pinned = set(pinned_ids(backend))  # never removed (Checkpointer.pin)
    expired = [c for c in committed[: max(len(committed) - keep_last, 0)] if c not in pinned]
    committed_set = set(committed)
    uncommitted = [c for c in data_ids(backend) if c not in committed_set]
    leftovers = [c for c in uncommitted if newest is not None and c < newest]
    kept = [c for c in uncommitted if c not in leftovers]
    by_rule = committed[: max(len(committed) - keep_last, 0)]
    plan = GcPlan(
        [c for c in committed if c not in expired],
        expired,
        leftovers,
        kept,
        [c for c in by_rule if c in pinned],
    )
    if dry_run:
        return plan
    gc_tier(backend, keep_last)
    if kept:  # a killed writer's temporaries go whatever their step (no live lock holds them)
        still = set(data_ids(backend))
        gone = [c for c in kept if c not in still]
        plan = dataclasses.replace(
            plan, leftovers=[*leftovers, *gone], kept_uncommitted=[c for c in kept if c in still]
        )
    if abort_incomplete:
        backend.cleanup_incomplete("steps/")
        backend.cleanup_incomplete("manifests/")
        for name in backend.incomplete(""):  # format v2: under hashed prefixes <hh>/steps/
            if data_folder_part(name) != name:
                backend.cleanup_incomplete(name)
    return plan
