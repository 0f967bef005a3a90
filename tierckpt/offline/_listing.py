"""Opening a tier by URL and listing what it holds: committed checkpoints, uncommitted
leftovers, and the checkpoint a step (and timeline) names."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tierckpt import config
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.catalog import committed_ids, data_ids
from tierckpt.errors import (
    CheckpointNotFound,
    NewerFormat,
    TierCkptError,
)
from tierckpt.format import (
    CheckpointId,
    Manifest,
    parse_data_folder,
)
from tierckpt.locations import canonical_url, local_folder
from tierckpt.offline._leases import leases
from tierckpt.offline._unfinished import NONE, unfinished
from tierckpt.redact import redact
from tierckpt.restore import read_manifest

#: called with a number of bytes just processed (progress bars)
Progress = Callable[[int], Any]


# -- opening a URL -----------------------------------------------------------------------------
def is_s3_url(url: str) -> bool:
    return url.startswith("s3://")


def open_backend(url: str, *, endpoint_url: str | None = None, create: bool = False) -> Backend:
    """Open a tier's storage: ``s3://bucket/prefix``, ``file:///path`` or a local path.

    ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (S3-compatible
    servers). A local folder must exist unless ``create``. ``gs://`` and ``az://`` (and
    ``s3://`` when the S3 driver is obstore) open the object-store backend.
    """
    url = canonical_url(url)
    if url.startswith(("gs://", "az://")) or (is_s3_url(url) and config.s3_driver() == "obstore"):
        from tierckpt.backends.objstore import ObjectStoreBackend

        return ObjectStoreBackend(url, endpoint_url=endpoint_url)  # S3: env endpoint too
    if is_s3_url(url):
        from tierckpt.backends.s3 import S3Backend

        return S3Backend(url, endpoint_url=config.s3_endpoint_url(endpoint_url))
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"unsupported URL scheme {scheme!r} in {redact(url)!r}: use a local path, "
            "file:///path, s3://, gs:// or az://"
        )
    path = local_folder(url, "tier URL")  # file://tmp/x is refused: a host, not tmp/x
    if not create and not os.path.isdir(path):
        if os.path.exists(path):
            raise CheckpointNotFound(
                f"{path}: is a file, not a folder: a tier URL names the tier's folder (the "
                "one holding manifests/)"
            )
        raise CheckpointNotFound(f"{path}: no such folder")
    return LocalBackend(path)  # creates the folder; a read-only location raises BackendError


# -- listing -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ListedCheckpoint:
    """One committed checkpoint: its manifest, or why the manifest could not be read.

    ``abandoned``: it is on an older timeline than the newest checkpoint there — the run went
    back to an older step and went on from it; retention removes these first, as older."""

    step: int
    manifest: Manifest | None
    error: str = ""
    timeline: int = 0
    abandoned: bool = False
    #: its manifest is of a format version a newer tierckpt writes (not damage)
    newer: bool = False

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)


def list_checkpoints(backend: Backend) -> list[ListedCheckpoint]:
    """Every committed checkpoint on ``backend``, oldest first (by timeline, then step), with
    its manifest; the last one is the newest."""
    out = []
    ids = committed_ids(backend)
    newest = ids[-1].timeline if ids else 0
    for cid in ids:
        abandoned = cid.timeline < newest
        try:
            m = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
            out.append(ListedCheckpoint(cid.step, m, "", cid.timeline, abandoned))
        except TierCkptError as exc:
            newer = isinstance(exc, NewerFormat)
            out.append(ListedCheckpoint(cid.step, None, str(exc), cid.timeline, abandoned, newer))
    return out


def uncommitted_ids(backend: Backend) -> list[CheckpointId]:
    """Checkpoints with data but no manifest: saves in progress, or leftovers of killed ones."""
    committed = set(committed_ids(backend))
    return [c for c in data_ids(backend) if c not in committed]


def uncommitted_steps(backend: Backend) -> list[int]:
    """Steps with data but no manifest (on any timeline): saves in progress, or leftovers."""
    return sorted({c.step for c in uncommitted_ids(backend)})


def resolve_id(
    backend: Backend, step: int | CheckpointId | None, timeline: int | None = None
) -> CheckpointId:
    """The committed checkpoint ``step`` names on ``backend``: of ``timeline`` if given, else of
    the newest timeline holding it; the newest checkpoint (of ``timeline``) if ``step`` is None.
    Raises ``CheckpointNotFound`` naming what is there."""
    ids = committed_ids(backend)
    if isinstance(step, CheckpointId):
        timeline = step.timeline
        step = step.step
    pool = [c for c in ids if timeline is None or c.timeline == timeline]
    of = "" if timeline is None else f" of timeline {timeline}"
    if step is None:
        if not pool:
            raise CheckpointNotFound(
                f"{backend.url}: no committed checkpoint{of} here"
                + _uncommitted_note(backend, ids, None, timeline)
                + (foreign_note(backend) if not ids else "")
            )
        return pool[-1]
    holding = [c for c in pool if c.step == step]
    if not holding:
        raise CheckpointNotFound(
            f"{backend.url}: step {step}{of} is not committed here"
            + _uncommitted_note(backend, ids, step, timeline)
        )
    return holding[-1]


#: how many of the newest committed checkpoints a "not committed here" message names
SHOWN_COMMITTED = 10


def _committed_text(ids: list[CheckpointId]) -> str:
    """``"Committed here: 8, 9, 10 (newest 10)"``: the newest few, a sentence of a message."""
    if not ids:
        return "No checkpoint is committed here"
    shown = ", ".join(id_text(c) for c in ids[-SHOWN_COMMITTED:])
    if len(ids) > SHOWN_COMMITTED:
        return f"{len(ids)} checkpoints are committed here, the newest {shown}"
    return f"Committed here: {shown} (newest {id_text(ids[-1])})"


def _uncommitted_note(
    backend: Backend, ids: list[CheckpointId], step: int | None, timeline: int | None
) -> str:
    """What a "not committed here" message goes on with: whether ``step`` (any step if None)
    has a save here without a manifest — in flight, or abandoned by a killed writer — what is
    committed, and what ``tierckpt gc`` does about such a save (never removing a committed
    checkpoint: its ``--keep-last`` is the number committed)."""

    committed = set(ids)

    def saves_in(names: list[str]) -> set[CheckpointId]:
        found = {parse_data_folder(n) for n in names}
        return {
            c
            for c in found
            if c is not None
            and c not in committed
            and (step is None or c.step == step)
            and (timeline is None or c.timeline == timeline)
        }

    try:
        complete = saves_in(backend.list(""))
        pending = backend.incomplete("")
        partial = saves_in(pending)
        live = [w for w in leases(backend) if w.alive] if complete | partial else []
        save = max(complete | partial) if complete | partial else None
        # judged as gc's sweep judges them: a killed writer's go with every gc
        writes = unfinished(backend, pending).get(save, NONE) if save in partial else NONE
    except Exception:  # the first listing worked: say what it told, not a second error
        return f". {_committed_text(ids)}" if ids or step is not None else ""
    if save is None:
        if not ids and step is None:
            return ""  # "no committed checkpoint here" said it
        nor = " and no save of it is either" if step is not None else ""
        return f"{nor}. {_committed_text(ids)}"
    which = f"Step {id_text(save)} has" if step is None else "It has"
    files = "shard files" if save in complete else "unfinished writes only"
    gc = f"tierckpt gc {backend.url} --keep-last {max(len(ids), 1)}"
    if ids and save < ids[-1]:
        what = "one that failed or was killed, older than the newest checkpoint"
        fix = f"`{gc}` removes it as a leftover, keeping every committed checkpoint"
    else:
        if live:
            w = live[0]
            what = f"probably in flight, as a live writer holds this location (rank {w.rank}: "
            what += f"{w.describe()}); wait for it to commit"
        elif writes.live:
            what = "in flight, as a live process holds the locks of its unfinished writes"
        else:
            what = "abandoned, as no live writer holds this location (a killed writer left it)"
        # gc (once something is committed: it removes nothing before) removes the unfinished
        # writes no process holds the locks of, whatever their step; --abort-incomplete those
        # whose writer the store cannot judge (an open upload), once no job writes here
        when = "Once no job writes here, " if live else ""
        dead = bool(ids) and writes.dead > 0 and not writes.unknown
        if save not in complete:
            if dead and not writes.live:
                fix = (
                    f"{when}`{gc}` removes it (its writer was killed: no process holds the "
                    "locks of its temporary files), keeping every committed checkpoint"
                )
            elif writes.live and not writes.unknown:
                fix = (
                    f"`{gc}` keeps it while its writer lives (it holds the locks of its "
                    "temporary files) and removes it once that writer is gone, keeping every "
                    "committed checkpoint"
                )
            else:
                fix = (
                    f"Once no job writes here, `{gc} --abort-incomplete` removes it (its "
                    "temporary files or open uploads), keeping every committed checkpoint"
                )
        else:
            stay = (
                "the shard files it completed stay until a newer checkpoint commits, then gc "
                "removes them as a leftover"
            )
            if writes.unknown or (writes.dead and not ids):
                fix = (
                    f"Once no job writes here, `{gc} --abort-incomplete` discards its "
                    f"unfinished writes, keeping every committed checkpoint; {stay}"
                )
            elif dead:
                fix = (
                    f"{when}`{gc}` discards its unfinished writes (their writer was killed: no "
                    f"process holds their locks), keeping every committed checkpoint; {stay}"
                )
            else:
                fix = f"Every committed checkpoint stays; {stay}"
    return f". {which} an uncommitted save here ({files}, no manifest): {what}. " + (
        f"{_committed_text(ids)}. {fix}"
    )


#: what files of other tools' checkpoints end with (torch.save, Lightning)
FOREIGN_SUFFIXES = (".pt", ".pth", ".ckpt")
#: files a "this is another tool's checkpoint" note names at most
FOREIGN_SHOWN = 3


def foreign_note(backend: Backend) -> str:
    """Where a location with no committed checkpoint holds another tool's checkpoint files
    (``torch.save``'s ``*.pt`` / ``*.pth`` / ``*.ckpt``, a DCP folder's ``.metadata``; here or
    a folder down), a
    sentence saying so (starting with ". "); else "". The tierckpt command reads tiers only."""
    try:
        names = backend.list("")
    except Exception:  # a hint only: never a second error
        return ""
    near = [n for n in names if n.count("/") <= 1]  # here or a folder down (DCP's step_<n>/)
    dcp = sorted(n for n in near if n.rsplit("/", 1)[-1] == ".metadata")
    pt = sorted(n for n in near if n.lower().endswith(FOREIGN_SUFFIXES))

    def shown(found: list[str]) -> str:
        more = f", ... ({len(found)} in all)" if len(found) > FOREIGN_SHOWN else ""
        return ", ".join(found[:FOREIGN_SHOWN]) + more

    if dcp:
        return (
            f". It holds {shown(dcp)}: a PyTorch Distributed Checkpoint (DCP) that dcp.save "
            "wrote to a plain folder, not a tierckpt tier (a folder holding "
            "manifests/), which is all the tierckpt command reads: read it with "
            "torch.distributed.checkpoint (dcp.load, or dcp_to_torch_save then torch.load). "
            "Saving DCP through tierckpt.dcp.TierWriter stores it in tiers "
            "(docs/coming-from.md)"
        )
    if pt:
        return (
            f". It holds {shown(pt)}: files of another tool's checkpoint (torch.save, "
            "Lightning), not a tierckpt tier (a folder holding manifests/), which is all the "
            "tierckpt command reads: load those with torch.load"
        )
    return ""


def resolve_step(backend: Backend, step: int | None) -> int:
    """``step`` if it is committed on ``backend``; the newest checkpoint's step if None."""
    return resolve_id(backend, step).step


def id_text(cid: CheckpointId) -> str:
    """A short form for listings: ``"1200"`` on timeline 0, ``"1200 (timeline 2)"`` else."""
    return f"{cid.step}" + (f" (timeline {cid.timeline})" if cid.timeline else "")


def _id(backend: Backend, step: int | CheckpointId, timeline: int | None) -> CheckpointId:
    """What a ``step`` argument names: a CheckpointId as it is; a step of ``timeline``; or a
    bare step: of the newest timeline holding it (timeline 0 when none does, so that the
    manifest read that follows says it is missing)."""
    if isinstance(step, CheckpointId):
        return step
    if timeline is not None:
        return CheckpointId(step, timeline)
    holding = [c for c in committed_ids(backend) if c.step == step]
    return holding[-1] if holding else CheckpointId(step)
