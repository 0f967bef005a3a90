"""The load half of :class:`~tierckpt.Checkpointer`: list the tiers, choose the checkpoint
(with the job's other ranks), read the first readable copy, fastest tier first.

The facade hands each call a :class:`LoadContext` built at that call, so that what a load sees
(tiers, commit strategy) is what the checkpointer holds at that moment.

A load onto a GPU (``map_location="cuda"``, or ``into=`` tensors on one CUDA device) reads
through pinned staging straight onto the device (:mod:`tierckpt.restore_gpu`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tierckpt import config
from tierckpt.arena import HostArena
from tierckpt.catalog import (
    committed_ids,
    lineage,
    list_tiers,
    listed_once,
    steps_of,
    unreadable,
)
from tierckpt.checkpointer._auto_feedback import feed_policy
from tierckpt.checkpointer._load_errors import committed_yet_unread
from tierckpt.checkpointer._near import first_look, near_tiers
from tierckpt.checkpointer._retention import Protectors
from tierckpt.checkpointer._to_device import to_device
from tierckpt.codecs import SupportsObserveRead
from tierckpt.commit import CommitStrategy
from tierckpt.errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    TierCkptError,
    WorldSizeMismatch,
)
from tierckpt.format import CheckpointId, manifest_name
from tierckpt.lease import judge_holder, lease_name, list_leases
from tierckpt.noderam_map import read_shard_mapped
from tierckpt.pipeline import Tier
from tierckpt.redact import redact
from tierckpt.restore import (
    LoadedShard,
    check_into,
    is_recoverable,
    read_shard,
    refuse_dcp,
    restore_into,
    start_tail,
)
from tierckpt.restore_gpu import DeviceTarget, read_shard_to_device, target_for
from tierckpt.retention import gc_tier

__all__ = ["LOAD_ATTEMPTS", "LoadContext", "list_checkpoints", "list_each_tier", "load"]

log = logging.getLogger("tierckpt")

#: loads of the newest step: how often load() lists again when the step it chose vanishes
LOAD_ATTEMPTS = 5


@dataclass(frozen=True, slots=True)
class LoadContext:
    """What a load needs from its checkpointer, taken at each call."""

    tiers: Sequence[Tier]
    rank: int
    world_size: int
    strategy: CommitStrategy
    #: the tier of this name (``KeyError`` naming the tiers for any other)
    tier_named: Callable[[str], Tier]
    #: the pool shard reads run on (created at the first load)
    read_pool: Callable[[], ThreadPoolExecutor]
    #: called once the arguments are checked: the next save chooses its timeline again
    forget_timeline: Callable[[], None]
    #: the peer replicator's ``prepare_load`` (a PeerTier in the policy), else None: run
    #: before a load of all tiers, it may choose the checkpoint (see tierckpt.peer)
    prepare_load: Callable[[int | None, int | None], CheckpointId | None] | None = None
    #: the host arena as it is now (None: not built yet), whose free slots a load onto a
    #: GPU stages chunks in
    staging: Callable[[], HostArena | None] | None = None
    #: ``Checkpointer.protect_steps``: the steps being read are kept from this process's own
    #: retention while they are read (a save committing beside the load would delete them),
    #: and applied when a load's copies to faster tiers commit there (:func:`retain_repopulated`)
    protectors: Protectors | None = None
    #: the steps of this checkpointer's saves still in flight (named where a load finds
    #: nothing: a load right after save() does not wait for it)
    saving: Callable[[], list[int]] | None = None


def list_checkpoints(ctx: LoadContext, tier: str | None, hint: bool = False) -> list[CheckpointId]:
    """Committed checkpoints on ``tier`` or on any tier, oldest first (see
    :meth:`~tierckpt.Checkpointer.checkpoints`); ``hint``: where none is, say once where
    tier locations near these are (a warning)."""
    if tier is not None:
        return committed_ids(ctx.tier_named(tier).backend)
    listing, unlisted = _list_all(ctx)
    out = {c for ids in listing.values() for c in ids}
    if unlisted and not out:
        raise unreadable(unlisted, listing, "no checkpoint is committed")
    if hint and not out and first_look(ctx.tiers):  # `if ck.steps(): load()`, a wrong place
        near_tiers(ctx.tiers, listing.keys(), ctx.rank, "listing")  # a hint: a warning
    return sorted(out)


def list_each_tier(ctx: LoadContext) -> dict[str, list[CheckpointId]]:
    """Each tier's committed checkpoints (:meth:`~tierckpt.Checkpointer.tier_steps`): the
    tiers that could not be listed are left out (logged), or all: ``TiersUnreadable``."""
    listing, unlisted = _list_all(ctx)
    if unlisted and len(unlisted) == len(listing):
        raise unreadable(unlisted, listing, "no checkpoint is committed")
    return {n: ids for n, ids in listing.items() if n not in unlisted}


def _list_all(ctx: LoadContext) -> tuple[dict[str, list[CheckpointId]], dict[str, str]]:
    """Every tier listed for the caller to see: a hung tier is left out after the wait where
    another answered, as in a load (``catalog.list_tiers``)."""
    return list_tiers(
        ((t.name, t.backend) for t in ctx.tiers), config.lease_wait_s(), for_listing=True
    )


def load(
    ctx: LoadContext,
    step: int | None,
    *,
    into: Any,
    tier: str | None,
    map_location: str | torch.device | None,
    fallback: Literal["error", "previous"],
    timeline: int | None,
    strict: bool = True,
    device: torch.device | None = None,
) -> Any:
    """:meth:`~tierckpt.Checkpointer.load`: one listing and load, listed again (up to
    ``LOAD_ATTEMPTS`` times; in a multi-rank job every rank together, where any rank's read
    failed so) when retention removed the chosen checkpoint while it was being read. Every
    rank ends the load alike: all return, or all raise. ``device``: a CUDA device to restore
    onto where it has room (the device of ``Stateful`` targets), else the host."""
    # the steps being read, kept from this process's retention: a step asked for from before
    # the tiers are listed (a pass that chose it before spares it if it has not begun to
    # delete it), the newest once chosen (if it vanishes first, the tiers are listed again)
    hold, unprotect = ctx.protectors.reading() if ctx.protectors is not None else (None, None)
    if hold is not None and step is not None:
        hold((step,))
    try:
        seen: CheckpointId | None = None  # the newest checkpoint listed after the last failure
        # what this writer was saving: committed during the load, it is not "unreadable"
        in_flight = set(ctx.saving()) if ctx.saving else set()

        def failed(error: BaseException) -> BaseException:
            ids = functools.partial(list_checkpoints, ctx, tier)
            return committed_yet_unread(error, ids, step, timeline, fallback, in_flight)

        ctx.read_pool()  # its threads start while the tiers are listed and the ranks agree
        # fallback="previous" with several ranks: the checkpoints agreed on whose read failed
        # on some rank (each attempt walks back past them, every rank together)
        walked: list[CheckpointId] | None = [] if fallback == "previous" else None
        for attempt in range(LOAD_ATTEMPTS):
            got: Any = None
            error: BaseException | None = None
            try:
                got = _load_once(
                    ctx,
                    step,
                    into=into,
                    tier=tier,
                    map_location=map_location,
                    fallback=fallback,
                    timeline=timeline,
                    device=device,
                    hold=hold,
                    walked=walked,
                )
                if into is not None:  # checked here, copied once every rank's load worked
                    check_into(into, got, strict=strict)
                code = 0
            except CheckpointNotFound as exc:
                error, code = exc, 1
            except BaseException as exc:  # 3: not the data's (Ctrl-C, a state mismatch)
                error, code = exc, 2 if is_recoverable(exc) else 3
            # every rank ends the load alike: none goes on with a state while another raised
            # (retention deleted its shard after the ranks agreed on the step, say)
            worst = ctx.strategy.agree_on_outcome(code)
            if worst == 0:
                return got if into is None else restore_into(into, got, strict=strict)
            last = attempt == LOAD_ATTEMPTS - 1
            if ctx.world_size != 1:
                if worst == 1 and step is None and not last:
                    log.info("load: a rank's chosen step vanished (retention?); listing again")
                    continue  # the newest again, on every rank together
                if worst == 2 and walked and not last:
                    log.warning(
                        "load: %s could not be read on every rank (see the failing rank's "
                        "error); fallback='previous': the one before it, every rank together",
                        walked[-1],
                    )
                    continue
                if error is None:
                    error = (CheckpointNotFound if worst == 1 else TierCkptError)(
                        f"rank {ctx.rank} loaded its shard, but another rank's load failed (see "
                        "its error): the load fails on every rank, so that none goes on alone"
                    )
                raise failed(error)
            assert error is not None  # one rank: the outcome is its own
            if code != 1 or step is not None or last:
                raise failed(error)
            try:
                newest = max(list_checkpoints(ctx, tier), default=None)
            except TierCkptError:
                newest = None
            if newest is None or newest == seen:  # nothing newer appeared: really unreadable
                raise failed(error)
            seen = newest
            log.info("load: the chosen step vanished (retention?); listing again")
    finally:
        if unprotect is not None:
            unprotect()
    raise AssertionError("unreachable")  # pragma: no cover


def _load_once(
    ctx: LoadContext,
    step: int | None,
    *,
    into: Any,
    tier: str | None,
    map_location: str | torch.device | None,
    fallback: Literal["error", "previous"],
    timeline: int | None,
    device: torch.device | None = None,
    hold: Callable[[Iterable[int]], None] | None = None,
    walked: list[CheckpointId] | None = None,
) -> Any:
    """One listing of the tiers and one load of the step chosen from it (``into`` chooses
    the device; the caller copies into it once every rank's load worked). The steps chosen
    are passed to ``hold`` (kept from retention) before they are read. ``walked``: the
    checkpoints a fallback already tried (left out), and gets the one agreed on."""
    if fallback not in ("error", "previous"):
        raise ValueError("fallback must be 'error' or 'previous'")
    ctx.forget_timeline()  # the run may have gone back: the next save decides again
    tiers = [ctx.tier_named(tier)] if tier is not None else list(ctx.tiers)
    # each tier listed once per load: the peer replicator's prepare_load lists the slower
    # tiers, and this listing reuses what it saw (not node RAM: the pulls commit there)
    with listed_once(t.backend for t in tiers if not t.backend.is_node_local):
        if ctx.prepare_load is not None and tier is None:
            # every rank restores the same checkpoint: shards missing from a node's RAM are
            # pulled from partners first (a collective on the peer tier's own group)
            chosen = ctx.prepare_load(step, timeline)
            if chosen is not None and step is None:
                step, timeline = chosen.step, chosen.timeline
        # a hung tier is left out after the wait where another holds a checkpoint
        listing, unlisted = list_tiers(((t.name, t.backend) for t in tiers), config.lease_wait_s())
    all_ids = sorted({c for v in listing.values() for c in v}, reverse=True)
    if timeline is not None:
        all_ids = [c for c in all_ids if c.timeline == timeline]
    where = ", ".join(f"{t.name}: {redact(t.backend.url)}" for t in tiers)
    candidates: list[CheckpointId]
    if step is not None:
        holding = [c for c in all_ids if c.step == step]
        what = f"step {step}" + (f" of timeline {timeline}" if timeline is not None else "")
        missing = (
            f"{what} is not committed on any tier ({where}); committed steps: "
            f"{steps_of(all_ids)[-10:] or 'none'}"
        )
        if not holding:
            # held by no tier here: the load fails (with several ranks: on every rank, in
            # agree_on_step)
            candidates = [CheckpointId(step, timeline or 0)]
        else:
            candidates = lineage(all_ids, holding[0]) if fallback == "previous" else holding[:1]
    else:
        missing = f"no committed checkpoint on any tier ({where})" + (
            f" of timeline {timeline}" if timeline is not None else ""
        )
        # without a fallback, the newest every rank lists (a node-private tier may hold a
        # newer step on some nodes only: not the job's); one rank: the newest
        candidates = lineage(all_ids) if fallback == "previous" else all_ids
    if not all_ids:
        # not around a tier that did not answer its listing (a second wait as long)
        missing += near_tiers(tiers, listing.keys() - set(unlisted), ctx.rank)
    if (saving := ctx.saving() if ctx.saving else []) and (step is None or step in saving):
        missing += f"; this Checkpointer is still saving step(s) {saving}: call ck.wait() first"
    got: LoadedShard | None = None
    try:
        # every rank must load the same checkpoint: the newest all ranks can read
        if walked:
            candidates = [c for c in candidates if c not in walked]
        newest_listed = step is None and fallback != "previous"  # then by tier: see commit.py
        candidates = ctx.strategy.agree_on_step(
            candidates, listed=listing if newest_listed else None
        )
        if walked is not None and ctx.world_size != 1:
            walked.extend(candidates[:1])
        if hold is not None:
            hold(c.step for c in candidates)
        target = target_for(into, map_location)
        if target is None and device is not None and map_location is None:
            target = DeviceTarget(device, optional=True)
        try:
            got = _load_candidates(ctx, tiers, listing, candidates, missing, target)
        finally:
            # the copies to faster tiers become a checkpoint there; with several ranks only
            # once every rank's file is in: a collective, reached by every rank whether its
            # load worked or not
            ctx.strategy.publish_repopulated(got)
        if got is not None and candidates and got.manifest.id != candidates[0]:
            log.warning(  # a state without a step key of its own would not tell
                "load(fallback='previous'): %s could not be read; loaded the older %s",
                candidates[0],
                got.manifest.id,
            )
        if got is not None and got.repopulated:
            retain_repopulated(ctx, got)
    except CheckpointNotFound as exc:
        if unlisted:  # a readable copy may be on a tier that could not be listed
            if any(step is None or c.step == step for c in all_ids):
                what = f"it could not be read ({exc})"
            elif step is None:
                what = "no checkpoint is committed"
            else:
                what = f"step {step} is not committed"
            raise unreadable(unlisted, listing, what) from exc
        raise
    on_target = target is not None and not target.optional  # read onto map_location itself
    if on_target or map_location is None:
        return got.state
    return to_device(got.state, torch.device(map_location))


def retain_repopulated(ctx: LoadContext, loaded: LoadedShard) -> None:
    """Apply the rules of each tier a load copied its checkpoint onto (``repopulate``): that
    copy committed there, and a process that only loads (an evaluator with a local cache in
    front of S3) never saves, so no commit of its own would ever apply them: it kept every
    checkpoint it loaded. The loaded one is kept; a tier a live writer holds is left to that
    writer's retention (a trainer sharing the folder, this process once it saves), and so is
    a multi-rank job's (its retention is per rank, after its own commits)."""
    if ctx.world_size != 1:
        return
    for tier in ctx.tiers:
        backend = tier.backend
        if backend not in loaded.repopulated:
            continue
        try:
            held = [
                rec is None or judge_holder(backend, lease_name(rank), rec)[0]
                for rank, rec, _why in list_leases(backend)
            ]
            if any(held):
                continue  # a writer's own retention runs after its next commit
            gone = gc_tier(
                backend,
                tier.spec.retention,
                protect={loaded.manifest.id},
                protect_steps=ctx.protectors.steps() if ctx.protectors is not None else (),
                deleting=ctx.protectors.deleting if ctx.protectors is not None else None,
                sweep=False,  # leftovers of writers are their business, or gc's
            )
        except (OSError, TierCkptError) as exc:
            log.warning("retention on tier %s after a load's copy failed: %s", tier.name, exc)
            continue
        if gone:
            log.info("tier %s: removed %s after the load's copy", tier.name, steps_of(gone))


def _load_candidates(
    ctx: LoadContext,
    tiers: list[Tier],
    listing: dict[str, list[CheckpointId]],
    candidates: list[CheckpointId],
    missing: str,
    target: DeviceTarget | None = None,
) -> LoadedShard:
    """The first readable copy of the first candidate, tiers fastest first.
    ``CheckpointNotFound(missing)`` where no tier holds any candidate."""
    errors: list[str] = []
    first_exc: BaseException | None = None
    for cid in candidates:
        holders = [t for t in tiers if cid in listing[t.name]]
        for t in holders:
            try:
                loaded = _load_from(ctx, t, cid, target)
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
                first_exc = first_exc or exc
                errors.append(f"{cid} on tier {t.name!r}: {exc}")
                # removed since it was listed (this writer's retention, beside its saves): the
                # next tier's copy is the expected path, said quietly; a file missing under a
                # manifest still there is damage, said aloud
                gone = isinstance(exc, CheckpointNotFound) and not _still_listed(t, cid)
                level = logging.INFO if gone else logging.WARNING
                log.log(
                    level, "load of %s from tier %s failed, trying the next: %s", cid, t.name, exc
                )
                continue
            log.info(
                "loaded %s from tier %s: %d bytes in %.3f s",
                cid,
                t.name,
                loaded.raw_bytes,
                loaded.seconds,
            )
            return loaded
    if not errors:
        raise CheckpointNotFound(missing)
    msg = "no readable copy of the checkpoint: " + "; ".join(errors)
    if isinstance(first_exc, CorruptCheckpoint):
        raise CorruptCheckpoint(msg) from first_exc
    if isinstance(first_exc, TierCkptError):
        raise type(first_exc)(msg) from first_exc
    raise CorruptCheckpoint(msg) from first_exc


def _load_from(
    ctx: LoadContext, tier: Tier, cid: CheckpointId, target: DeviceTarget | None = None
) -> LoadedShard:
    step = cid.step
    # from a remote store the shard file's tail is read while the manifest is: its name is
    # the one this tier's layout gives (checked against the manifest's before it is used)
    early = None
    if tier.backend.is_remote and target is None:
        early = start_tail(tier.backend, tier.shard_file(cid, ctx.rank), ctx.read_pool())
    manifest = ctx.strategy.read_manifest(tier, cid)  # multi-rank: once per node
    refuse_dcp(manifest, f"tier {tier.name!r} {tier.backend.url}")  # every path: GPU, node RAM
    if manifest.world_size != ctx.world_size:
        raise WorldSizeMismatch.of(cid, manifest.world_size, ctx.world_size)
    repop = []
    if ctx.strategy.repopulates and tier.backend.is_remote:
        for t in ctx.tiers:
            if (
                t.backend.is_durable
                and not t.backend.is_remote
                and t.backend.supports_random_write
                and not t.backend.exists(manifest_name(step, timeline=cid.timeline))
            ):
                repop.append(t.backend)
    if not repop and (target is None or not target.optional):
        # node RAM: tensors over a copy-on-write map of the shard, no copy (a GPU target
        # copies straight from the map); None where it does not map (compressed chunks)
        mapped = read_shard_mapped(tier.backend, tier.name, manifest, ctx.rank, ctx.read_pool())
        if mapped is not None:
            if target is not None:
                mapped.state = to_device(mapped.state, target.device)
            return mapped
    if target is not None:
        return read_shard_to_device(
            tier.backend,
            tier.name,
            manifest,
            ctx.rank,
            ctx.read_pool(),
            target,
            arena=ctx.staging() if ctx.staging is not None else None,
            repopulate=repop,
            publish=False,
        )
    loaded = read_shard(
        tier.backend,
        tier.name,
        manifest,
        ctx.rank,
        ctx.read_pool(),
        repopulate=repop,
        publish=False,  # the strategy's publish_repopulated commits the copies
        early=early,
    )
    if isinstance(tier.codec, SupportsObserveRead):  # the auto policy learns the restore's speed
        # (and, where the load was compressed, what a raw one would take: _auto_feedback)
        feed_policy(tier, loaded, ctx.rank, ctx.read_pool())
    return loaded


def _still_listed(tier: Tier, cid: CheckpointId) -> bool:
    """Whether ``cid``'s manifest is still on ``tier`` (after a read of it failed)."""
    try:
        return tier.backend.exists(manifest_name(cid.step, timeline=cid.timeline))
    except Exception:  # cannot tell: said aloud
        return True
