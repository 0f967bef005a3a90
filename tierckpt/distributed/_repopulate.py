"""After a multi-rank load: the copies each rank made on faster tiers become a checkpoint
there once every rank's copy is in (:func:`publish_repopulated`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tierckpt.distributed._collectives import collective_device
from tierckpt.distributed._private import is_private_tier
from tierckpt.distributed._records import _ranks
from tierckpt.errors import TierCkptError
from tierckpt.format import encode_manifest, manifest_name
from tierckpt.restore import LoadedShard

if TYPE_CHECKING:
    from tierckpt.pipeline import Tier

__all__ = ["publish_repopulated"]

log = logging.getLogger("tierckpt")


#: tiers a multi-rank load can repopulate (the size of its all_reduce vector)
_MAX_REPOP_TIERS = 16


def publish_repopulated(loaded: LoadedShard | None, *, tiers: Sequence[Tier], rank: int) -> None:
    """Commit the copies a multi-rank load made on faster tiers, once every rank's is there.

    Each rank copied its own shard file to its local durable tiers while reading it from a
    remote one (``read_shard(publish=False)``). One ``all_reduce`` (MIN and MAX of a small
    vector, in the calling thread; every rank calls this exactly once per load, ``loaded``
    None where its load failed) tells whether every rank copied from the same source tier to
    a tier; there the source's manifest is written — by rank 0 on a tier all ranks share,
    by every rank on a private one. Elsewhere the copied files stay uncommitted leftovers,
    which retention removes. Best effort: a failure is logged, never raised.
    """
    import torch.distributed as dist

    # a fixed size: a rank configured with other tiers must not make the collective hang
    n = min(len(tiers), _MAX_REPOP_TIERS)
    vec = torch.zeros(_MAX_REPOP_TIERS, dtype=torch.int64)
    if loaded is not None:
        source = next(i for i, t in enumerate(tiers) if t.name == loaded.tier) + 1
        for i, t in enumerate(tiers[:n]):
            if any(b is t.backend for b in loaded.repopulated):
                vec[i] = source
    dev = collective_device()
    lo, hi = vec.to(dev), vec.to(dev)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if loaded is None:
        return
    body = encode_manifest(loaded.manifest)
    cid = loaded.manifest.id
    name = manifest_name(cid.step, timeline=cid.timeline)
    for i, t in enumerate(tiers[:n]):
        if int(lo[i]) == 0 or int(lo[i]) != int(hi[i]):
            continue  # some rank did not copy here, or copied another tier's file
        private = is_private_tier(t)
        if rank != 0 and not private:
            continue
        try:
            if not private:
                # a tier said to be shared must really hold every rank's file (per-node
                # folders belong in TIERCKPT_PRIVATE_TIERS)
                # the manifest's folders: one in format v1, the hashed ones in v2
                there: set[str] = set()
                shards = loaded.manifest.shards
                for folder in sorted({f.file.rsplit("/", 1)[0] + "/" for f in shards}):
                    there.update(t.backend.list(folder))
                absent = [r.rank for r in loaded.manifest.shards if r.file not in there]
                if absent:
                    log.warning(
                        "%s: not committing the copy on tier %s: it lacks the files of "
                        "ranks %s (a per-node folder? name it in TIERCKPT_PRIVATE_TIERS)",
                        cid,
                        t.name,
                        _ranks(absent),
                    )
                    continue
            t.backend.put_atomic(name, body)
            log.info(
                "%s is now also on tier %s (copied from %s by every rank)",
                cid,
                t.name,
                loaded.tier,
            )
        except FileExistsError:
            pass
        except (OSError, TierCkptError) as exc:
            log.warning(
                "%s: could not commit the copy on tier %s: %s",
                cid,
                t.name,
                exc,
            )
