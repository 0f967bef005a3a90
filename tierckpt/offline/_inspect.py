"""What a checkpoint holds: its tensors by path, grouped and summed, without loading them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.backends.base import Backend
from tierckpt.errors import (
    FormatError,
)
from tierckpt.format import (
    CheckpointId,
    ChunkRecord,
    Manifest,
)
from tierckpt.offline._listing import resolve_id
from tierckpt.restore import read_index, read_manifest
from tierckpt.tree import decode_tree, dtype_from_name


# -- the object tree -------------------------------------------------------------------------
def _key_str(key: Any) -> str:
    try:
        k = decode_tree(key, lambda _i: "<tensor>")
    except FormatError:
        return "?"
    return k if isinstance(k, str) else repr(k) if not isinstance(k, int) else str(k)


def tensor_paths(tree: Any) -> dict[int, str]:
    """Map each tensor-table index in an index's object tree to its dotted key path."""
    out: dict[int, str] = {}

    def walk(node: Any, path: str, depth: int) -> None:
        if depth > 200:
            return
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}.{i}" if path else str(i), depth + 1)
        elif isinstance(node, dict) and len(node) == 1:
            ((tag, v),) = node.items()
            if tag == "$tensor" and type(v) is int:
                out.setdefault(v, path or "<root>")
            elif tag == "$ndarray" and isinstance(v, list) and v and type(v[0]) is int:
                out.setdefault(v[0], path or "<root>")  # a NumPy array: a tensor of the file
            elif tag == "$qtensor" and isinstance(v, list) and v and type(v[0]) is int:
                # a quantized tensor: its integer representation; per channel also its
                # scales and zero points ([n, dtype, qscheme, scales, zero points, axis])
                out.setdefault(v[0], path or "<root>")
                if len(v) == 6 and type(v[3]) is int and type(v[4]) is int:
                    out.setdefault(v[3], f"{path or '<root>'}.<scales>")
                    out.setdefault(v[4], f"{path or '<root>'}.<zero_points>")
            elif tag == "$tuple" and isinstance(v, list):
                walk(v, path, depth + 1)
            elif tag in ("$dict", "$odict") and isinstance(v, list):
                for pair in v:
                    if isinstance(pair, list) and len(pair) == 2:
                        k = _key_str(pair[0])
                        walk(pair[1], f"{path}.{k}" if path else k, depth + 1)

    walk(tree, "", 0)
    return out


# -- inspect -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TensorInfo:
    rank: int
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int  # elements * itemsize (views of one storage each count in full)


@dataclass
class GroupStats:
    """Raw and stored bytes of one group of storages (by top-level key or by dtype)."""

    name: str
    tensors: int = 0
    raw_bytes: int = 0
    stored_bytes: float = 0.0
    codecs: set[str] = field(default_factory=set)

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else 1.0


@dataclass
class Inspection:
    manifest: Manifest
    tensors: list[TensorInfo]
    groups: list[GroupStats]
    chunks: int
    codecs: list[str]


def _group_key(path: str, dtype: str, by: str) -> str:
    if by == "dtype":
        return dtype
    return path.split(".", 1)[0] if path else "<root>"


def inspect_checkpoint(
    backend: Backend,
    step: int | CheckpointId | None = None,
    *,
    by: str = "key",
    timeline: int | None = None,
) -> Inspection:
    """Tensors, dtypes, sizes and stored/raw bytes per group (``by="key"`` or ``"dtype"``).

    Reads only the manifest and each shard's index. A storage's stored bytes are its share of
    the stored size of every chunk it overlaps; a storage viewed by several tensors counts once,
    for the group of the first tensor that views it.
    """
    if by not in ("key", "dtype"):
        raise ValueError(f"group by 'key' or 'dtype', not {by!r}")
    cid = resolve_id(backend, step, timeline)
    manifest = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
    tensors: list[TensorInfo] = []
    groups: dict[str, GroupStats] = {}
    codec_ids: set[str] = set()
    n_chunks = 0
    for ref in manifest.shards:
        index, _blob, _footer = read_index(backend, ref, backend.url)
        paths = tensor_paths(index.get("tree"))
        storages: list[list[int]] = index["storages"]
        chunks: list[ChunkRecord] = index["chunks"]
        ids = [str(c.get("id", "?")) if isinstance(c, dict) else "?" for c in index["codecs"]]
        n_chunks += len(chunks)
        span_group: dict[int, str] = {}
        for i, entry in enumerate(index["tensors"]):
            sid, _off, dtype, shape, _stride, _dev = entry
            item = torch.empty((), dtype=dtype_from_name(dtype)).element_size()
            numel = 1
            for s in shape:
                numel *= int(s)
            path = paths.get(i, f"<tensor {i}>")
            tensors.append(TensorInfo(ref.rank, path, dtype, tuple(shape), numel * item))
            g = groups.setdefault(
                _group_key(path, dtype, by), GroupStats(_group_key(path, dtype, by))
            )
            g.tensors += 1
            if isinstance(sid, int) and sid >= 0:
                span_group.setdefault(sid, g.name)
        # attribute each chunk's stored bytes to the storages it covers, pro rata
        ci = 0
        for sid, (off, n) in enumerate(storages):
            g = groups.setdefault(
                span_group.get(sid, "<unreferenced>"),
                GroupStats(span_group.get(sid, "<unreferenced>")),
            )
            g.raw_bytes += n
            while ci < len(chunks) and chunks[ci].logical_offset + chunks[ci].raw_size <= off:
                ci += 1
            cj = ci
            while cj < len(chunks) and chunks[cj].logical_offset < off + n:
                c = chunks[cj]
                lo, hi = max(off, c.logical_offset), min(off + n, c.logical_offset + c.raw_size)
                if hi > lo and c.raw_size:
                    g.stored_bytes += (hi - lo) * c.stored_size / c.raw_size
                    g.codecs.add(ids[c.codec])
                cj += 1
        codec_ids.update(ids[c.codec] for c in chunks)
    return Inspection(
        manifest,
        tensors,
        sorted(groups.values(), key=lambda g: -g.raw_bytes),
        n_chunks,
        sorted(codec_ids),
    )
