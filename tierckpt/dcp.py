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
    JSON (:mod:`tierckpt.objects`), so a custom planner whose ``planner_data`` holds other
    objects is refused at save time. Non-tensor values are a different matter: DCP's
    ``DefaultSavePlanner`` turns them into bytes with ``torch.save`` and its
    ``DefaultLoadPlanner`` reads them back with ``torch.load(weights_only=False)`` (pickle).
    Pass ``planner=SafeLoadPlanner()`` to load them with ``weights_only=True`` (plain
    containers, numbers, strings and tensors only) when the storage is not fully trusted.

Private tiers (RAM, or named in ``TIERCKPT_PRIVATE_TIERS``) are skipped by multi-rank DCP
saves: a DCP load reads other ranks' shards, which a process-private tier cannot serve.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from tierckpt import __version__
from tierckpt.arena import default_host_buffer_bytes
from tierckpt.backends.base import Backend
from tierckpt.capture import record_ready_events
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import (
    BackendError,
    CheckpointFailed,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    TierCkptError,
    UnsupportedObject,
)
from tierckpt.format import (
    ChunkRecord,
    Manifest,
    ShardRef,
    checksum,
    encode_manifest,
    manifest_name,
    step_prefix,
)
from tierckpt.handle import SaveHandle
from tierckpt.objects import decode_tree, dtype_from_name, dtype_name, encode_tree
from tierckpt.pipeline import Pipeline, PipelineOwner, SaveJob, TierRuntime
from tierckpt.plan import build_plan
from tierckpt.policy import TierPolicy, TierSpec, resolve_codec
from tierckpt.restore import is_recoverable, parse_tensor_entry, read_index, read_manifest
from tierckpt.retention import committed_steps, gc_tier

__all__ = [
    "ItemLocation",
    "SafeLoadPlanner",
    "TierReader",
    "TierWriter",
    "decode_metadata",
    "dcp_metadata_name",
    "encode_metadata",
]

log = logging.getLogger("tierckpt")

METADATA_FORMAT = "tierckpt-dcp-metadata"
METADATA_VERSION = 1
MAX_METADATA_BYTES = 1 << 30
MAX_DIMS = 64
_DCP_VERSION = "1.0.0"
#: fqn prefix of the extra per-rank WriteResult that carries the rank's shard refs to finish()
_SHARDS_FQN = "\x00tierckpt-shards/"
_KEY = re.compile(r"^[0-9]{1,12}$")
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.sparse_csr)}
_MEMORY_FORMATS = {
    str(v): v
    for v in (
        torch.contiguous_format,
        torch.channels_last,
        torch.channels_last_3d,
        torch.preserve_format,
    )
}

TiersArg = Sequence[TierSpec] | TierPolicy


def dcp_metadata_name(step: int) -> str:
    return f"{step_prefix(step)}dcp-metadata.json.zst"


def _parse_step(checkpoint_id: object) -> int:
    """A DCP ``checkpoint_id`` names the step: ``100``, ``"100"`` or ``"step-100"``."""
    if type(checkpoint_id) is int:
        s: object = checkpoint_id
    else:
        text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else ""
        text = str(text).removeprefix("step-")
        s = int(text) if text.isdigit() else None
    if type(s) is not int or s < 0:
        raise ValueError(
            f"a tierckpt DCP checkpoint_id is the step number (100, '100' or 'step-100'), got "
            f"{checkpoint_id!r}"
        )
    manifest_name(s)  # range check
    return s


def _runtimes(policy: TierPolicy) -> list[TierRuntime]:
    out = []
    for spec in policy:
        backend = spec.make_backend()
        out.append(TierRuntime(spec, backend, resolve_codec(spec.codec, backend)))
    return out


def _is_private(t: TierRuntime) -> bool:
    from tierckpt.distributed import is_private_tier

    return is_private_tier(t)


# -- values that travel between ranks (pickled by DCP within the job) ---------------------


@dataclass(frozen=True, slots=True)
class ItemLocation:
    """Where one saved item lives: a key in one rank's shard."""

    rank: int
    key: str


@dataclass(frozen=True, slots=True)
class _PlanInfo:
    rank: int
    world_size: int
    save_id: str


@dataclass(frozen=True, slots=True)
class _ShardOnTier:
    ref: ShardRef
    raw_bytes: int
    stored_bytes: int
    codec: str


@dataclass(frozen=True, slots=True)
class _RankShards:
    rank: int
    tiers: dict[str, _ShardOnTier]
    errors: dict[str, str]


# -- Metadata <-> JSON (no pickle) --------------------------------------------------------


def _ints(v: object, what: str, where: str) -> list[int]:
    """A flat JSON list of non-negative ints (below 2**62), validated in bulk."""
    if not isinstance(v, list):
        raise FormatError(f"{where}: DCP metadata: {what} must be a list")
    if not v:
        return []
    arr = np.asarray(v)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or int(arr.min()) < 0:
        raise FormatError(f"{where}: DCP metadata: {what} must be non-negative ints")
    if int(arr.max()) >= 1 << 62:
        raise FormatError(f"{where}: DCP metadata: {what} out of range")
    out: list[int] = arr.tolist()
    return out


def _rows(flat: list[int], width: int, n: int, what: str, where: str) -> list[list[int]]:
    """Cut ``flat`` into ``n`` rows of ``width`` ints."""
    if len(flat) != width * n:
        raise FormatError(f"{where}: DCP metadata: {what}: {len(flat)} ints, not {n} x {width}")
    if width == 0:
        return [[] for _ in range(n)]
    rows: list[list[int]] = np.asarray(flat, dtype=np.int64).reshape(n, width).tolist()
    return rows


def _refuse_tensor(t: torch.Tensor, path: object) -> int:
    raise UnsupportedObject(f"DCP planner_data holds a tensor at {path}; it cannot be stored")


def encode_metadata(md: Metadata) -> bytes:
    """DCP ``Metadata`` as zstd-compressed JSON. Raises ``UnsupportedObject`` for contents
    that would need pickle (e.g. a custom planner's ``planner_data``).

    Chunk lists and storage locations are stored column-wise (flat int lists per tensor):
    at 8,000 ranks a tensor has 8,000 chunks, and columns parse and validate in bulk.
    """
    entries: list[Any] = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            p = smd.properties
            entries.append(
                [
                    fqn,
                    "tensor",
                    {
                        "dtype": dtype_name(p.dtype),
                        "layout": str(p.layout),
                        "requires_grad": bool(p.requires_grad),
                        "memory_format": str(p.memory_format),
                        "pin_memory": bool(p.pin_memory),
                        "size": list(smd.size),
                        "n_chunks": len(smd.chunks),
                        "chunk_offsets": [int(x) for c in smd.chunks for x in c.offsets],
                        "chunk_sizes": [int(x) for c in smd.chunks for x in c.sizes],
                    },
                ]
            )
        elif isinstance(smd, BytesStorageMetadata):
            entries.append([fqn, "bytes"])
        else:
            raise UnsupportedObject(f"DCP metadata entry {fqn!r} is a {type(smd).__name__}")
    # storage locations grouped by fqn: [fqn, ndim (-1: no offset), offsets, hints, ranks, keys]
    groups: dict[str, list[tuple[MetadataIndex, ItemLocation]]] = {}
    for idx, loc in (md.storage_data or {}).items():
        if not isinstance(idx, MetadataIndex) or not isinstance(loc, ItemLocation):
            raise UnsupportedObject(f"DCP storage_data entry {idx!r} was not written by TierWriter")
        groups.setdefault(idx.fqn, []).append((idx, loc))
    storage: list[Any] = []
    for fqn, items in groups.items():
        for ndim in sorted({-1 if i.offset is None else len(i.offset) for i, _ in items}):
            sel = [
                (i, loc) for i, loc in items if (-1 if i.offset is None else len(i.offset)) == ndim
            ]
            storage.append(
                [
                    fqn,
                    ndim,
                    [int(x) for i, _ in sel for x in (i.offset or ())],
                    [-1 if i.index is None else int(i.index) for i, _ in sel],
                    [loc.rank for _, loc in sel],
                    [int(loc.key) for _, loc in sel],
                ]
            )
    sm = md.storage_meta
    body = {
        "format": METADATA_FORMAT,
        "version": METADATA_VERSION,
        "dcp_version": md.version,
        "entries": entries,
        "planner_data": encode_tree(md.planner_data, _refuse_tensor),
        "storage_data": storage,
        "storage_meta": None
        if sm is None
        else {
            "checkpoint_id": None if sm.checkpoint_id is None else os.fspath(sm.checkpoint_id),
            "save_id": sm.save_id,
            "load_id": sm.load_id,
            "modules": list(sm.modules),
        },
    }
    raw = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    return zstandard.ZstdCompressor(level=3).compress(raw)


def _opt_str(v: object, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise FormatError(f"DCP metadata: {what} must be a string or null")
    return v


def _tensor_entry(fqn: str, t: dict[str, Any], where: str) -> TensorStorageMetadata:
    size = _ints(t.get("size"), f"{fqn} size", where)
    n = t.get("n_chunks")
    if len(size) > MAX_DIMS or type(n) is not int or not 0 <= n < 1 << 32:
        raise FormatError(f"{where}: {fqn}: bad dimensions or chunk count")
    layout = _LAYOUTS.get(str(t.get("layout")))
    mem = _MEMORY_FORMATS.get(str(t.get("memory_format")))
    if layout is None or mem is None:
        raise FormatError(f"{where}: {fqn}: unknown layout or memory format")
    flat_off = _ints(t.get("chunk_offsets"), f"{fqn} chunk offsets", where)
    flat_sz = _ints(t.get("chunk_sizes"), f"{fqn} chunk sizes", where)
    offs = _rows(flat_off, len(size), n, f"{fqn} chunk offsets", where)
    sizes = _rows(flat_sz, len(size), n, f"{fqn} chunk sizes", where)
    if size and n:
        ends = np.asarray(offs, dtype=np.int64) + np.asarray(sizes, dtype=np.int64)
        if (ends > np.asarray(size, dtype=np.int64)).any():
            raise FormatError(f"{where}: {fqn}: chunk outside the tensor")
    props = TensorProperties(
        dtype=dtype_from_name(t.get("dtype")),
        layout=layout,
        requires_grad=bool(t.get("requires_grad")),
        memory_format=mem,
        pin_memory=bool(t.get("pin_memory")),
    )
    chunks = [
        ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z))
        for o, z in zip(offs, sizes, strict=True)
    ]
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def decode_metadata(blob: bytes, *, where: str) -> Metadata:
    """Inverse of :func:`encode_metadata`; validates everything (it comes from storage)."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=MAX_METADATA_BYTES)
        body = json.loads(raw)
    except (zstandard.ZstdError, ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(f"{where}: DCP metadata is not valid zstd JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != METADATA_FORMAT:
        raise FormatError(f"{where}: not tierckpt DCP metadata")
    if body.get("version") != METADATA_VERSION:
        raise FormatError(f"{where}: unsupported DCP metadata version {body.get('version')!r}")
    entries = body.get("entries")
    storage = body.get("storage_data")
    if not isinstance(entries, list) or not isinstance(storage, list):
        raise FormatError(f"{where}: DCP metadata lacks entries or storage_data")
    smd: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for e in entries:
        if not isinstance(e, list) or len(e) not in (2, 3) or not isinstance(e[0], str):
            raise FormatError(f"{where}: malformed DCP metadata entry")
        if e[1] == "bytes" and len(e) == 2:
            smd[e[0]] = BytesStorageMetadata()
        elif e[1] == "tensor" and len(e) == 3 and isinstance(e[2], dict):
            smd[e[0]] = _tensor_entry(e[0], e[2], where)
        else:
            raise FormatError(f"{where}: malformed DCP metadata entry for {e[0]!r}")
    sdata: dict[MetadataIndex, ItemLocation] = {}
    for s in storage:
        if not isinstance(s, list) or len(s) != 6 or not isinstance(s[0], str):
            raise FormatError(f"{where}: malformed storage_data entry")
        fqn, ndim, flat_off, hints_json = s[0], s[1], s[2], s[3]
        if type(ndim) is not int or not -1 <= ndim <= MAX_DIMS:
            raise FormatError(f"{where}: {fqn}: bad offset rank {ndim!r}")
        if not isinstance(hints_json, list) or not all(
            type(h) is int and -1 <= h < 1 << 40 for h in hints_json
        ):
            raise FormatError(f"{where}: {fqn}: bad index hints")
        ranks = _ints(s[4], f"{fqn} ranks", where)
        keys = _ints(s[5], f"{fqn} keys", where)
        n = len(ranks)
        if len(keys) != n or len(hints_json) != n:
            raise FormatError(f"{where}: {fqn}: storage columns differ in length")
        if n and (max(ranks) >= 1 << 20 or max(keys) >= 10**12):
            raise FormatError(f"{where}: {fqn}: rank or key out of range")
        offsets: list[list[int]] | list[None]
        if ndim == -1:
            if flat_off != []:
                raise FormatError(f"{where}: {fqn}: offsets given without a rank")
            offsets = [None] * n
        else:
            offsets = _rows(_ints(flat_off, f"{fqn} offsets", where), ndim, n, fqn, where)
        for off, hint, rank, key in zip(offsets, hints_json, ranks, keys, strict=True):
            idx = MetadataIndex(fqn, off, None if hint == -1 else hint)
            sdata[idx] = ItemLocation(rank, str(key))
    sm_json = body.get("storage_meta")
    sm: StorageMeta | None = None
    if sm_json is not None:
        if not isinstance(sm_json, dict):
            raise FormatError(f"{where}: malformed storage_meta")
        modules = sm_json.get("modules", [])
        if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
            raise FormatError(f"{where}: storage_meta modules must be strings")
        sm = StorageMeta(
            checkpoint_id=_opt_str(sm_json.get("checkpoint_id"), "checkpoint_id"),
            save_id=_opt_str(sm_json.get("save_id"), "save_id"),
            load_id=_opt_str(sm_json.get("load_id"), "load_id"),
            modules=list(modules),
        )
    return Metadata(
        state_dict_metadata=smd,
        planner_data=decode_tree(body.get("planner_data"), []),
        storage_data=sdata,
        storage_meta=sm,
        version=_opt_str(body.get("dcp_version"), "dcp_version"),
    )


# -- writer --------------------------------------------------------------------------------


def _plain_tensor(data: Any) -> torch.Tensor:
    t = data.to_local() if hasattr(data, "to_local") else data
    if not isinstance(t, torch.Tensor):
        raise UnsupportedObject(f"DCP resolved a {type(t).__name__} for a tensor item")
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    return t


def _bytes_tensor(data: io.BytesIO) -> torch.Tensor:
    buf = bytearray(data.getbuffer())
    return torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


class TierWriter(PipelineOwner, StorageWriter):
    """A DCP ``StorageWriter`` that saves through tierckpt tiers (see the module docstring).

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy` (``every`` counts the saves
            of this writer; ``keep_last`` is applied after each commit).
        step: the step to save; or pass it as DCP's ``checkpoint_id``.
        chunk_bytes, host_buffer_bytes, io_threads: as for :class:`~tierckpt.Checkpointer`.

    Reuse one writer for every save of a run: its host buffer and threads stay warm. It
    holds threads, and its writer lease on every tier it wrote to, until :meth:`close` (or
    garbage collection); another writer on the same location is refused with
    :class:`~tierckpt.WriterConflict` meanwhile.
    """

    def __init__(
        self,
        tiers: TiersArg,
        step: int | str | None = None,
        *,
        chunk_bytes: int | None = None,
        host_buffer_bytes: int | None = None,
        io_threads: int | None = None,
    ) -> None:
        super().__init__()
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
        self.step: int | None = None if step is None else _parse_step(step)
        self.host_buffer_bytes = host_buffer_bytes or default_host_buffer_bytes()
        chunk = chunk_bytes or int(os.environ.get("TIERCKPT_CHUNK_BYTES") or 64 << 20)
        self.chunk_bytes = min(chunk, max(4096, self.host_buffer_bytes // 4 // 4096 * 4096))
        self.io_threads = io_threads or int(os.environ.get("TIERCKPT_IO_THREADS") or 2)
        self.save_id = uuid.uuid4().hex
        self.rank = 0
        self.is_coordinator = True
        self._tiers: list[TierRuntime] = _runtimes(self.policy)
        self._pipeline: Pipeline | None = None
        self._save_count = 0
        self._lock = threading.Lock()
        self._shards: dict[int, dict[str, _ShardOnTier]] = {}
        self._info: _PlanInfo | None = None
        self._closed = False

    # -- DCP protocol ------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self._info = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        try:
            _parse_step(checkpoint_id)
        except (ValueError, FormatError):
            return False
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise NotImplementedError(
                "tierckpt.dcp.TierWriter commits one manifest per checkpoint and needs DCP's "
                "collectives (use_collectives=True)"
            )
        self.is_coordinator = is_coordinator
        rank = kwargs.get("rank")
        self.rank = int(rank) if rank is not None else _dist_rank()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=f"tierckpt:{self.step}", save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        step = self._require_step()
        for t in self._tiers:
            if t.backend.exists(manifest_name(step)):
                raise FileExistsError(
                    f"step {step} is already committed on tier {t.name!r} ({t.backend.url}); "
                    "refusing to overwrite it — save under another step"
                )
            newest = committed_steps(t.backend)
            if newest and newest[-1] > step:
                raise ValueError(
                    f"step {step} is older than step {newest[-1]}, committed on tier {t.name!r}; "
                    "save DCP checkpoints under increasing steps"
                )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        world = len(plans)
        return [
            dataclasses.replace(p, storage_data=_PlanInfo(i, world, self.save_id))
            for i, p in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        info = plan.storage_data
        if not isinstance(info, _PlanInfo):
            raise TierCkptError("TierWriter.write_data got a plan its prepare_global_plan did not")
        self._info = info
        step = self._require_step()
        state: dict[str, torch.Tensor] = {}
        results: list[WriteResult] = []
        for i, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            key = str(i)
            t = _bytes_tensor(data) if isinstance(data, io.BytesIO) else _plain_tensor(data)
            state[key] = t
            results.append(
                WriteResult(
                    index=item.index,
                    size_in_bytes=t.numel() * t.element_size(),
                    storage_data=ItemLocation(info.rank, key),
                )
            )
        shards = self._save_shard(state, step, info)
        results.append(
            WriteResult(
                index=MetadataIndex(f"{_SHARDS_FQN}{info.rank}"),
                size_in_bytes=0,
                storage_data=shards,
            )
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        step = self._require_step()
        info = self._info
        world = info.world_size if info is not None else len(results)
        shards: dict[int, _RankShards] = {}
        storage: dict[MetadataIndex, Any] = {}
        for per_rank in results:
            for wr in per_rank:
                if isinstance(wr.storage_data, _RankShards):
                    shards[wr.storage_data.rank] = wr.storage_data
                else:
                    storage[wr.index] = wr.storage_data
        if sorted(shards) != list(range(world)):
            raise CheckpointFailed(f"step {step}: shard reports from ranks {sorted(shards)} only")
        metadata.version = metadata.version or _DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        blob = encode_metadata(metadata)
        committed: list[str] = []
        failed: dict[str, BaseException] = {}
        for t in self._tiers:
            missing = [r for r in range(world) if t.name not in shards[r].tiers]
            if len(missing) == world:
                continue  # this tier did not take part in this save
            if missing:
                why = {r: shards[r].errors.get(t.name, "?") for r in missing[:3]}
                failed[t.name] = CheckpointFailed(f"ranks {missing[:10]} failed there: {why}")
                log.error("step %d not committed on tier %s: %s", step, t.name, failed[t.name])
                continue
            try:
                self._commit_tier(
                    t, step, world, [shards[r].tiers[t.name] for r in range(world)], blob
                )
                committed.append(t.name)
            except (BackendError, OSError, FormatError) as exc:
                failed[t.name] = exc
                log.error("step %d: commit on tier %s failed: %s", step, t.name, exc)
        if not committed:
            raise CheckpointFailed(f"DCP step {step} was committed on no tier", failed)

    # -- internals -------------------------------------------------------------------
    def _require_step(self) -> int:
        if self.step is None:
            raise ValueError("TierWriter needs a step: TierWriter(tiers, step) or checkpoint_id")
        return self.step

    def _pipeline_hooks(self) -> dict[str, Any]:
        return {"commit": self._on_shard_durable}

    def _on_shard_durable(
        self, tier: TierRuntime, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> None:
        # no manifest here: finish() on the coordinator commits once every rank is durable
        with self._lock:
            self._shards.setdefault(id(job), {})[tier.name] = _ShardOnTier(
                ref, raw, stored, tier.codec.codec_id
            )

    def _save_shard(
        self, state: dict[str, torch.Tensor], step: int, info: _PlanInfo
    ) -> _RankShards:

        index = self._save_count
        self._save_count += 1
        tiers = [
            t
            for t in self._tiers
            if t.spec.receives(index) and not (info.world_size > 1 and _is_private(t))
        ]
        for t in self._tiers:
            if t not in tiers and t.spec.receives(index):
                log.warning("DCP save skips tier %s: it is private to each process", t.name)
        if not tiers:
            return _RankShards(info.rank, {}, {})
        pipeline = self._get_pipeline()
        plan = build_plan(state, self.chunk_bytes)
        handle = SaveHandle(step, tuple(t.name for t in tiers))
        job = SaveJob(
            step=step,
            plan=plan,
            tiers=tiers,
            handle=handle,
            rank=info.rank,
            world_size=info.world_size,
            ready_events=record_ready_events(plan),
            metadata={},
            attempt=info.save_id,
        )
        pipeline.acquire_leases(job)  # WriterConflict when another live writer is there
        pipeline.submit(job)
        errors: dict[str, str] = {}
        for t in tiers:
            try:
                handle.wait(t.name)
            except CheckpointFailed as exc:
                errors[t.name] = str(exc)
        with self._lock:
            done = self._shards.pop(id(job), {})
        return _RankShards(info.rank, done, errors)

    def _commit_tier(
        self, t: TierRuntime, step: int, world: int, shards: list[_ShardOnTier], blob: bytes
    ) -> None:
        name = dcp_metadata_name(step)
        t.backend.put_atomic(name, blob, overwrite=True)
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
        )
        t.backend.put_atomic(manifest_name(step), encode_manifest(m))
        log.info("DCP step %d committed on tier %s (%d ranks)", step, t.name, world)
        rank = self._info.rank if self._info is not None else self.rank
        if self._pipeline is None or not self._pipeline.may_collect(t, rank):
            return  # retention only while this writer holds the location's lease
        try:
            gc_tier(t.backend, t.spec.keep_last)
        except OSError as exc:
            log.warning("retention on tier %s failed (will retry next save): %s", t.name, exc)


def _dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# -- reader --------------------------------------------------------------------------------


class _ShardFile:
    """Ranged, verified reads of selected tensors from one rank's shard on one tier."""

    def __init__(self, backend: Backend, tier: str, ref: ShardRef) -> None:
        self.backend = backend
        self.tier = tier
        self.ref = ref
        self.where = f"tier {tier!r} {backend.url}/{ref.file}"
        index, _, _ = read_index(backend, ref, tier)
        self.codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
        self.chunks: list[ChunkRecord] = index["chunks"]
        self.chunk_starts = [c.logical_offset for c in self.chunks]
        self.storages: list[list[int]] = index["storages"]
        self._storage_sizes: list[int] | None = None
        self.tensors: list[Any] = index["tensors"]
        tree = decode_tree(index.get("tree"), lambda i: i)
        if not isinstance(tree, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in tree.items()
        ):
            raise FormatError(f"{self.where}: not a DCP shard (its tree is not a key table)")
        self.keys: dict[str, int] = tree

    def fetch(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        # (logical lo, logical hi, destination byte buffer) per needed tensor
        wanted: list[tuple[int, int, torch.Tensor]] = []
        for key in keys:
            if key in out:
                continue
            ti = self.keys.get(key)
            if ti is None or not 0 <= ti < len(self.tensors):
                raise FormatError(f"{self.where}: no item {key!r} in this shard")
            t, lo, buf = self._tensor_shell(ti)
            out[key] = t
            if buf is not None:
                wanted.append((lo, lo + buf.numel(), buf))
        self._fill(wanted)
        return out

    def _tensor_shell(self, ti: int) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        if self._storage_sizes is None:
            self._storage_sizes = [n for _lo, n in self.storages]
        rec = parse_tensor_entry(self.tensors[ti], ti, self.where, self._storage_sizes)
        shape, stride, dtype, extent = rec.shape, rec.stride, rec.dtype, rec.extent
        if rec.storage == -1:
            return torch.empty_strided(shape, stride, dtype=dtype), 0, None
        span_lo, _span_n = self.storages[rec.storage]
        off = rec.offset
        buf = torch.empty(extent, dtype=torch.uint8)
        t = torch.empty(0, dtype=dtype)
        t.set_(buf.untyped_storage(), 0, shape, stride)
        return t, span_lo + off, buf

    def _fill(self, wanted: list[tuple[int, int, torch.Tensor]]) -> None:
        """Read each needed chunk once, verify, decode, scatter into the buffers."""
        per_chunk: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
        for lo, hi, buf in wanted:
            covered = lo
            ci = max(bisect.bisect_right(self.chunk_starts, lo) - 1, 0)
            while covered < hi and ci < len(self.chunks):
                c = self.chunks[ci]
                c_lo, c_hi = c.logical_offset, c.logical_offset + c.raw_size
                if c_lo > covered:
                    break
                if c_hi > covered:
                    per_chunk.setdefault(ci, []).append((lo, hi, buf))
                    covered = min(hi, c_hi)
                ci += 1
            if covered < hi:
                raise FormatError(f"{self.where}: bytes {covered}..{hi} are in no chunk")
        for ci in sorted(per_chunk):
            raw = self._chunk(ci)
            c = self.chunks[ci]
            c_lo, c_hi = c.logical_offset, c.logical_offset + c.raw_size
            for lo, hi, buf in per_chunk[ci]:
                a, b = max(lo, c_lo), min(hi, c_hi)
                buf[a - lo : b - lo].copy_(raw[a - c_lo : b - c_lo])

    def _chunk(self, ci: int) -> torch.Tensor:
        rec = self.chunks[ci]
        codec = self.codecs[rec.codec]
        stored = self.backend.read(self.ref.file, rec.file_offset, rec.stored_size)
        if checksum(stored) != rec.checksum:
            raise CorruptChunk(
                f"{self.where}: chunk {ci} (file bytes {rec.file_offset}..+{rec.stored_size}) "
                "does not match its checksum",
                tier=self.tier,
                file=self.ref.file,
                chunk=ci,
            )
        out = torch.empty(rec.raw_size, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        if codec.is_passthrough and rec.stored_size == rec.raw_size:
            view[:] = memoryview(stored).cast("B")
        else:
            try:
                codec.decode(stored, view)
            except CorruptChunk as exc:
                raise CorruptChunk(
                    f"{self.where}: chunk {ci}: {exc}", tier=self.tier, file=self.ref.file, chunk=ci
                ) from exc
        return out


class TierReader(StorageReader):
    """A DCP ``StorageReader`` over tierckpt tiers (see the module docstring).

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`.
        step: the step to load; ``None``: the newest DCP checkpoint committed on some tier
            that every rank sees (one ``all_gather`` on the default process group in
            ``read_metadata`` when it is initialized — name the step when only some ranks
            load, e.g. ``no_dist=True`` inside a multi-rank job).
        io_threads: shards read in parallel (default 4).

    Each item is read from the fastest tier that holds the step; a corrupt or missing shard
    falls back to the next tier holding the same step.
    """

    def __init__(self, tiers: TiersArg, step: int | str | None = None, *, io_threads: int = 4):
        super().__init__()
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
        self.step: int | None = None if step is None else _parse_step(step)
        self.io_threads = max(1, io_threads)
        self.load_id = uuid.uuid4().hex
        self._tiers = _runtimes(self.policy)
        self._holders: list[tuple[TierRuntime, Manifest]] = []
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self.loaded_step: int | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step = _parse_step(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}
        self._holders = []

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return TierWriter.validate_checkpoint_id(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointNotFound("tierckpt DCP checkpoints hold global metadata only")
        step = self.step if self.step is not None else self._newest_step()
        errors: list[str] = []
        md: Metadata | None = None
        self._holders = []
        for t in self._tiers:
            try:
                m = read_manifest(t.backend, step, t.name)
                if md is None:
                    md = self._read_metadata_object(t, m)
                self._holders.append((t, m))
            except CheckpointNotFound:
                continue
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
                errors.append(f"tier {t.name!r}: {exc}")
                log.warning("DCP metadata of step %d on tier %s unreadable: %s", step, t.name, exc)
        if md is None:
            raise CheckpointNotFound(
                f"DCP step {step} is not readable on any tier "
                f"({', '.join(t.name for t in self._tiers)})"
                + (": " + "; ".join(errors) if errors else "")
            )
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self.loaded_step = step
        return md

    def _read_metadata_object(self, t: TierRuntime, m: Manifest) -> Metadata:
        where = f"tier {t.name!r} {t.backend.url}"
        info = (m.metadata or {}).get("dcp")
        if not isinstance(info, dict):
            raise FormatError(
                f"{where}: step {m.step} is not a DCP checkpoint (load it with Checkpointer.load)"
            )
        name = dcp_metadata_name(m.step)
        size = info.get("size")
        if info.get("file") != name or type(size) is not int or not 0 < size <= MAX_METADATA_BYTES:
            raise FormatError(f"{where}: malformed DCP entry in the manifest of step {m.step}")
        blob = t.backend.get(name)
        if len(blob) != size or checksum(blob) != info.get("checksum"):
            raise CorruptCheckpoint(f"{where}/{name}: DCP metadata does not match its checksum")
        return decode_metadata(blob, where=f"{where}/{name}")

    def _newest_step(self) -> int:
        mine: list[int] = []
        for t in self._tiers:
            try:
                mine.extend(committed_steps(t.backend))
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
        newest = sorted(set(mine), reverse=True)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # every rank must read the same step: the newest one every rank sees
            from tierckpt.distributed import _collective_device, get_knobs

            k = get_knobs().agree_max_candidates
            dev = _collective_device()
            vec = torch.full((k,), -1, dtype=torch.int64, device=dev)
            if newest:
                vec[: min(k, len(newest))] = torch.tensor(newest[:k], dtype=torch.int64)
            gathered = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, vec)
            common = set.intersection(*({int(v) for v in g.tolist() if v >= 0} for g in gathered))
            newest = sorted(common, reverse=True)
        if not newest:
            raise CheckpointNotFound(
                f"no committed checkpoint on any tier ({', '.join(t.name for t in self._tiers)})"
            )
        return newest[0]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        sd = metadata.storage_data
        if not isinstance(sd, dict):
            raise FormatError("DCP metadata without storage_data")
        self.storage_data = sd

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_rank: dict[int, list[tuple[ReadItem, str]]] = {}
        for req in plan.items:
            loc = self.storage_data.get(req.storage_index)
            if loc is None:
                raise FormatError(f"DCP item {req.storage_index} has no storage location")
            per_rank.setdefault(loc.rank, []).append((req, loc.key))
        ranks = sorted(per_rank)
        with ThreadPoolExecutor(self.io_threads, thread_name_prefix="tierckpt-dcp-read") as pool:
            # at most io_threads shards' tensors in memory; copies happen on this thread
            pending: list[tuple[int, CFuture[dict[str, torch.Tensor]]]] = []
            it = iter(ranks)
            for r in it:
                pending.append((r, pool.submit(self._fetch_rank, r, per_rank[r])))
                if len(pending) >= self.io_threads:
                    break
            while pending:
                r, fut = pending.pop(0)
                values = fut.result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self._fetch_rank, nxt, per_rank[nxt])))
                _apply(per_rank[r], values, planner)
                del values
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _fetch_rank(self, rank: int, items: list[tuple[ReadItem, str]]) -> dict[str, torch.Tensor]:
        keys = [k for _, k in items]
        errors: list[str] = []
        for t, m in self._holders:
            try:
                return _ShardFile(t.backend, t.name, m.shard_for(rank)).fetch(keys)
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
                errors.append(f"tier {t.name!r}: {exc}")
                log.warning(
                    "DCP read of rank %d's shard from tier %s failed, trying the next: %s",
                    rank,
                    t.name,
                    exc,
                )
        raise CorruptCheckpoint(
            f"no readable copy of rank {rank}'s shard of step {self.loaded_step}: "
            + ("; ".join(errors) or "no tier holds it")
        )


def _apply(
    items: list[tuple[ReadItem, str]], values: dict[str, torch.Tensor], planner: LoadPlanner
) -> None:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    for req, key in items:
        value = values[key]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            continue
        src = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise FormatError(
                f"DCP item {req.storage_index}: stored piece {tuple(src.size())} does not match "
                f"the target {tuple(target.size())}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that unpickles non-tensor values with ``weights_only=True``.

    DCP stores non-tensor values (step counters, ``param_groups``) with ``torch.save``; the
    default planner loads them with ``weights_only=False``, which runs arbitrary pickle code.
    This one admits only plain containers, numbers, strings and tensors.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
