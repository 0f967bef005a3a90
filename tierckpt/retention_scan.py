"""How a retention pass finds a checkpoint's files and deletes them, and when it lists every
object of a tier instead (:func:`tierckpt.retention.gc_tier` decides what goes).

A pass that deletes a checkpoint used to list every object of the tier to find that
checkpoint's files: with ``keep_every_n_steps`` keeping 1,000 checkpoints, every such pass
walked all their data files (local saves 6x slower over 2,000 saves; on S3 a listing of many
pages at each save). Now, once a listing of every object would hold more than
:data:`FULL_LISTING_MAX` objects (one page; :data:`FULL_LISTING_MAX_LOCAL` on a local folder
or in RAM), estimated from the last such listing (:class:`ScanState`), a pass lists the
manifests, and for each checkpoint it deletes reads that checkpoint's manifest, which names
its data files, and lists only the folders that hold them: its folder
``steps/<step>/`` (format v1 files, DCP metadata, v1 records) and each ``<hh>/steps/<step>/``
of its shard files (format v2: their records are under the same ``<hh>``, as a rank's prefix
depends only on its rank and the tier's ``prefixes``). A checkpoint whose manifest cannot be
read, or whose unfinished uploads must go too, or (on an object store) whose folders are more
than the pages of a listing of every object, is deleted from that listing as before. What a
scoped pass may leave behind (files of an earlier attempt written with another ``prefixes``
or world size, under a ``<hh>`` its manifest does not name) is data without a manifest, older
than the newest checkpoint: the full sweep removes it, and it runs after
:data:`FULL_SWEEP_EVERY` scoped passes that deleted, besides its usual occasions (this
writer's first pass on the tier, and after each failed save).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Collection
from dataclasses import dataclass

from tierckpt.backends.base import Backend
from tierckpt.errors import NewerFormat
from tierckpt.format import (
    MANIFEST_DIR,
    CheckpointId,
    Manifest,
    decode_manifest,
    manifest_name,
    parse_data_folder,
    parse_manifest_id,
    step_prefix,
)
from tierckpt.layout import data_folder_part
from tierckpt.reported import report_once
from tierckpt.sweep import Listing

__all__ = [
    "FULL_LISTING_MAX",
    "FULL_LISTING_MAX_LOCAL",
    "FULL_SWEEP_EVERY",
    "ScanState",
    "checkpoint_folders",
    "delete_in_folders",
    "delete_listed",
    "has_upload",
    "manifest_to_delete",
    "scan_state",
    "sweep_leftovers",
    "written_by_newer",
]

#: objects a listing of every object may hold and still be the cheaper way to find a deleted
#: checkpoint's files, on an object store: one page of an S3 listing (one request, where the
#: scoped way takes a listing of the manifests, one of the pins, a GET and one per folder)
FULL_LISTING_MAX = 1000
#: the same on a local folder or in RAM, where a request costs no round trip but every folder
#: walked costs system calls (the walk of 1,000 checkpoints' folders made saves 6x slower)
FULL_LISTING_MAX_LOCAL = 256
#: scoped passes that deleted, after which a pass sweeps fully (what they may have missed)
FULL_SWEEP_EVERY = 64


@dataclass(slots=True)
class ScanState:
    """What this process knows of the size of one tier (see the module docstring)."""

    #: objects per committed checkpoint in the last listing of every object (0: none yet)
    per_checkpoint: float = 0.0
    #: committed checkpoints the last pass left
    committed: int = 0
    #: passes that deleted from scoped listings since the last full sweep
    scoped: int = 0

    def lists_everything(self, remote: bool) -> bool:
        """Whether the next pass finds the files it deletes in a listing of every object: at
        most :data:`FULL_LISTING_MAX` objects (``remote``, else :data:`FULL_LISTING_MAX_LOCAL`)
        by the estimate, or nothing known yet."""
        limit = FULL_LISTING_MAX if remote else FULL_LISTING_MAX_LOCAL
        return self.per_checkpoint * (self.committed + 1) <= limit

    def scoped_pays(self, folders: int, remote: bool) -> bool:
        """Whether listing ``folders`` folders (a checkpoint's) sends no more requests than the
        pages of a listing of every object, by the estimate (a job of 256 ranks names 257
        folders); a local walk of a few folders always costs less than one of everything."""
        pages = math.ceil(self.per_checkpoint * (self.committed + 1) / FULL_LISTING_MAX)
        return not remote or folders <= pages

    def sweep_due(self) -> bool:
        return self.scoped >= FULL_SWEEP_EVERY


_SCANS: weakref.WeakKeyDictionary[Backend, ScanState] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def scan_state(backend: Backend) -> ScanState:
    """``backend``'s state, made on first use. A backend that cannot be remembered gets a new
    one each time: its passes then list every object, as before this state existed."""
    with _lock:
        try:
            state = _SCANS.get(backend)
            if state is None:
                state = _SCANS[backend] = ScanState()
        except TypeError:
            return ScanState()
        return state


def checkpoint_folders(manifest: Manifest | None) -> list[str] | None:
    """The folders holding the files of ``manifest``'s checkpoint: ``steps/<step>/`` and the
    ``<hh>/steps/<step>/`` of each of its format v2 shard files. None without a manifest
    (:func:`manifest_to_delete` could not read it): then only a listing of every object can
    tell."""
    if manifest is None:  # the caller lists every object instead: never guesses
        return None
    prefix = step_prefix(manifest.step, timeline=manifest.timeline)
    folders = {prefix}
    for shard in manifest.shards:
        # decode_manifest checked each file is ``<folder>...`` or ``<hh>/<folder>...``
        folders.add(shard.file[: len(shard.file) - len(data_folder_part(shard.file))] + prefix)
    return sorted(folders)


#: per backend, the checkpoints :func:`written_by_newer` found of a newer release (a manifest is
#: never rewritten in place: the answer stands while the checkpoint does)
_NEWER: weakref.WeakKeyDictionary[Backend, set[CheckpointId]] = weakref.WeakKeyDictionary()
_NEWER_LOCK = threading.Lock()


def manifest_to_delete(backend: Backend, cid: CheckpointId) -> Manifest | None:
    """``cid``'s manifest, read once before retention deletes ``cid`` (None: gone, damaged,
    unreadable; the pass goes on as before). Raises :class:`NewerFormat` where a newer
    release wrote it (a rollback of the library runs beside it): retention keeps it, said
    once, and this process does not read it again."""
    with _NEWER_LOCK:
        if cid in _NEWER.get(backend, ()):
            raise NewerFormat(f"{backend.url}: {cid} was written by a newer tierckpt")
    name = manifest_name(cid.step, timeline=cid.timeline)
    try:
        return decode_manifest(backend.get(name), where=f"{backend.url}/{name}")
    except NewerFormat as exc:
        report_once(backend, exc, "retention keeps %s: %s", cid, exc, topic="newer format")
        with _NEWER_LOCK:
            _NEWER.setdefault(backend, set()).add(cid)
        raise
    except Exception:
        return None


def written_by_newer(backend: Backend, cid: CheckpointId) -> bool:
    """Whether a newer release wrote ``cid``'s manifest (:func:`manifest_to_delete`)."""
    try:
        manifest_to_delete(backend, cid)
    except NewerFormat:
        return True
    return False


def delete_in_folders(backend: Backend, cid: CheckpointId, folders: Collection[str]) -> None:
    """Delete ``cid``: its manifest first, then every committed object in ``folders`` (from
    :func:`checkpoint_folders`, read before the manifest goes). Unfinished writes there are
    left to the sweeps, as a pass leaves them under a checkpoint it deletes from a listing."""
    backend.delete(manifest_name(cid.step, timeline=cid.timeline))
    for folder in folders:
        for name in backend.list(folder):
            backend.delete(name)


def delete_listed(backend: Backend, cid: CheckpointId, listing: Listing, *, uploads: bool) -> None:
    """:func:`tierckpt.retention.delete_checkpoint` from ``listing`` (a pass's listings):
    the manifest first, then every object of ``cid``'s folders, under any ``<hh>/``."""
    backend.delete(manifest_name(cid.step, timeline=cid.timeline))
    prefix = step_prefix(cid.step, timeline=cid.timeline)
    # format v1 keeps a step's files in one folder; v2 (tierckpt.layout) also under hashed
    # prefixes <hh>/ whose number may have changed between runs: one listing of the tier
    # finds both
    folders = {prefix}
    for name in listing.objects():
        if data_folder_part(name).startswith(prefix):
            backend.delete(name)
            folders.add(name[: len(name) - len(data_folder_part(name))] + prefix)
    if not uploads:
        return
    for name in listing.uploads():
        if data_folder_part(name).startswith(prefix):
            folders.add(name[: len(name) - len(data_folder_part(name))] + prefix)
    for folder in sorted(folders):
        backend.cleanup_incomplete(folder)


def has_upload(uploads: list[str], cid: CheckpointId) -> bool:
    prefix = step_prefix(cid.step, timeline=cid.timeline)
    return any(data_folder_part(n).startswith(prefix) for n in uploads)


def sweep_leftovers(
    backend: Backend,
    committed: list[CheckpointId],
    newest: CheckpointId,
    protect: Collection[CheckpointId],
    in_flight: Collection[CheckpointId],
    listing: Listing,
    deleted: list[CheckpointId],
    uploads: bool,
) -> bool:
    """Remove the leftovers of saves that never committed; appends them to ``deleted``.
    Returns whether none was spared (newer than ``newest``, pinned, a protected step: a later
    sweep removes them); the saves of this process in flight (``in_flight``) do not count,
    as their failure is noted (:func:`~tierckpt.sweep.note_failed_save`)."""
    clean = True
    committed_set = set(committed)
    for cid in listing.data_ids(uploads):
        if cid in committed_set or cid in in_flight:
            continue
        if cid < newest and cid not in protect:
            # a save that never committed (killed, failed): its leftovers go
            delete_listed(backend, cid, listing, uploads=uploads)
            deleted.append(cid)
        else:
            clean = False
    for name in listing.uploads() if uploads else ():
        # a manifest put killed halfway leaves a temporary file: dead once a newer one is in
        pending = parse_manifest_id(name) if name.startswith(f"{MANIFEST_DIR}/") else None
        under = pending if pending is not None else parse_data_folder(name)
        if under in committed_set:
            # an unfinished file under a committed checkpoint (a writer killed midway: a
            # shard file, a rank record, a peer pull or receive): the checkpoint's folder
            # may still be written (another rank's pull into it, this process's own), so
            # only what the store proves dead goes (a local file no live writer holds the
            # lock of); S3's uploads there go with the checkpoint (``state.stale``)
            if backend.remove_dead_incomplete(name):
                clean = False  # a live writer's: looked at again by a later sweep
            continue
        if pending is None:
            # an unfinished file of a save not committed that is newer than the newest (or in
            # flight, or protected): a killed writer's goes now, as the store proves it dead.
            # Left there, it filled a node-RAM budget or a disk that the retry of that step
            # needed, and every later save failed
            if under is not None and backend.remove_dead_incomplete(name):
                clean = False
            continue
        if pending in in_flight:
            continue
        if pending < newest and pending not in protect:
            backend.cleanup_incomplete(name)
        elif pending not in committed_set:
            clean = False
    return clean
