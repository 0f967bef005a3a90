"""The shard index: chunk records, declared counts, and a parse bounded by them."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierckpt import limits
from tierckpt._types import JSON, BytesLike
from tierckpt.errors import FormatError
from tierckpt.format._names import ALIGNMENT, CHECKSUM_ALGO, FOOTER_SIZE, FORMAT_VERSION
from tierckpt.jsonbound import JsonShape, loads_within, scan
from tierckpt.tree import tree_side_table

# -- index ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """Where one chunk lives in a shard file and how to turn it back into raw bytes."""

    logical_offset: int  # position in the rank's logical byte stream
    raw_size: int
    stored_size: int
    file_offset: int
    codec: int  # index into the index's codec table
    checksum: str  # xxh3-64 of the stored bytes

    def to_json(self) -> list[Any]:
        return [
            self.logical_offset,
            self.raw_size,
            self.stored_size,
            self.file_offset,
            self.codec,
            self.checksum,
        ]


#: the index's first bytes as tierckpt writes them: a reader finds the declared counts here
#: before parsing anything (an index that does not begin so is read with the legacy limit)
_COUNTS_HEAD = re.compile(
    rb'\{"format":"tierckpt-shard","version":(\d{1,9}),"counts":(\{[^{}\[\]]{0,400}\})'
)
_COUNT_WORDS = {
    "codecs": "codecs",
    "chunks": "chunks",
    "storages": "storages",
    "tensors": "tensors",
    "dims": "tensor dimensions",
    "tree": "object-tree JSON items",
    "text": "bytes of object-tree strings",
}
_COUNT_KEYS = tuple(_COUNT_WORDS)
#: an index longer than this is checked against its declared counts before it is read
HEAD_PROBE_BYTES = 64 << 10
_HEAD_BYTES = 512


@dataclass(frozen=True, slots=True)
class EncodedTable:
    """A table of an index given as its compact JSON text, with the counts a reader is told
    (:func:`index_counts`): its records and, for the tensor table, its shapes' dimensions.

    A save's tensor and storage tables are the same at every save of the same layout; made
    once as text, they cost a save no Python objects (thousands of small lists alive at once,
    for a state of thousands of tensors, would run the garbage collector; see
    ``ShardLayout.index_tables``)."""

    text: str
    length: int
    dims: int = 0


def _list(v: object) -> list[Any]:
    return v if isinstance(v, list) else []


def _length(v: object) -> int:
    return v.length if isinstance(v, EncodedTable) else len(_list(v))


def _dims(tensors: object) -> int:
    """Shape elements of a tensor table (records that are not 6-lists count none)."""
    if isinstance(tensors, EncodedTable):
        return tensors.dims
    return sum(
        len(e[3])
        for e in _list(tensors)
        if isinstance(e, list) and len(e) == 6 and isinstance(e[3], list)
    )


def _compact(value: JSON, allow_nan: bool = True) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=allow_nan)


def index_counts(index: dict[str, Any], tree_text: str | None = None) -> dict[str, JSON]:
    """The ``counts`` an index declares: table lengths, the tensor table's dimensions, and the
    object tree's JSON items and string bytes. A reader derives from them how many bytes and
    JSON items the index may hold, so its memory budget, before reading or parsing it.
    ``tree_text``: the tree's compact JSON, when the caller has it already."""
    if tree_text is None:
        tree_text = _compact(index.get("tree"))
    tree = scan(tree_text.encode("utf-8"))
    side = _side_table(index)
    if side is not None:  # decoded and counted with the tree
        more = scan(_compact(side).encode("utf-8"))
        tree = JsonShape(tree.items + more.items, 0, tree.text + more.text)
    return {
        "codecs": _length(index.get("codecs")),
        "chunks": _length(index.get("chunks")),
        "storages": _length(index.get("storages")),
        "tensors": _length(index.get("tensors")),
        "dims": _dims(index.get("tensors")),
        "tree": tree.items,
        "text": tree.text,
    }


def _side_table(index: dict[str, Any]) -> JSON:
    """The object tree's side table: carried by a freshly encoded tree, or an index field."""
    side = tree_side_table(index.get("tree"))
    return side if side is not None else index.get("odict_metadata")


def with_counts(index: dict[str, Any], tree_text: str | None = None) -> dict[str, Any]:
    """``index`` with freshly computed ``counts`` right after ``format`` and ``version`` (where
    a reader looks for them); without ``format`` or ``version`` there is no header to put them
    in and stale counts are dropped."""
    rest = {k: v for k, v in index.items() if k not in ("format", "version", "counts")}
    side = tree_side_table(index.get("tree"))
    if side is not None:
        rest["odict_metadata"] = side
    if "format" not in index or "version" not in index:
        return rest
    return {
        "format": index["format"],
        "version": index["version"],
        "counts": index_counts(index, tree_text),
        **rest,
    }


def _member_text(value: object) -> str:
    if isinstance(value, EncodedTable):
        return value.text
    return _compact(value, allow_nan=False)  # type: ignore[arg-type]


def encode_index(index: dict[str, Any]) -> bytes:
    """The index as compact JSON, its declared counts first (the object tree, which may be
    large, is serialized once: for the counts and for the file). A table may be given as an
    :class:`EncodedTable`, whose text goes in as it is."""
    tree_text = _compact(index.get("tree"), allow_nan=False)
    members = [
        f"{_compact(k)}:{tree_text if k == 'tree' else _member_text(v)}"
        for k, v in with_counts(index, tree_text).items()
    ]
    return ("{" + ",".join(members) + "}").encode("utf-8")


def _declared_counts(data: BytesLike, index_offset: int, where: str) -> dict[str, int] | None:
    """The counts in the index's first bytes, checked against the limits; None if absent."""
    m = _COUNTS_HEAD.match(bytes(memoryview(data)[:_HEAD_BYTES]))
    if m is None:
        return None
    try:
        counts = json.loads(m.group(2))
    except ValueError:
        counts = None
    if not isinstance(counts, dict) or not all(
        type(counts.get(k)) is int and counts[k] >= 0 for k in _COUNT_KEYS
    ):
        raise FormatError(f"{where}: index counts malformed: {m.group(2)[:200]!r}")
    caps = {
        "codecs": counts["chunks"] + 8,
        # chunks start at distinct multiples of ALIGNMENT before the index
        "chunks": max(index_offset, 0) // ALIGNMENT + 1,
        "storages": limits.MAX_NODES,
        "tensors": limits.MAX_NODES,
        "dims": limits.MAX_DIMS * counts["tensors"],
        "tree": limits.TREE_ITEMS_PER_NODE * limits.MAX_NODES,
        "text": limits.MAX_INDEX_BYTES,
    }
    for key, cap in caps.items():
        if counts[key] > cap:
            raise FormatError(
                f"{where}: index declares {counts[key]:,} {_COUNT_WORDS[key]}, more than the "
                f"{cap:,} a reader allows; refused before reading it (a damaged or hostile file)"
            )
    return counts


def _index_budget(counts: dict[str, int]) -> int:
    """JSON items an index with these counts may hold (see tierckpt.limits)."""
    return (
        limits.INDEX_ITEMS_BASE
        + limits.INDEX_ITEMS_PER_CODEC * counts["codecs"]
        + limits.INDEX_ITEMS_PER_CHUNK * counts["chunks"]
        + limits.INDEX_ITEMS_PER_STORAGE * counts["storages"]
        + limits.INDEX_ITEMS_PER_TENSOR * counts["tensors"]
        + limits.INDEX_ITEMS_PER_DIM * counts["dims"]
        + counts["tree"]
    )


def _index_limits(
    head: BytesLike, index_length: int, index_offset: int, where: str
) -> tuple[dict[str, int] | None, int, str]:
    """(declared counts or None, JSON items allowed, why) for an index of ``index_length``
    bytes whose first bytes are ``head``; refuses one longer than its counts allow."""
    counts = _declared_counts(head, index_offset, where)
    if counts is None:
        items, max_bytes = limits.LEGACY_INDEX_ITEMS, limits.LEGACY_INDEX_BYTES
        why = "allowed in an index without declared counts"
    else:
        items = _index_budget(counts)
        max_bytes = limits.INDEX_BYTES_PER_ITEM * items + counts["text"]
        why = (
            f"its declared counts allow ({counts['tensors']:,} tensors, {counts['chunks']:,} "
            f"chunks, {counts['storages']:,} storages, {counts['tree']:,} tree items)"
        )
    if index_length > max_bytes:
        raise FormatError(
            f"{where}: index is {index_length:,} bytes, more than the {max_bytes:,} {why}; "
            "refused before reading it (a damaged or hostile file)"
        )
    return counts, items, why


def check_index_head(head: BytesLike, *, index_length: int, file_size: int, where: str) -> None:
    """Refuse, from its first bytes only, an index longer than its declared counts allow, so
    that a reader does not even read it (see ``restore.read_index``)."""
    _index_limits(head, index_length, file_size - FOOTER_SIZE - index_length, where)


def _parse_index(data: BytesLike, file_size: int, where: str) -> tuple[Any, dict[str, int] | None]:
    """Parse an index within the bytes and items its declared counts (or the legacy limits)
    allow, and at most MAX_INDEX_DEPTH deep."""
    length = len(memoryview(data))
    counts, items, why = _index_limits(data, length, file_size - FOOTER_SIZE - length, where)
    index = loads_within(
        data, max_items=items, max_depth=limits.MAX_INDEX_DEPTH, where=where, what="index", why=why
    )
    return index, counts


def _check_counts(index: dict[str, Any], counts: dict[str, int], where: str) -> None:
    """What the index holds must be what it declared (its budget was computed from it)."""
    held = {
        "codecs": len(index["codecs"]),
        "chunks": len(index["chunks"]),
        "storages": len(index["storages"]),
        "tensors": len(index["tensors"]),
        "dims": _dims(index["tensors"]),
    }
    for key, n in held.items():
        if n != counts[key]:
            raise FormatError(
                f"{where}: index declares {counts[key]:,} {_COUNT_WORDS[key]} but holds {n:,}"
            )


def tree_args(index: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``decode_tree`` for this index's tree: its side table and the
    JSON items declared for both (None for an index without counts)."""
    counts = index.get("counts")
    items = counts["tree"] if isinstance(counts, dict) and type(counts.get("tree")) is int else None
    return {"items": items, "odict_metadata": index.get("odict_metadata")}


def _int(v: object, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise FormatError(f"index: {what} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def decode_index(data: BytesLike, *, file_size: int, where: str) -> dict[str, Any]:
    """Parse and validate a shard index. Chunks are checked for bounds and overlap.

    The parse is bounded before it starts: the index may hold only as many JSON items as its
    declared counts allow and nest at most MAX_INDEX_DEPTH deep (:mod:`tierckpt.jsonbound`);
    after it, each declared count must match (the tree's in ``decode_tree(items=...)``).
    """
    index, counts = _parse_index(data, file_size, where)
    if not isinstance(index, dict) or index.get("format") != "tierckpt-shard":
        raise FormatError(f"{where}: not a tierckpt shard index")
    if index.get("version") != FORMAT_VERSION:
        raise FormatError(f"{where}: unsupported shard index version {index.get('version')!r}")
    for key, typ in (
        ("codecs", list),
        ("chunks", list),
        ("storages", list),
        ("tensors", list),
    ):
        if not isinstance(index.get(key), typ):
            raise FormatError(f"{where}: index field {key!r} missing or not a {typ.__name__}")
    if counts is not None:
        _check_counts(index, counts, where)
        index["counts"] = counts
    else:
        index.pop("counts", None)  # not a header: an unknown field
    if index.get("checksum_algo") != CHECKSUM_ALGO:
        raise FormatError(f"{where}: unknown checksum algorithm {index.get('checksum_algo')!r}")
    data_bytes = _int(index.get("data_bytes"), "data_bytes")
    n_codecs = len(index["codecs"])
    chunks: list[ChunkRecord] = []
    file_end = 0
    logical_end = 0
    for i, c in enumerate(index["chunks"]):
        if not isinstance(c, list) or len(c) != 6:
            raise FormatError(f"{where}: chunk {i} record malformed")
        rec = ChunkRecord(
            _int(c[0], f"chunk {i} logical offset"),
            _int(c[1], f"chunk {i} raw size", 0, 1 << 40),
            _int(c[2], f"chunk {i} stored size", 0, 1 << 40),
            _int(c[3], f"chunk {i} file offset"),
            _int(c[4], f"chunk {i} codec", 0, n_codecs - 1),
            c[5] if isinstance(c[5], str) and re.fullmatch(r"[0-9a-f]{16}", c[5]) else "",
        )
        if not rec.checksum:
            raise FormatError(f"{where}: chunk {i} has a malformed checksum")
        if rec.file_offset < file_end or rec.file_offset + rec.stored_size > file_size:
            raise FormatError(f"{where}: chunk {i} overlaps another or lies outside the file")
        if rec.logical_offset < logical_end or rec.logical_offset + rec.raw_size > data_bytes:
            raise FormatError(f"{where}: chunk {i} overlaps another in the data stream")
        file_end = rec.file_offset + rec.stored_size
        logical_end = rec.logical_offset + rec.raw_size
        chunks.append(rec)
    index["chunks"] = chunks
    if not _storages_ok(index["storages"], data_bytes):
        _check_storages(index["storages"], data_bytes, where)  # raises, naming the record
    return index


def _storages_ok(storages: list[Any], data_bytes: int) -> bool:
    """Whether the storage table is sound (``[offset, size]`` ints, in order, apart, within
    the data, the last ending at its end), checked a column at a time: a table of thousands
    of storages in well under a ms. False: :func:`_check_storages` says what is wrong."""
    if not storages:
        return data_bytes == 0
    try:
        if set(map(type, storages)) != {list} or set(map(len, storages)) != {2}:
            return False
        offs = [s[0] for s in storages]
        sizes = [s[1] for s in storages]
        if set(map(type, offs)) != {int} or set(map(type, sizes)) != {int}:
            return False
        if min(offs) < 0 or min(sizes) < 0 or max(offs) >= 1 << 62 or max(sizes) >= 1 << 62:
            return False
    except TypeError:
        return False
    o = np.array(offs, dtype=np.int64)
    ends = o + np.array(sizes, dtype=np.int64)  # < 2**63: both are below 2**62
    return bool((o[1:] >= ends[:-1]).all() and ends.max() <= data_bytes and ends[-1] == data_bytes)


def _check_storages(storages: list[Any], data_bytes: int, where: str) -> None:
    """The storage table checked record by record: ``FormatError`` naming the first bad one."""
    span_end = 0
    for i, s in enumerate(storages):
        if not isinstance(s, list) or len(s) != 2:
            raise FormatError(f"{where}: storage {i} record malformed")
        off = _int(s[0], f"storage {i} offset")
        n = _int(s[1], f"storage {i} size")
        if off < span_end or off + n > data_bytes:
            raise FormatError(f"{where}: storage {i} overlaps another or lies outside the data")
        span_end = off + n
    if span_end != data_bytes:
        raise FormatError(f"{where}: storages cover {span_end} of {data_bytes} data bytes")
