"""``torch.distributed.checkpoint`` (DCP) storage through tierckpt's tiers: resharding.

``TierWriter`` / ``TierReader`` implement DCP's ``StorageWriter`` / ``StorageReader``. DCP plans
which rank saves which piece of every (possibly sharded) tensor and, at load, which saved
pieces every rank of a job of *any* size needs: a checkpoint saved by 4 ranks loads into 2 or 3.
tierckpt supplies the storage, with its own format and tiers::

    import torch.distributed.checkpoint as dcp
    from tierckpt.dcp import TierReader, TierWriter

    tiers = [LocalTier("/nvme/ck"), S3Tier("s3://b/run")]
    with TierWriter(tiers) as writer:  # one writer for every save of the run
        dcp.save(state, storage_writer=writer, checkpoint_id=100)
    dcp.load(state, storage_reader=TierReader(tiers))

On every tier the layout is the native one: each rank writes **one shard file**
(``steps/<step>/rank-<r>.tck``: chunk checksums, the tier's codec, streamed as a multipart
upload on S3) through the same pipeline as :class:`~tierckpt.Checkpointer`; the coordinator
then writes DCP's ``Metadata`` as JSON (``steps/<step>/dcp-metadata.json.zst``, checksummed)
and, **last**, the tier's manifest listing every rank's shard. A tier without a manifest holds
no checkpoint; a missing or corrupt shard on one tier falls back to the next tier.

No pickle in storage
    DCP's ``Metadata`` (a dataclass tree) is stored as a JSON schema of its own
    (:func:`encode_metadata` / :func:`decode_metadata`); ``planner_data`` uses tierckpt's tagged
    JSON (:mod:`tierckpt.tree`), so a custom planner whose ``planner_data`` holds other
    objects is refused at save time. Non-tensor values are a different matter: DCP's
    ``DefaultSavePlanner`` turns them into bytes with ``torch.save`` and its
    ``DefaultLoadPlanner`` reads them back with ``torch.load(weights_only=False)`` (pickle).
    Pass ``planner=SafeLoadPlanner()`` to load them with ``weights_only=True`` (plain
    containers, numbers, strings and tensors only) when the storage is not fully trusted.

Private tiers (RAM, or named in ``TIERCKPT_PRIVATE_TIERS``) are skipped by multi-rank DCP
saves: a DCP load reads other ranks' shards, which a process-private tier cannot serve.
"""

from __future__ import annotations

from tierckpt.dcp._metadata import ItemLocation, decode_metadata, encode_metadata
from tierckpt.dcp._planner import SafeLoadPlanner
from tierckpt.dcp._reader import TierReader
from tierckpt.dcp._writer import TierWriter
from tierckpt.format import dcp_metadata_name

__all__ = [
    "ItemLocation",
    "SafeLoadPlanner",
    "TierReader",
    "TierWriter",
    "decode_metadata",
    "dcp_metadata_name",
    "encode_metadata",
]
