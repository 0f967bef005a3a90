"""Retention and garbage collection of checkpoints on a tier.

What is committed, and in which order, is listed by :mod:`tierckpt.catalog`.
Retention keeps the ``keep_last`` newest ids, so the abandoned timeline's checkpoints go
first, as they are older, and never the resumed run's. GC deletes the manifest first and the
data after, never the newest committed checkpoint, and removes leftovers of saves that never
committed (a killed process): data folders older than the newest committed checkpoint that
have no manifest, with their temporary files and open multipart uploads.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from tierckpt.backends.base import Backend
from tierckpt.catalog import committed_ids, data_ids
from tierckpt.format import (
    MANIFEST_DIR,
    CheckpointId,
    manifest_name,
    parse_manifest_id,
    step_prefix,
)
from tierckpt.layout import data_folder_part

__all__ = [
    "delete_checkpoint",
    "delete_step",
    "gc_tier",
]

log = logging.getLogger("tierckpt")


def delete_checkpoint(backend: Backend, cid: CheckpointId) -> None:
    """Delete one checkpoint: manifest first (it stops existing), then its data."""
    backend.delete(manifest_name(cid.step, timeline=cid.timeline))
    prefix = step_prefix(cid.step, timeline=cid.timeline)
    # format v1 keeps a step's files in one folder; v2 (tierckpt.layout) also under hashed
    # prefixes <hh>/ whose number may have changed between runs: one listing of the tier
    # finds both
    folders = {prefix}
    for name in backend.list(""):
        if data_folder_part(name).startswith(prefix):
            backend.delete(name)
            folders.add(name[: len(name) - len(data_folder_part(name))] + prefix)
    for name in backend.incomplete(""):
        if data_folder_part(name).startswith(prefix):
            folders.add(name[: len(name) - len(data_folder_part(name))] + prefix)
    for folder in sorted(folders):
        backend.cleanup_incomplete(folder)


def delete_step(backend: Backend, step: int, *, timeline: int = 0) -> None:
    """Delete the checkpoint of ``step`` on ``timeline``: manifest first, then its data."""
    delete_checkpoint(backend, CheckpointId(step, timeline))


def gc_tier(
    backend: Backend,
    keep_last: int | None,
    *,
    protect: Collection[CheckpointId] = (),
) -> list[CheckpointId]:
    """Apply retention; returns the checkpoints deleted. ``protect``: those being saved now.

    Keeps the ``keep_last`` newest checkpoints in ``(timeline, step)`` order and never the
    newest one; removes data folders without a manifest only when they are older than the
    newest committed checkpoint (a save of a newer one may still be running).
    """
    committed = committed_ids(backend)
    deleted: list[CheckpointId] = []
    if not committed:
        return deleted
    newest = committed[-1]
    if keep_last is not None:
        for cid in committed[: max(len(committed) - keep_last, 0)]:
            if cid == newest or cid in protect:
                continue
            delete_checkpoint(backend, cid)
            deleted.append(cid)
    committed_set = set(committed)
    for cid in data_ids(backend):
        if cid < newest and cid not in committed_set and cid not in protect:
            # a save that never committed (killed, failed): its leftovers go
            delete_checkpoint(backend, cid)
            deleted.append(cid)
    for name in backend.incomplete(f"{MANIFEST_DIR}/"):
        # a manifest put killed halfway leaves a temporary file: dead once a newer one is in
        pending = parse_manifest_id(name)
        if pending is not None and pending < newest and pending not in protect:
            backend.cleanup_incomplete(name)
    if deleted:
        log.debug("gc on %s removed %s", backend.url, ", ".join(map(str, deleted)))
    return deleted
