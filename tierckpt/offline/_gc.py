"""Garbage collection of a tier: keep the newest checkpoints, remove older ones and the
leftovers of saves that never committed, and a killed writer's unfinished writes whatever
their step (refused while a live writer holds the lease).

A manifest's name commits a checkpoint, but says nothing of its bytes: before deleting, gc
checks the checkpoints it would keep, newest first (:func:`quick_check`: the manifest parses
and validates, each rank's shard file is there at the size the manifest says, with its footer
and index checksum; or, with ``read_whole``, every chunk as ``tierckpt verify`` does). A
damaged or unreadable one does not count toward ``keep_last`` and is kept (removing damage is
the operator's call), so the newest ``keep_last`` *intact* checkpoints stay.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tierckpt.backends.base import Backend
from tierckpt.catalog import committed_ids
from tierckpt.errors import (
    NewerFormat,
    WriterConflict,
)
from tierckpt.format import (
    CheckpointId,
    parse_data_folder,
)
from tierckpt.layout import data_folder_part
from tierckpt.offline._leases import LeaseInfo, leases
from tierckpt.offline._unfinished import NONE, Unfinished, unfinished
from tierckpt.offline._verify import held_shards, verify_checkpoint
from tierckpt.restore import read_index, read_manifest
from tierckpt.retention import gc_tier, pinned_ids
from tierckpt.retention_scan import written_by_newer

#: shard files whose tails :func:`quick_check` reads at once (one small read each: on an
#: object store with many ranks, one after another took a round trip per rank)
CHECK_THREADS = 16


# -- gc ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GcPlan:
    """What gc deletes: old committed checkpoints (retention) and leftovers of uncommitted
    saves."""

    retained: list[CheckpointId]
    expired: list[CheckpointId]
    #: older than the newest committed checkpoint (saves that never committed), and those of
    #: ``dead_saves``
    leftovers: list[CheckpointId]
    #: uncommitted saves gc keeps: not older than the newest committed checkpoint and not
    #: ``dead_saves`` (a save in progress; the completed shard files of a killed one, which go
    #: once a newer checkpoint commits; unfinished writes whose writer the store cannot judge,
    #: which ``abort_incomplete`` discards)
    kept_uncommitted: list[CheckpointId] = field(default_factory=list)
    #: the retained checkpoints kept only because they are pinned (``Checkpointer.pin``)
    kept_pinned: list[CheckpointId] = field(default_factory=list)
    #: the checkpoints gc kept that failed its check, with why (newest first): they do not
    #: count toward ``keep_last`` and are not deleted
    damaged: list[tuple[CheckpointId, str]] = field(default_factory=list)
    #: intact checkpoints kept beyond the newest ``keep_last`` because newer ones are damaged
    kept_for_damage: list[CheckpointId] = field(default_factory=list)
    #: the leftovers not older than the newest committed checkpoint: saves of nothing but
    #: unfinished writes of a killed writer (no process holds their locks), which gc removes
    #: whatever their step (left, they filled the disk the retry of that step needed)
    dead_saves: list[CheckpointId] = field(default_factory=list)
    #: checkpoints gc keeps (committed, or uncommitted saves) whose unfinished writes of a
    #: killed writer it removes; what else their folders hold stays
    dead_writes: list[CheckpointId] = field(default_factory=list)
    #: the unfinished writes of each data folder before gc ran, judged as gc judges them
    #: (dead: a killed writer's; live: a save in progress; unknown: the store cannot tell)
    unfinished: dict[CheckpointId, Unfinished] = field(default_factory=dict)
    #: ``dry_run`` only: why a real run would refuse and delete nothing (a live writer holds
    #: the location's lease; ``force`` lifts it); "" when it would not
    refused: str = ""
    #: checkpoints written by a newer tierckpt (a manifest version this one does not read):
    #: kept whatever their age, not counted toward ``keep_last``, not damage
    newer: list[CheckpointId] = field(default_factory=list)


def quick_check(backend: Backend, cid: CheckpointId, *, read_whole: bool = False) -> str:
    """Why ``cid`` on ``backend`` is damaged or unreadable ("": it passed). Its manifest
    parses and validates, and each rank's shard file is there at the size the manifest says,
    with its footer and index checksum (a byte flipped in a chunk's data passes: only
    ``read_whole``, which reads and checks every chunk as ``tierckpt verify`` does, finds it).
    Any error reading it counts (a store unreachable now too): gc keeps what it cannot judge."""
    try:
        if read_whole:
            verify_checkpoint(backend, cid)
            return ""
        manifest = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
        refs = held_shards(backend, manifest)  # a node-local copy: its node's ranks
        with ThreadPoolExecutor(min(CHECK_THREADS, len(refs)) or 1, "tierckpt-check") as pool:
            # the size, the footer, the index checksum; the first failure (in rank order) raises
            for _ in pool.map(lambda ref: read_index(backend, ref, backend.url), refs):
                pass
    except NewerFormat as exc:  # not damage: a newer release's (GcPlan.newer)
        return f"{_NEWER}{exc}"
    except Exception as exc:  # damage of any kind (or unreadable): reported, never deleted
        return str(exc) or type(exc).__name__
    return ""


_NEWER = "written by a newer tierckpt: "


def gc(
    backend: Backend,
    keep_last: int,
    *,
    dry_run: bool = False,
    abort_incomplete: bool = False,
    force: bool = False,
    read_whole: bool = False,
) -> GcPlan:
    """Keep the newest ``keep_last`` intact committed checkpoints; remove older ones and
    leftovers.

    Newest means by timeline, then step: checkpoints of a timeline a run abandoned (it went
    back to an older step) are older than every checkpoint of the newer timeline. Leftovers are
    data folders without a manifest older than the newest committed checkpoint (saves that
    never committed), and newer ones that hold nothing but a killed writer's unfinished writes
    (``dead_saves``). Unfinished writes are judged as the store can: a temporary file on a
    local file system whose ``flock`` no process holds is a killed writer's and goes, whatever
    its step (``dead_writes``: those in folders gc keeps); one a live writer holds is never
    touched; a dry run makes the same test without removing anything, so it names what a real
    run removes. ``abort_incomplete`` also discards the unfinished writes whose writer the
    store cannot judge (open multipart uploads, a network file system's temporaries) — only
    when no job is writing to this location.

    Intact means that its manifest parses and validates and each rank's shard file is there
    at the size the manifest says, with its footer and index checksum (``read_whole``: every
    chunk read and checked, as :func:`verify_checkpoint` does), checked on the checkpoints gc
    would keep, newest first: a damaged or unreadable one does not count toward ``keep_last``
    and is kept too (``damaged`` in the returned plan). After a real run the plan says what
    this call removed, not what it meant to: another gc at the same time may have removed
    the rest.

    While a live writer holds the location's lease this raises :class:`WriterConflict`
    (its saves in progress look like leftovers) unless ``force``; ``dry_run`` never refuses,
    and says why a real run would in the plan's ``refused``.
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    live = [info for info in leases(backend) if info.alive]
    refused = _live_writer(backend.url, live) if live and not force else ""
    if refused and not dry_run:
        raise WriterConflict(refused, url=backend.url, holder=live[0].record)
    committed = committed_ids(backend)
    newest = committed[-1] if committed else None
    pinned = set(pinned_ids(backend))  # never removed (Checkpointer.pin)
    keep, damaged = _kept(backend, committed, keep_last, read_whole)
    expired = [c for c in committed if c not in keep and c not in pinned]
    # retention never deletes a newer release's checkpoint (written_by_newer): say so here
    keep |= {c for c in expired if written_by_newer(backend, c)}
    newer = sorted({c for c, why in damaged if why.startswith(_NEWER)} | (set(expired) & keep))
    damaged = [(c, why) for c, why in damaged if c not in newer]
    expired = [c for c in expired if c not in keep]
    committed_set = set(committed)
    complete, writes = _data(backend)
    uncommitted = [c for c in sorted(complete | set(writes)) if c not in committed_set]
    leftovers = [c for c in uncommitted if newest is not None and c < newest]
    # gc_tier's sweep (there only when something is committed) removes every unfinished
    # write the store proves dead, whatever its step: a save not older than the newest of
    # nothing else goes with them (the same test as the sweep's, read only: a dry run and a
    # real one name the same saves)
    dead_saves = [
        c
        for c in uncommitted
        if newest is not None
        and c not in leftovers
        and c not in complete
        and writes.get(c, NONE).all_dead
    ]
    kept = [c for c in uncommitted if c not in leftovers and c not in dead_saves]
    dead_writes = [
        c
        for c in [*committed, *kept]
        if newest is not None and c not in expired and writes.get(c, NONE).dead
    ]
    by_rule = committed[: max(len(committed) - keep_last, 0)]
    bad = {c for c, _ in damaged}
    plan = GcPlan(
        [c for c in committed if c not in expired],
        expired,
        [*leftovers, *dead_saves],
        kept,
        [c for c in by_rule if c in pinned and c not in keep],
        damaged,
        [c for c in by_rule if c in keep and c not in bad and c not in newer],
        dead_saves,
        sorted(dead_writes),
        writes,
        refused,
        newer,
    )
    if dry_run:
        return plan
    # what gc keeps beyond the newest keep_last by name (the intact ones older than damaged
    # ones, and the damaged ones) goes to retention as protected: it deletes nothing else
    removed = gc_tier(backend, keep_last, protect=keep)
    gone_now = set(removed)
    # after a real run the plan says what went (a writer may have died, or finished, since)
    newer = [*kept, *dead_saves]  # the uncommitted saves not older than the newest
    complete_now, writes_now = _data(backend) if newer or dead_writes else (set(), {})
    still = complete_now | set(writes_now)
    # a killed writer's temporaries go whatever their step (no live lock holds them)
    gone = [c for c in sorted(newer) if c not in still and c not in gone_now]
    plan = dataclasses.replace(
        plan,
        expired=[c for c in removed if c in committed_set],
        leftovers=[*(c for c in removed if c not in committed_set), *gone],
        kept_uncommitted=[c for c in sorted(newer) if c in still],
        dead_saves=gone,
        dead_writes=[
            c
            for c in dead_writes
            if c in still and writes_now.get(c, NONE).dead < writes.get(c, NONE).dead
        ],
    )
    if abort_incomplete:
        backend.cleanup_incomplete("steps/")
        backend.cleanup_incomplete("manifests/")
        for name in backend.incomplete(""):  # format v2: under hashed prefixes <hh>/steps/
            if data_folder_part(name) != name:
                backend.cleanup_incomplete(name)
    return plan


def _data(backend: Backend) -> tuple[set[CheckpointId], dict[CheckpointId, Unfinished]]:
    """The checkpoints with completed files in their data folders, and the unfinished writes
    of each data folder (as :func:`~tierckpt.catalog.data_ids`: a v1 or a v2 folder)."""
    complete = {c for n in backend.list("") if (c := parse_data_folder(n)) is not None}
    return complete, unfinished(backend, backend.incomplete(""))


def _kept(
    backend: Backend, committed: list[CheckpointId], keep_last: int, read_whole: bool
) -> tuple[set[CheckpointId], list[tuple[CheckpointId, str]]]:
    """The checkpoints gc keeps by ``keep_last``: newest first until ``keep_last`` of them
    pass :func:`quick_check`, the damaged ones among them kept too; and those damaged ones."""
    keep: set[CheckpointId] = set()
    damaged: list[tuple[CheckpointId, str]] = []
    intact = 0
    for cid in reversed(committed):
        if intact >= keep_last:
            break
        keep.add(cid)
        why = quick_check(backend, cid, read_whole=read_whole)
        if why:
            damaged.append((cid, why))
        else:
            intact += 1
    return keep, damaged


def _live_writer(url: str, live: list[LeaseInfo]) -> str:
    """Why gc refuses while ``live`` writers hold ``url``'s lease, and what to do."""
    known = [info for info in live if info.known_live]
    first = known[0] if known else live[0]
    text = (
        f"{url} has a live writer: rank {first.rank}'s lease is held by {first.describe()}. "
        "Its own retention runs after every commit; a gc now could delete its saves in "
        "progress. "
    )
    if known:
        return text + "Stop that job first (it runs on this machine), or pass --force (force=True)"
    return text + (
        "Nothing on this machine can tell whether that job still runs: if it is dead, wait "
        f"for its lease to expire (ttl) or run `tierckpt unlock {url}`, then gc again; or "
        "pass --force (force=True)"
    )
