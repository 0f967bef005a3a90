"""The coordinator's side of a DCP save: the timeline, chosen before any rank writes; then
the commit: every rank's shard report gathered and, on each tier where every rank's shard is
durable, DCP's metadata file and, last, the tier's manifest (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt import config
from tierckpt._version import __version__
from tierckpt.catalog import (
    committed_within,
    newer_than,
    newest_committed_within,
    stale_timeline,
    timeline_for,
)
from tierckpt.dcp._common import METADATA_VERSION
from tierckpt.dcp._metadata import _RankShards, _ShardOnTier
from tierckpt.dcp._saves import mixed
from tierckpt.errors import (
    BackendError,
    CheckpointExists,
    CheckpointFailed,
    SaveDeadlineExceeded,
    TierCkptError,
)
from tierckpt.format import (
    CheckpointId,
    Manifest,
    checksum,
    dcp_metadata_name,
    encode_manifest,
    manifest_name,
)
from tierckpt.pipeline import Tier

log = logging.getLogger("tierckpt")

#: called once a tier's manifest is written: apply that tier's retention (in the background)
RetainFn = Callable[[Tier], None]


def choose_timeline(
    tiers: list[Tier],
    step: int,
    timeline: int | None,
    last: CheckpointId | None,
    *,
    overwrite: bool,
    unconfirmed: frozenset[str] = frozenset(),
    loaded: CheckpointId | None = None,
) -> tuple[int, frozenset[str]]:
    """The timeline of a save of ``step`` by a writer on ``timeline`` (None: not chosen yet)
    whose previous save was ``last`` (see ``TierWriter.prepare_global_plan``), and the tiers
    whose newest checkpoint is unknown: each tier is listed on a thread of its own and waited
    for at most ``TIERCKPT_LEASE_WAIT_S``, as ``Checkpointer`` does; a tier that did not tell
    (or was ``unconfirmed`` already, where nothing was listed) is checked at the commit
    (:func:`confirm_timeline`).

    The timeline is chosen from the tiers at the first save, when ``step`` is below the
    previous save's, and after a load (``loaded``: the checkpoint this process loaded from
    these tiers since the previous save), as for ``Checkpointer``: a step not after the newest
    checkpoint starts a new timeline. A step already committed where the save would go is
    refused (``CheckpointExists``; ``overwrite=True``: saved again on a new timeline): on the
    timeline the writer goes on with, or else on the newest timeline (the checkpoint that
    ``checkpoint_id`` names for ``TierReader``) — except after a load of an older checkpoint
    than the newest (a rollback: the run resumed from it and saves on a new timeline)."""
    newest: CheckpointId | None = None
    pairs = [(t.name, t.backend) for t in tiers]
    if timeline is not None and loaded is None and (last is None or step >= last.step):
        there_on = timeline
    else:
        newest, unconfirmed = newest_committed_within(pairs, config.lease_wait_s())
        if last is not None and (newest is None or last > newest):
            newest = last
        timeline = timeline_for(step, newest)
        there_on = newest.timeline if newest is not None else timeline
        if newest is not None and loaded is not None and loaded < newest:
            there_on = timeline  # a rollback: a new timeline when step is not after newest
            log.info("DCP save of step %d after a load of %s: timeline %d", step, loaded, timeline)
    # a tier that did not answer is not asked again here (it may hang), nor is one waited
    # for longer than the listing: each copy's start refuses a step committed there, and the
    # check before the commit a newer checkpoint (an outage must not cost the other tiers
    # their copy: before, a hung store failed the whole save after its timeouts)
    there_names, silent = committed_within(
        [(t.name, t.backend) for t in tiers if t.name not in unconfirmed],
        CheckpointId(step, there_on),
        config.lease_wait_s(),
    )
    unconfirmed |= silent
    there = [t for t in tiers if t.name in there_names]
    if there and not overwrite:
        t = there[0]
        raise CheckpointExists(
            f"Checkpoint already exists: {CheckpointId(step, there_on)} is already "
            f"committed on tier {t.name!r} ({t.backend.url}); refusing to overwrite it — "
            "save under another step, or pass TierWriter(..., overwrite=True) to save it "
            "again on a new timeline (the committed one stays)"
        )
    if there:
        if newest is None:
            newest, more = newest_committed_within(pairs, config.lease_wait_s())
            unconfirmed |= more
        top = max(c for c in (newest, last, CheckpointId(step, there_on)) if c is not None)
        # as a rollback does: a new timeline above every one there; the old save stays
        timeline = timeline_for(step, CheckpointId(step, top.timeline))
        log.warning(
            "DCP step %d is already committed (timeline %d); overwrite=True: saving it "
            "again on timeline %d, the committed one is kept",
            step,
            there_on,
            timeline,
        )
    return timeline, unconfirmed


def confirm_timeline(t: Tier, cid: CheckpointId) -> BaseException | None:
    """Before ``cid`` is committed on ``t``, a tier not listed when its timeline was chosen:
    listed now. None where it holds nothing newer; else why it must not take the commit: a
    newer checkpoint there (``StaleTimeline``; the writer chooses its timeline again at its
    next save), or a listing that failed again."""
    try:
        newer = newer_than(t.backend, cid)
    except (TierCkptError, OSError) as exc:
        return exc
    if newer is None:
        return None
    return stale_timeline(cid, t.name, newer)


def gather_reports(
    step: int, world: int, results: list[list[WriteResult]], save_id: str
) -> tuple[dict[int, _RankShards], dict[MetadataIndex, Any]]:
    """Every rank's shard report, by rank, and the items' storage locations; a save whose
    reports do not come from every rank of ``world``, or include another save's (``save_id``:
    this one's), fails (nothing of it is committed)."""
    shards: dict[int, _RankShards] = {}
    storage: dict[MetadataIndex, Any] = {}
    for per_rank in results:
        for wr in per_rank:
            if isinstance(wr.storage_data, _RankShards):
                if wr.storage_data.save_id != save_id:
                    raise mixed(
                        f"rank {wr.storage_data.rank}'s shard report",
                        f"save {wr.storage_data.save_id}",
                        f"step {step} (save {save_id})",
                    )
                shards[wr.storage_data.rank] = wr.storage_data
            else:
                storage[wr.index] = wr.storage_data
    if sorted(shards) != list(range(world)):
        raise CheckpointFailed(f"step {step}: shard reports from ranks {sorted(shards)} only")
    return shards, storage


#: told, for each tier of ``unconfirmed`` that took part in a commit, what its check found
#: (None: nothing newer there)
ConfirmFn = Callable[[str, BaseException | None], None]


def commit_all(
    tiers: list[Tier],
    cid: CheckpointId,
    world: int,
    shards: dict[int, _RankShards],
    blob: bytes,
    retain: RetainFn,
    unconfirmed: frozenset[str] = frozenset(),
    on_confirm: ConfirmFn | None = None,
    deadline: float = math.inf,
) -> None:
    """Commit ``cid`` on every tier where all ``world`` ranks' shards are durable; a tier
    where some ranks failed is left uncommitted (logged), and so is a tier of
    ``unconfirmed`` (not listed when the timeline was chosen) that :func:`confirm_timeline`
    refuses, checked right before its commit. The tiers commit side by side, each on a
    thread of its own, and the save waits for them at most ``deadline`` seconds (the
    writer's ``save_deadline``): a tier still writing then is given up (logged, as a tier
    whose copy stalled is, so a store that stopped answering holds every rank's save no
    longer than that). Raises :class:`CheckpointFailed` when no tier took the checkpoint."""
    committed: list[str] = []
    failed: dict[str, BaseException] = {}
    ready: list[Tier] = []
    for t in tiers:
        missing = [r for r in range(world) if t.name not in shards[r].tiers]
        if len(missing) == world:
            errs = [shards[r].errors[t.name] for r in missing if t.name in shards[r].errors]
            if errs:  # its copies failed on every rank (each logged where it failed)
                failed[t.name] = CheckpointFailed(errs[0])
            continue  # else this tier did not take part in this save
        if missing:
            why = {r: shards[r].errors.get(t.name, "?") for r in missing[:3]}
            failed[t.name] = CheckpointFailed(f"ranks {missing[:10]} failed there: {why}")
            log.error("step %d not committed on tier %s: %s", cid.step, t.name, failed[t.name])
            continue
        ready.append(t)
    runs = [
        _TierCommit(t, t.name in unconfirmed, [shards[r].tiers[t.name] for r in range(world)])
        for t in ready
    ]
    for c in runs:
        c.start(cid, world, blob)
    end = time.monotonic() + deadline
    for c in runs:
        c.thread.join(None if math.isinf(end) else max(0.0, end - time.monotonic()))
        if c.thread.is_alive():
            c.given_up.set()  # it writes no manifest from now on
            failed[c.tier.name] = late = SaveDeadlineExceeded(
                f"DCP step {cid.step}: tier {c.tier.name!r} ({c.tier.backend.url}) did not "
                f"finish its commit within save_deadline ({deadline:g} s); given up there so "
                "the save goes on (a manifest write already sent may still land: the step is "
                "then committed there as well)"
            )
            log.error("%s", late)
            continue
        if c.checked and on_confirm is not None:
            on_confirm(c.tier.name, c.refused)
        exc: BaseException | None = c.refused or c.error
        if exc is None:
            committed.append(c.tier.name)
            retain(c.tier)
            continue
        if not isinstance(exc, (BackendError, OSError, TierCkptError)):
            raise exc
        failed[c.tier.name] = exc
        log.error(
            "step %d not committed on tier %s: %s: %s",
            cid.step,
            c.tier.name,
            type(exc).__name__,
            exc,
        )
    if not committed:
        causes = "; ".join(f"{name}: {exc}" for name, exc in failed.items())
        raise CheckpointFailed(
            f"DCP step {cid.step} was committed on no tier" + (f" ({causes})" if causes else ""),
            failed,
        )


@dataclass(eq=False)
class _TierCommit:
    """One tier's commit of a DCP save, on a thread of its own (see :func:`commit_all`)."""

    tier: Tier
    #: check the tier's newest checkpoint first (:func:`confirm_timeline`)
    check: bool
    refs: list[_ShardOnTier]
    given_up: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread = field(init=False)
    checked: bool = False
    refused: BaseException | None = None
    error: BaseException | None = None

    def start(self, cid: CheckpointId, world: int, blob: bytes) -> None:
        self.thread = threading.Thread(
            target=self._run,
            args=(cid, world, blob),
            name=f"tierckpt-dcp-commit-{self.tier.name}",
            daemon=True,  # a store that never answers must not hold the interpreter's exit
        )
        self.thread.start()

    def _run(self, cid: CheckpointId, world: int, blob: bytes) -> None:
        try:
            if self.check:
                self.refused = confirm_timeline(self.tier, cid)
                self.checked = True
                if self.refused is not None:
                    return
            commit_tier(self.tier, cid, world, self.refs, blob, self.given_up)
        except BaseException as exc:  # handed to the save's thread
            self.error = exc


def commit_tier(
    t: Tier,
    cid: CheckpointId,
    world: int,
    shards: list[_ShardOnTier],
    blob: bytes,
    given_up: threading.Event | None = None,
) -> None:
    """Write DCP's metadata ``blob`` on ``t``, then the manifest listing every rank's shard
    (the commit: a tier without the manifest holds no checkpoint); none once ``given_up``
    is set."""
    step = cid.step
    name = dcp_metadata_name(step, timeline=cid.timeline)
    t.backend.put_atomic(name, blob, overwrite=True)
    if given_up is not None and given_up.is_set():
        raise SaveDeadlineExceeded(f"DCP step {step}: commit on tier {t.name!r} given up")
    m = Manifest(
        step=step,
        world_size=world,
        shards=tuple(s.ref for s in shards),
        created=time.time(),
        library_version=__version__,
        tier=t.name,
        raw_bytes=sum(s.raw_bytes for s in shards),
        stored_bytes=sum(s.stored_bytes for s in shards) + len(blob),
        codecs=tuple(sorted({s.codec for s in shards})),
        metadata={
            "dcp": {
                "file": name,
                "size": len(blob),
                "checksum": checksum(blob),
                "encoding": "json+zstd",
                "version": METADATA_VERSION,
            }
        },
        timeline=cid.timeline,
    )
    t.backend.put_atomic(manifest_name(step, timeline=cid.timeline), encode_manifest(m))
    log.info("DCP %s committed on tier %s (%d ranks)", cid, t.name, world)
