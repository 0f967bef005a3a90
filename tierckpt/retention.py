"""Retention and garbage collection of checkpoints on a tier.

What is committed, and in which order, is listed by :mod:`tierckpt.catalog`.
Retention keeps the ``keep_last`` newest ids, so the abandoned timeline's checkpoints go
first, as they are older, and never the resumed run's. GC deletes the manifest first and the
data after, never the newest committed checkpoint, and removes leftovers of saves that never
committed (a killed process): data folders older than the newest committed checkpoint that
have no manifest, with their temporary files and open multipart uploads; and under committed
checkpoints the unfinished files whose writer is provably dead
(:meth:`~tierckpt.backends.base.Backend.remove_dead_incomplete`).

Besides the ``keep_last`` newest (:class:`Retention`, Orbax ``CheckpointManager`` style):

* ``keep_every_n_steps``: a checkpoint whose step is a multiple of n is never removed
  (Orbax's ``keep_period``);
* ``keep_best``: the k best committed checkpoints by ``best_metric`` (``"min"`` or ``"max"``),
  read from the metrics a save stored in its manifest (``save(..., metrics={...})``);
* pins: a checkpoint with a pin marker (``pins/<manifest name>``, written by
  ``Checkpointer.pin``) is never removed until it is unpinned.

Every rule is decided from what is stored on the tier (manifests, pin markers), never from
the memory of the process, so a restarted job keeps the same checkpoints. Where the tier
cannot tell (a manifest or the pin list cannot be read), nothing is removed.

What a pass lists (the pipeline's retention after each commit, ``sweep=None``): leftovers come
from writers killed before this one took the tier and from this process's own failed saves
(no other writer runs under its lease). So the sweep (a listing of the objects and one of the
unfinished uploads) runs at this writer's first pass on a backend and after each failed save
(:func:`note_failed_save`) until one spares nothing, whatever the rules (a killed writer's
uploads are billed storage). Otherwise a pass lists the tier only if its rules may remove one:
while a listing of every object is short (one page on S3), that one listing gives the
manifests, the pins and the files to delete (after a pass that kept ``MANIFESTS_FIRST`` or more
and removed none, the next asks the manifests alone first); past that, the pass lists the
manifests and finds each checkpoint it deletes from its manifest, listing only that
checkpoint's folders, and a full sweep follows every so many such passes
(:mod:`tierckpt.retention_scan`). ``sweep=True`` (``tierckpt gc``) always sweeps fully.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

from tierckpt.backends.base import Backend
from tierckpt.catalog import manifest_ids
from tierckpt.errors import BackendError, NewerFormat
from tierckpt.format import (
    MANIFEST_DIR,
    CheckpointId,
    decode_manifest,
    manifest_name,
    parse_manifest_id,
)
from tierckpt.reported import RETENTION, report_once
from tierckpt.retention_scan import (
    ScanState,
    checkpoint_folders,
    delete_in_folders,
    delete_listed,
    has_upload,
    manifest_to_delete,
    scan_state,
    sweep_leftovers,
)
from tierckpt.sweep import SWEEP_LOCK, Listing, note_failed_save, sweep_state

__all__ = [
    "PIN_DIR",
    "Retention",
    "check_metrics",
    "delete_checkpoint",
    "delete_step",
    "gc_tier",
    "note_failed_save",
    "pin_checkpoint",
    "pin_on_tiers",
    "pinned_ids",
    "stored_metrics",
    "unpin_checkpoint",
    "unpin_on_tiers",
    "with_metrics",
]

#: pin markers: ``pins/step-<12 digits>[.t<6>].json``, one per pinned checkpoint
PIN_DIR = "pins"
#: the key of ``save(..., metrics=...)`` in the manifest's user metadata
METRICS_KEY = "metrics"


@dataclass(frozen=True, slots=True)
class Retention:
    """What retention keeps on one tier (see the module docstring); ``None``: that rule is off.

    A committed checkpoint is removed only when no rule keeps it: not among the ``keep_last``
    newest, not a multiple of ``keep_every_n_steps``, not among the ``keep_best`` best by
    ``best_metric``, not pinned, not being saved, and not the newest. With ``keep_last`` and
    ``keep_best`` both None nothing is removed.
    """

    keep_last: int | None = None
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: Literal["min", "max"] = "min"

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every_n_steps", "keep_best"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 1):
                raise ValueError(f"{name} must be an int >= 1 or None, got {v!r}")
        if self.keep_best is not None and not (
            isinstance(self.best_metric, str) and self.best_metric
        ):
            raise ValueError(
                "keep_best needs best_metric: the name of a metric passed to "
                "save(..., metrics={name: value}), e.g. best_metric='loss'"
            )
        if self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")

    @property
    def removes(self) -> bool:
        """Whether these rules ever remove a committed checkpoint."""
        return self.keep_last is not None or self.keep_best is not None


def check_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """``save(..., metrics=...)`` checked: str keys, finite int or float values."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a dict of name -> number, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"metrics: names must be non-empty strings, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            # a 0-d tensor or numpy scalar: its value, as a float
            item = getattr(v, "item", None)
            v = item() if callable(item) else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"metrics[{k!r}] must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def with_metrics(
    metadata: Mapping[str, Any] | None, metrics: Mapping[str, Any] | None
) -> Mapping[str, Any] | None:
    """``save()``'s metadata with ``metrics`` under :data:`METRICS_KEY` (where retention's
    ``keep_best`` reads them)."""
    if metrics is None:
        return metadata
    checked = check_metrics(metrics)
    if metadata is not None and METRICS_KEY in metadata:
        raise ValueError(
            f"save(): pass metrics either as metrics= or as metadata[{METRICS_KEY!r}], not both"
        )
    return {**(metadata or {}), METRICS_KEY: checked}


def pin_on_tiers(
    backends: Sequence[tuple[str, Backend]], cid: CheckpointId, *, reason: str = ""
) -> None:
    """Pin ``cid`` on every tier; raises :class:`BackendError` naming the tiers where the
    marker could not be written (after trying them all)."""
    failed: list[str] = []
    for name, backend in backends:
        try:
            pin_checkpoint(backend, cid, reason=reason)
        except (BackendError, OSError) as exc:
            failed.append(f"tier {name!r} ({backend.url}): {exc}")
    if failed:
        raise BackendError(
            f"could not pin {cid} on " + "; ".join(failed) + ": retention there may remove it; "
            "call pin() again once the tier is reachable"
        )


def unpin_on_tiers(backends: Sequence[tuple[str, Backend]], cid: CheckpointId) -> None:
    """Unpin ``cid`` on every tier; raises :class:`BackendError` naming the failures."""
    failed: list[str] = []
    for name, backend in backends:
        try:
            unpin_checkpoint(backend, cid)
        except (BackendError, OSError) as exc:
            failed.append(f"tier {name!r} ({backend.url}): {exc}")
    if failed:
        raise BackendError(f"could not unpin {cid} on " + "; ".join(failed))


# -- metrics stored in manifests (cached: a manifest never changes once written) -------------
_METRICS_CACHE: OrderedDict[tuple[str, CheckpointId], dict[str, float]] = OrderedDict()
_CACHE_MAX = 100_000
_cache_lock = threading.Lock()


def stored_metrics(backend: Backend, cid: CheckpointId) -> dict[str, float]:
    """The metrics ``save(..., metrics=...)`` stored in ``cid``'s manifest on ``backend``
    (``{}`` when it stored none). Raises what reading the manifest raises."""
    key = (backend.url, cid)
    with _cache_lock:
        hit = _METRICS_CACHE.get(key)
    if hit is not None:
        return hit
    name = manifest_name(cid.step, timeline=cid.timeline)
    manifest = decode_manifest(backend.get(name), where=f"{backend.url}/{name}")
    raw = (manifest.metadata or {}).get(METRICS_KEY)
    metrics: dict[str, float] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if type(v) in (int, float) and math.isfinite(v):
                metrics[k] = float(v)
    with _cache_lock:
        _METRICS_CACHE[key] = metrics
        while len(_METRICS_CACHE) > _CACHE_MAX:
            _METRICS_CACHE.popitem(last=False)
    return metrics


def _forget(backend: Backend, cid: CheckpointId) -> None:
    with _cache_lock:
        _METRICS_CACHE.pop((backend.url, cid), None)


# -- pins --------------------------------------------------------------------------------------
def _pin_name(cid: CheckpointId) -> str:
    return PIN_DIR + "/" + manifest_name(cid.step, timeline=cid.timeline).split("/", 1)[1]


def pin_checkpoint(backend: Backend, cid: CheckpointId, *, reason: str = "") -> None:
    """Write ``cid``'s pin marker: retention on this tier never removes ``cid`` until
    :func:`unpin_checkpoint`. The checkpoint may still be in flight (or not yet on this tier)."""
    body = {"step": cid.step, "timeline": cid.timeline, "pinned_at": time.time(), "reason": reason}
    backend.put_atomic(_pin_name(cid), json.dumps(body).encode(), overwrite=True)


def unpin_checkpoint(backend: Backend, cid: CheckpointId) -> None:
    """Remove ``cid``'s pin marker (a missing one is not an error)."""
    backend.delete(_pin_name(cid))


def pinned_ids(backend: Backend) -> list[CheckpointId]:
    """The checkpoints pinned on ``backend`` (committed or not), oldest first."""
    return _pinned_in(backend.list(f"{PIN_DIR}/"))


def _pinned_in(names: Sequence[str]) -> list[CheckpointId]:
    """The pinned checkpoints among a listing's ``names``, oldest first."""
    out = []
    for name in names:
        if name.startswith(f"{PIN_DIR}/"):
            cid = parse_manifest_id(MANIFEST_DIR + "/" + name.split("/", 1)[1])
            if cid is not None:
                out.append(cid)
    return sorted(out)


def _best(
    backend: Backend, committed: list[CheckpointId], rule: Retention
) -> tuple[set[CheckpointId], set[CheckpointId]]:
    """The ``keep_best`` best of ``committed`` by the rule's metric, and those whose manifest
    could not be read (kept too: retention never guesses)."""
    scored: list[tuple[float, CheckpointId]] = []
    unknown: set[CheckpointId] = set()
    assert rule.best_metric is not None
    for cid in committed:
        try:
            value = stored_metrics(backend, cid).get(rule.best_metric)
        except Exception as exc:  # unreadable: keep it, decide next time
            if not backend.exists(manifest_name(cid.step, timeline=cid.timeline)):
                continue  # gone meanwhile (another process's retention)
            # at every pass while it lasts: once per checkpoint (and backend object)
            report_once(
                backend,
                exc,
                "retention on %s keeps %s: its metrics cannot be read: %s",
                backend.url,
                cid,
                exc,
                topic=f"{RETENTION} metrics of {cid}",
            )
            unknown.add(cid)
            continue
        if value is not None:
            scored.append((value if rule.best_mode == "min" else -value, cid))
    # best first; on a tie the newer checkpoint wins
    scored.sort(key=lambda sc: (sc[0], tuple(-k for k in sc[1].key)))
    assert rule.keep_best is not None
    return {cid for _, cid in scored[: rule.keep_best]}, unknown


def kept_ids(backend: Backend, committed: list[CheckpointId], rule: Retention) -> set[CheckpointId]:
    """Which of ``committed`` (oldest first) the rules keep, pins included."""
    if not committed or not rule.removes:
        return set(committed)
    return _kept_by_rules(backend, committed, rule) | set(pinned_ids(backend))


def _kept_by_rules(
    backend: Backend, committed: list[CheckpointId], rule: Retention
) -> set[CheckpointId]:
    """:func:`kept_ids` without the pins (listed only when something is about to go)."""
    keep: set[CheckpointId] = {committed[-1]}  # never the newest
    if rule.keep_last is not None:
        keep.update(committed[-rule.keep_last :])
    if rule.keep_every_n_steps is not None:
        keep.update(c for c in committed if c.step % rule.keep_every_n_steps == 0)
    if rule.keep_best is not None:
        best, unknown = _best(backend, committed, rule)
        keep |= best | unknown
    return keep


log = logging.getLogger("tierckpt")


def delete_checkpoint(
    backend: Backend,
    cid: CheckpointId,
    *,
    listing: Listing | None = None,
    uploads: bool = True,
) -> None:
    """Delete one checkpoint: manifest first (it stops existing), then its data.

    ``listing``: the pass's listings, reused (default: list now). ``uploads=False``: its
    writes are known to have finished (a commit of this process, no failure since), so its
    unfinished uploads are not looked for."""
    delete_listed(
        backend, cid, listing if listing is not None else Listing(backend), uploads=uploads
    )


def delete_step(backend: Backend, step: int, *, timeline: int = 0) -> None:
    """Delete the checkpoint of ``step`` on ``timeline``: manifest first, then its data."""
    delete_checkpoint(backend, CheckpointId(step, timeline))


def gc_tier(
    backend: Backend,
    keep_last: int | Retention | None,
    *,
    protect: Collection[CheckpointId] = (),
    protect_steps: Collection[int] = (),
    sweep: bool | None = True,
    deleting: Callable[[CheckpointId], AbstractContextManager[bool]] | None = None,
) -> list[CheckpointId]:
    """Apply retention; returns the checkpoints deleted. ``protect``: those being saved now.

    ``keep_last``: an int (the ``keep_last`` newest) or a :class:`Retention`. Keeps what its
    rules keep (newest in ``(timeline, step)`` order, keep-period, best by a metric), every
    pinned checkpoint and never the newest one; removes data folders without a manifest only
    when they are older than the newest committed checkpoint (a save of a newer one may
    still be running) and not pinned. ``protect_steps``: steps kept on any timeline (an
    integration's live pointers). ``sweep``: True, look for leftovers of saves that never
    committed (and unfinished uploads) every time; None, only when this process has not
    swept ``backend`` clean since it started using it or since :func:`note_failed_save`,
    or after many passes that deleted from scoped listings (:mod:`tierckpt.retention_scan`).
    ``deleting(cid)``: held around each deletion; it yields True when ``cid`` must be kept
    after all (a load of its step began after ``protect_steps`` was asked).
    """
    rule = keep_last if isinstance(keep_last, Retention) else Retention(keep_last=keep_last)
    state, scan = sweep_state(backend), scan_state(backend)
    with SWEEP_LOCK:
        failures = state.failures
        if sweep is None:
            sweep = not state.clean or scan.sweep_due()
        # a sweep looks for unfinished uploads too, whatever the rules: a killed writer's
        # parts are billed storage that nothing else would ever remove
        uploads = sweep
        # a listing of every object finds the files of what goes while it is short
        full = sweep or scan.lists_everything(backend.is_remote)
    in_flight = set(protect)
    deleted: list[CheckpointId] = []
    many = state.kept_all >= MANIFESTS_FIRST  # and nothing removed: ask the manifests first
    listed = None if sweep or not rule.removes or (full and not many) else _manifests(backend)
    if not sweep and (
        not rule.removes
        or (many and not _rules_remove_any(backend, rule, listed, protect, set(protect_steps)))
    ):
        _scanned(scan, listed, deleted, scoped=False)
        return deleted
    listing = Listing(backend)
    # one listing of the whole tier serves the pass (what is committed, the pins, the data),
    # or, for a tier past one page of it, the manifests and each deleted checkpoint's folders
    names = listing.objects() if full else []
    committed = manifest_ids(names) if full or listed is None else listed
    if full:
        with SWEEP_LOCK:
            scan.per_checkpoint = len(names) / max(1, len(committed))
    if protect_steps:
        steps = set(protect_steps)
        # leftovers are looked at only while sweeping: only then their ids are needed
        pool = [*committed, *(listing.data_ids(uploads) if sweep else ())]
        protect = {*protect, *(c for c in pool if c.step in steps)}
    if not committed:
        _scanned(scan, committed, deleted, scoped=False)
        return deleted
    newest = committed[-1]
    if rule.removes:
        keep = _kept_by_rules(backend, committed, rule)
        if any(c not in keep and c not in protect for c in committed):
            # read only when something is about to go
            keep |= set(_pinned_in(names) if full else pinned_ids(backend))
        for cid in committed:
            if cid in keep or cid == newest or cid in protect:
                continue
            try:
                manifest = manifest_to_delete(backend, cid)
            except NewerFormat:  # never deleted by an older release
                keep.add(cid)
                continue
            with deleting(cid) if deleting is not None else nullcontext(False) as spare:
                if spare:
                    keep.add(cid)
                    continue
                up = sweep or cid in state.stale
                folders = None if full or up else checkpoint_folders(manifest)
                if folders is not None and not scan.scoped_pays(len(folders), backend.is_remote):
                    folders = None  # fewer requests in the listing of every object
                if folders is None:
                    delete_checkpoint(backend, cid, listing=listing, uploads=up)
                else:
                    delete_in_folders(backend, cid, folders)
            _forget(backend, cid)
            state.stale.discard(cid)
            deleted.append(cid)
        protect = {*protect, *keep}
    if sweep:
        clean = sweep_leftovers(
            backend, committed, newest, protect, in_flight, listing, deleted, uploads
        )
        with SWEEP_LOCK:
            # a save that failed while this pass ran marked it unclean: that stays
            state.clean = clean and state.failures == failures
            scan.scoped = 0
            if uploads:
                state.stale = {
                    c for c in committed if c not in deleted and has_upload(listing.uploads(), c)
                }
    state.kept_all = 0 if deleted else len(committed)
    _scanned(scan, committed, deleted, scoped=not full)
    if deleted:
        log.debug("gc on %s removed %s", backend.url, ", ".join(map(str, deleted)))
    return deleted


#: module docstring: a listing of every object of many checkpoints spans pages
MANIFESTS_FIRST = 64


def _manifests(backend: Backend) -> list[CheckpointId]:
    return manifest_ids(backend.list(f"{MANIFEST_DIR}/"))


def _scanned(
    scan: ScanState,
    committed: list[CheckpointId] | None,
    deleted: list[CheckpointId],
    *,
    scoped: bool,
) -> None:
    """Note what a pass saw: the checkpoints it left, and whether it deleted from scoped
    listings (after :data:`~tierckpt.retention_scan.FULL_SWEEP_EVERY` of those, a sweep)."""
    with SWEEP_LOCK:
        if committed is not None:
            gone = set(deleted)
            scan.committed = sum(c not in gone for c in committed)
        scan.scoped += scoped and bool(deleted)


def _rules_remove_any(
    backend: Backend,
    rule: Retention,
    committed: list[CheckpointId] | None,
    protect: Collection[CheckpointId],
    steps: Collection[int],
) -> bool:
    """Whether ``rule`` removes one of ``committed`` (default: list the manifests), from the
    manifests alone (rules that keep all of 1,100 checkpoints on S3 listed every object at
    each save: 35x slower)."""
    committed = _manifests(backend) if committed is None else committed
    if not committed:
        return False
    keep = _kept_by_rules(backend, committed, rule)
    return any(c not in keep and c not in protect and c.step not in steps for c in committed)
