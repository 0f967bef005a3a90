"""Listing committed checkpoints on a tier, retention and garbage collection.

A checkpoint exists on a tier iff its manifest exists there. GC deletes the manifest first and
the data after, never the newest committed checkpoint, and removes leftovers of saves that
never committed (a killed process): data folders of steps older than the newest committed
step that have no manifest, with their temporary files and open multipart uploads.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

from tierckpt.backends.base import Backend
from tierckpt.format import DATA_DIR, MANIFEST_DIR, manifest_name, parse_manifest_name, step_prefix

__all__ = ["committed_steps", "data_steps", "delete_step", "gc_tier"]

log = logging.getLogger("tierckpt")


def committed_steps(backend: Backend) -> list[int]:
    steps = []
    for name in backend.list(f"{MANIFEST_DIR}/"):
        s = parse_manifest_name(name)
        if s is not None:
            steps.append(s)
    return sorted(steps)


def data_steps(backend: Backend) -> list[int]:
    """Steps that have a data folder (committed or not)."""
    out = set()
    for name in [*backend.list(f"{DATA_DIR}/"), *backend.incomplete(f"{DATA_DIR}/")]:
        parts = name.split("/")
        if len(parts) >= 3 and parts[1].isdigit() and len(parts[1]) == 12:
            out.add(int(parts[1]))
    return sorted(out)


def delete_step(backend: Backend, step: int) -> None:
    """Delete one checkpoint: manifest first (it stops existing), then its data."""
    backend.delete(manifest_name(step))
    prefix = step_prefix(step)
    for name in backend.list(prefix):
        backend.delete(name)
    backend.cleanup_incomplete(prefix)


def gc_tier(
    backend: Backend,
    keep_last: int | None,
    *,
    protect: Collection[int] = (),
) -> list[int]:
    """Apply retention; returns the steps deleted. ``protect``: steps being saved now."""
    committed = committed_steps(backend)
    deleted: list[int] = []
    if not committed:
        return deleted
    newest = committed[-1]
    if keep_last is not None:
        for step in committed[: max(len(committed) - keep_last, 0)]:
            if step == newest or step in protect:
                continue
            delete_step(backend, step)
            deleted.append(step)
    committed_set = set(committed)
    for step in data_steps(backend):
        if step < newest and step not in committed_set and step not in protect:
            # a save that never committed (killed, failed): its leftovers go
            delete_step(backend, step)
            deleted.append(step)
    for name in backend.incomplete(f"{MANIFEST_DIR}/"):
        # a manifest put killed halfway leaves a temporary file: dead once a newer step is in
        pending = parse_manifest_name(name)
        if pending is not None and pending < newest and pending not in protect:
            backend.cleanup_incomplete(name)
    if deleted:
        log.debug("gc on %s removed steps %s", backend.url, deleted)
    return deleted
