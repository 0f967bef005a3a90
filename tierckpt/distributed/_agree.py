"""The load agreement: every rank loads the same checkpoint, the newest all can read
(:func:`agree_on_step`); checkpoint ids as int64 for collectives (:func:`checkpoint_key`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence, Set
from typing import TYPE_CHECKING

import torch

from tierckpt.distributed._collectives import _group_ok, _warn_once, collective_device
from tierckpt.distributed._knobs import get_knobs
from tierckpt.distributed._nodeshare import ManifestCache
from tierckpt.distributed._records import _ranks
from tierckpt.errors import CheckpointNotFound, WorldSizeMismatch
from tierckpt.format import MAX_STEP, CheckpointId
from tierckpt.restore import is_recoverable, read_index, read_manifest

if TYPE_CHECKING:
    from tierckpt.pipeline import Tier

__all__ = ["agree_on_step", "checkpoint_key", "checkpoint_of_key"]

log = logging.getLogger("tierckpt")


def _readable(
    tiers: Sequence[Tier],
    rank: int,
    world_size: int,
    cid: CheckpointId,
    cache: ManifestCache | None = None,
    sizes: dict[CheckpointId, int] | None = None,
) -> str:
    """Empty if this rank can read ``cid`` (manifest + own shard index) on some tier, else
    why not. ``cache``: manifests the node's leader read (one read per node); ``sizes``: gets
    the world size ``cid`` was saved by where it is not this job's."""
    reasons = []
    for t in tiers:
        try:
            if cache is not None and (t.name, cid) in cache:
                m = cache.get(t.name, cid)
            else:
                m = read_manifest(t.backend, cid.step, t.name, timeline=cid.timeline)
            if m.world_size != world_size:
                if sizes is not None:
                    sizes[cid] = m.world_size
                reasons.append(
                    f"tier {t.name!r}: saved by {m.world_size} ranks, this job has "
                    f"{world_size} (the native format needs the same world size; save with "
                    "tierckpt.dcp to reshard)"
                )
                continue
            read_index(t.backend, m.shard_for(rank), t.name)
            return ""
        except CheckpointNotFound:
            continue
        except BaseException as exc:
            if not is_recoverable(exc):
                raise
            reasons.append(f"tier {t.name!r}: {exc}")
    return "; ".join(reasons) or "not on any tier"


#: a checkpoint id as one int64 for the load agreement: ordered like the ids
_ID_BASE = MAX_STEP + 1


def checkpoint_key(cid: CheckpointId) -> int:
    """A checkpoint id as one int64 (for collectives): ordered as the ids are."""
    return cid.timeline * _ID_BASE + cid.step


def checkpoint_of_key(key: int) -> CheckpointId:
    """The inverse of :func:`checkpoint_key`."""
    return CheckpointId(key % _ID_BASE, key // _ID_BASE)


def agree_on_step(
    candidates: Sequence[CheckpointId],
    *,
    tiers: Sequence[Tier],
    rank: int,
    world_size: int,
    cache: ManifestCache | None = None,
    prefetch: Callable[[Sequence[CheckpointId]], None] | None = None,
    newest_listed: bool = False,
    shared: Set[CheckpointId] = frozenset(),
) -> list[CheckpointId]:
    """The checkpoint every rank loads: the newest of ``candidates`` all ranks can read on
    ``tiers``.

    In the calling thread; every rank must call ``load()`` together. First each rank looks
    at its candidates newest first and stops at the first it can read; one ``all_gather`` of
    one int64 per rank: where every rank names the same checkpoint, that is the answer (the
    usual case: one manifest and one index read per tier, not one per candidate). Otherwise
    (ranks differ, e.g. one rank's newest is missing) a second ``all_gather`` of
    ``agree_max_candidates`` int64 per rank finds the newest checkpoint all can read; before
    it, ``prefetch`` (collective on every rank, where given) may read the remaining
    candidates' manifests once per node into ``cache``. Returns a one-element list, or raises
    ``CheckpointNotFound`` on every rank when the ranks share no readable checkpoint.

    ``newest_listed`` (a load of the newest without a fallback; ``candidates``: this rank's
    whole listing): the newest checkpoint *every rank lists*, readable or not, so that a
    damaged one fails the load instead of an older one being loaded in its place. Ranks list
    differently where a tier is node-private: a crash (or rank 0's exit) while a commit's
    manifest was being written onto each node's copy leaves some nodes a step ahead; that
    step is not the job's, and the newest every node holds is loaded. Not so where a rank
    holds a newer one on a tier every rank shares (``shared``: the candidates listed on
    such tiers): a listing that failed or raced a commit on some rank, so
    ``CheckpointNotFound`` (the load lists again, every rank together).
    """
    if not _group_ok(rank, world_size):
        _warn_once(
            "no-group-load",
            "multi-rank load without an initialized torch.distributed "
            "group: ranks cannot agree on a step; each loads its own newest",
        )
        if not candidates:
            raise CheckpointNotFound(f"rank {rank}: no committed checkpoint on any tier")
        return list(candidates[:1] if newest_listed else candidates)  # no silent fallback
    import torch.distributed as dist

    k = get_knobs()
    looked = list(candidates)[: k.agree_max_candidates]
    why: dict[CheckpointId, str] = {}
    sizes: dict[CheckpointId, int] = {}  # the world sizes of checkpoints not of this job's

    def readable(cid: CheckpointId) -> bool:
        if cid not in why:
            why[cid] = _readable(tiers, rank, world_size, cid, cache, sizes)
        return not why[cid]

    dev = collective_device()
    newest = next((c for c in looked if readable(c)), None)
    # the newest checkpoint of all saved by another world size: no rank loads an older one
    # in its place (the job would go on from there, and the newer run would be abandoned)
    mismatch = bool(looked) and looked[0] in sizes and bool(why[looked[0]])
    top = checkpoint_key(looked[0]) if looked else -1  # this rank's newest listed
    one = torch.tensor(
        [checkpoint_key(newest) if newest else -1, int(mismatch), top],
        dtype=torch.int64,
        device=dev,
    )
    firsts = [torch.empty_like(one) for _ in range(world_size)]
    dist.all_gather(firsts, one)
    if any(int(f[1].item()) for f in firsts):  # said on every rank, before any reads
        if not looked:
            raise WorldSizeMismatch(
                "another rank found the newest checkpoint saved by another number of ranks "
                f"than this job's {world_size}; see rank 0's error"
            )
        raise WorldSizeMismatch.of(looked[0], sizes.get(looked[0]), world_size)
    keys = {int(f[0].item()) for f in firsts}
    tops = {int(f[2].item()) for f in firsts}
    if len(keys) == 1 and newest is not None and (not newest_listed or tops == keys):
        return [newest]  # every rank's newest readable is the same checkpoint
    if newest_listed:
        return [_newest_listed(looked, rank, world_size, dev, shared)]
    if prefetch is not None:
        prefetch([c for c in looked if c not in why])
    mine = [c for c in looked if readable(c)]
    sets = _gathered(mine, world_size, dev)
    common = set.intersection(*sets)
    if common:
        chosen = checkpoint_of_key(max(common))
        if mine and chosen != mine[0]:
            log.warning(
                "rank %d: loading %s, the newest checkpoint every rank can read (this rank "
                "also has %s)",
                rank,
                chosen,
                ", ".join(str(c) for c in [c for c in mine if c > chosen][:5]),
            )
        return [chosen]
    newest_of = {r: str(checkpoint_of_key(max(s))) if s else None for r, s in enumerate(sets)}
    lacking = [r for r, s in newest_of.items() if s is None]
    failed = {c: w for c, w in why.items() if w}
    detail = "; ".join(f"{c}: {w}" for c, w in list(failed.items())[:3])
    raise CheckpointNotFound(
        f"no checkpoint step is committed and readable on every rank (this rank looked at "
        f"{', '.join(map(str, list(candidates)[:5])) or 'no committed step'}; newest readable "
        f"checkpoint per rank: {dict(list(newest_of.items())[:16])}; ranks with none: "
        f"{_ranks(lacking)})" + (f"; this rank (rank {rank}): {detail}" if detail else "")
    )


def _newest_listed(
    looked: Sequence[CheckpointId],
    rank: int,
    world_size: int,
    dev: torch.device,
    shared: Set[CheckpointId],
) -> CheckpointId:
    """The newest of ``looked`` that every rank lists (one ``all_gather``, one all-reduce)."""
    import torch.distributed as dist

    sets = _gathered(looked, world_size, dev)
    common = set.intersection(*sets)
    if not common:
        newest_of = {r: str(checkpoint_of_key(max(s))) if s else None for r, s in enumerate(sets)}
        raise CheckpointNotFound(
            "no checkpoint is committed on every rank's tiers (newest per rank: "
            f"{dict(list(newest_of.items())[:16])})"
        )
    chosen = checkpoint_of_key(max(common))
    ahead = [c for c in looked if c > chosen]
    seen = torch.tensor([int(any(c in shared for c in ahead))], dtype=torch.int64, device=dev)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if int(seen.item()):
        raise CheckpointNotFound(
            "the ranks list different checkpoints on a tier they share (a listing that failed "
            "or raced a commit on some rank); newest per rank: "
            f"{ {r: str(checkpoint_of_key(max(s))) if s else None for r, s in enumerate(sets)} }"
        )
    if ahead:
        log.warning(
            "rank %d: loading %s, the newest checkpoint every rank holds; this rank's tiers also "
            "hold %s, which other ranks' do not (a node-private tier whose commit a crash or "
            "an early exit cut short): not the job's; its next saves go on a new timeline",
            rank,
            chosen,
            ", ".join(str(c) for c in ahead[:5]),
        )
    return chosen


def _gathered(ids: Sequence[CheckpointId], world_size: int, dev: torch.device) -> list[set[int]]:
    """Every rank's ``ids`` (at most ``agree_max_candidates``), as checkpoint keys: one
    ``all_gather`` of a fixed-size vector."""
    import torch.distributed as dist

    vec = torch.full((get_knobs().agree_max_candidates,), -1, dtype=torch.int64, device=dev)
    if ids:
        vec[: len(ids)] = torch.tensor(
            [checkpoint_key(c) for c in ids], dtype=torch.int64, device=dev
        )
    gathered = [torch.empty_like(vec) for _ in range(world_size)]
    dist.all_gather(gathered, vec)
    return [{int(v) for v in g.tolist() if v >= 0} for g in gathered]
