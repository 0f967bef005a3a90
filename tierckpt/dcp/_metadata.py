"""What DCP moves between ranks (``ItemLocation`` and the plan and shard reports, pickled by
DCP within the job) and DCP's ``Metadata`` stored as JSON without pickle
(:func:`encode_metadata` / :func:`decode_metadata`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zstandard
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt.dcp._common import (
    _LAYOUTS,
    _MEMORY_FORMATS,
    MAX_DIMS,
    MAX_METADATA_BYTES,
    METADATA_FORMAT,
    METADATA_VERSION,
)
from tierckpt.errors import CorruptCheckpoint, FormatError, UnsupportedObject
from tierckpt.format import ShardRef
from tierckpt.tree import decode_tree, dtype_from_name, dtype_name, encode_tree

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
    #: the timeline the coordinator chose for this save (every rank writes the same id)
    timeline: int = 0
    #: the step of this save (each rank checks it is the step it saves: see ``_saves``)
    step: int = -1
    #: why ranks were refused their leases (another live writer holds the location): every
    #: rank then refuses the save in write_data, none writes (see ``TierWriter``)
    refused: tuple[str, ...] = ()


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
    #: the save these shards belong to (the coordinator's ``_PlanInfo.save_id``)
    save_id: str = ""


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
    raise UnsupportedObject(
        f"DCP planner_data holds a tensor or a NumPy array at {path}; it cannot be stored "
        "(DCP metadata keeps no tensor data)"
    )


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
