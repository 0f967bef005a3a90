"""On-disk format v1: shard files, their index and footer, manifests, object names.

See ``docs/format.md`` for the specification; this module is its executable form. The
serialized bytes, not these classes, are the compatibility contract: golden files of every
version live in ``tests/fixtures/``.

Shard file (one per rank per checkpoint per tier)::

    [chunk 0][pad to 4 KiB][chunk 1][pad] ... [index: UTF-8 JSON][footer: 64 bytes]

Footer (little-endian)::

    0  8s  magic  b"TIERCKPT"
    8  I   format version (1)
    12 I   flags (0)
    16 Q   index offset
    24 Q   index length
    32 Q   xxh3-64 of the index bytes
    40 Q   total file size (including this footer)
    48 Q   xxh3-64 of bytes 0..47 of the footer
    56 8s  end magic  b"TCKPTEND"
"""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

import xxhash

from tierckpt import limits
from tierckpt._types import JSON, BytesLike
from tierckpt.backends.base import validate_name
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.jsonbound import JsonShape, loads_within, scan
from tierckpt.layout import data_folder_part, manifest_version, shard_file, shard_in_folder
from tierckpt.tree import tree_side_table

__all__ = [
    "ALIGNMENT",
    "FOOTER_SIZE",
    "FORMAT_VERSION",
    "MAX_TIMELINE",
    "CheckpointId",
    "ChunkRecord",
    "Footer",
    "Manifest",
    "ShardRef",
    "checksum",
    "decode_index",
    "decode_manifest",
    "encode_index",
    "encode_manifest",
    "HEAD_PROBE_BYTES",
    "check_index_head",
    "index_counts",
    "tree_args",
    "with_counts",
    "manifest_name",
    "parse_data_folder",
    "parse_manifest_id",
    "parse_manifest_name",
    "shard_name",
    "step_prefix",
]

FORMAT_VERSION = 1
#: manifest versions this tierckpt reads: 1, and 2 (shard files under hashed prefixes,
#: tierckpt.layout; the shard files themselves are version 1)
MANIFEST_VERSIONS = (1, 2)
ALIGNMENT = 4096
FOOTER_SIZE = 64
MAGIC = b"TIERCKPT"
END_MAGIC = b"TCKPTEND"
_FOOTER = struct.Struct("<8sIIQQQQQ8s")
assert _FOOTER.size == FOOTER_SIZE

MAX_STEP = 10**12 - 1
#: timelines are written with 6 digits; timeline 0 has no suffix at all (the v1 names)
MAX_TIMELINE = 10**6 - 1
MAX_INDEX_BYTES = limits.MAX_INDEX_BYTES
MAX_MANIFEST_BYTES = limits.MAX_MANIFEST_BYTES
MAX_WORLD_SIZE = 1 << 20
CHECKSUM_ALGO = "xxh3_64"

MANIFEST_DIR = "manifests"
DATA_DIR = "steps"
# timeline 0: exactly the v1 names; timeline t >= 1: a ".t<6 digits>" suffix (never ".t000000",
# so that every checkpoint has exactly one name)
_MANIFEST_RE = re.compile(r"^manifests/step-(\d{12})(?:\.t(\d{6}))?\.json$")
_DATA_RE = re.compile(r"^steps/(\d{12})(?:\.t(\d{6}))?/")


def checksum(data: BytesLike) -> str:
    """xxh3-64 of ``data`` as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# -- checkpoint ids and names ---------------------------------------------------------


def _check_step(step: object) -> int:
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise FormatError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return step


def _check_timeline(timeline: object) -> int:
    if type(timeline) is not int or not 0 <= timeline <= MAX_TIMELINE:
        raise FormatError(f"timeline must be an int in [0, {MAX_TIMELINE}], got {timeline!r}")
    return timeline


@dataclass(frozen=True, slots=True)
class CheckpointId:
    """Which checkpoint: a step on a timeline, ordered by ``(timeline, step)``.

    A run resumed from an older step (a rollback) saves on a new timeline, one above the
    newest, so its checkpoints are newer than every checkpoint of the run it abandoned even
    where their step numbers are lower or equal. "The newest checkpoint" is the largest id;
    retention keeps the newest ids. Timeline 0 is the one every run starts on, and its names
    are exactly those of format v1.
    """

    step: int
    timeline: int = 0

    def __post_init__(self) -> None:
        _check_step(self.step)
        _check_timeline(self.timeline)

    @property
    def key(self) -> tuple[int, int]:
        """``(timeline, step)``: the order of ids."""
        return (self.timeline, self.step)

    def __lt__(self, other: CheckpointId) -> bool:
        return self.key < other.key

    def __le__(self, other: CheckpointId) -> bool:
        return self.key <= other.key

    def __gt__(self, other: CheckpointId) -> bool:
        return self.key > other.key

    def __ge__(self, other: CheckpointId) -> bool:
        return self.key >= other.key

    def __str__(self) -> str:
        return f"step {self.step}" + (f" (timeline {self.timeline})" if self.timeline else "")


def _suffix(timeline: int) -> str:
    return f".t{_check_timeline(timeline):06d}" if timeline else ""


def manifest_name(step: int, *, timeline: int = 0) -> str:
    """``manifests/step-<12 digits>.json``; on timeline t >= 1 ``...<12 digits>.t<6>.json``."""
    return f"{MANIFEST_DIR}/step-{_check_step(step):012d}{_suffix(timeline)}.json"


def parse_manifest_id(name: str) -> CheckpointId | None:
    """The checkpoint a manifest name belongs to; None for any other name."""
    m = _MANIFEST_RE.match(name)
    return _id_of(m)


def parse_manifest_name(name: str) -> int | None:
    """The step of a manifest name (of any timeline); None for any other name."""
    cid = parse_manifest_id(name)
    return cid.step if cid is not None else None


def parse_data_folder(name: str) -> CheckpointId | None:
    """The checkpoint whose data folder (``steps/<step>[.t<timeline>]/``, in format v2 also
    under a hashed prefix ``<hh>/``) holds ``name``."""
    return _id_of(_DATA_RE.match(data_folder_part(name)))


def _id_of(m: re.Match[str] | None) -> CheckpointId | None:
    if m is None:
        return None
    timeline = int(m.group(2)) if m.group(2) is not None else 0
    if m.group(2) is not None and timeline == 0:
        return None  # ".t000000" is not a name: timeline 0 has the suffix-free one
    return CheckpointId(int(m.group(1)), timeline)


def step_prefix(step: int, *, timeline: int = 0) -> str:
    """The data folder of a checkpoint: ``steps/<12 digits>/`` (``.t<6 digits>`` on t >= 1)."""
    return f"{DATA_DIR}/{_check_step(step):012d}{_suffix(timeline)}/"


def shard_name(step: int, rank: int, *, timeline: int = 0, prefixes: int = 256) -> str:
    """Rank ``rank``'s shard file: format v2 over ``prefixes`` hashed prefixes (256: every
    tier's default, ``<hh>/steps/...``); ``prefixes=0``: the v1 name
    ``steps/<step>/rank-<r>.tck``. See :mod:`tierckpt.layout`."""
    return shard_file(step_prefix(step, timeline=timeline), rank, prefixes)


def rank_record_name(step: int, rank: int, *, timeline: int = 0) -> str:
    return f"{step_prefix(step, timeline=timeline)}rank-{rank:06d}.done.json"


def rank_failure_name(step: int, rank: int, *, timeline: int = 0) -> str:
    """Where a rank says "my shard of this step failed" (so rank 0 stops waiting for it)."""
    return f"{step_prefix(step, timeline=timeline)}rank-{rank:06d}.failed.json"


# -- footer ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Footer:
    index_offset: int
    index_length: int
    index_checksum: str
    file_size: int
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        head = struct.pack(
            "<8sIIQQQQ",
            MAGIC,
            self.version,
            0,
            self.index_offset,
            self.index_length,
            int(self.index_checksum, 16),
            self.file_size,
        )
        return head + struct.pack("<Q8s", xxhash.xxh3_64_intdigest(head), END_MAGIC)

    @classmethod
    def decode(cls, data: BytesLike, *, file_size: int, where: str) -> Footer:
        raw = bytes(data)
        if len(raw) != FOOTER_SIZE:
            raise CorruptCheckpoint(f"{where}: footer is {len(raw)} bytes, expected 64")
        magic, version, _flags, ioff, ilen, icrc, fsize, fcrc, end = _FOOTER.unpack(raw)
        if magic != MAGIC or end != END_MAGIC:
            raise CorruptCheckpoint(
                f"{where}: no tierckpt footer (bad magic): the file is truncated, "
                "still being written, or not a tierckpt shard file"
            )
        if xxhash.xxh3_64_intdigest(raw[:48]) != fcrc:
            raise CorruptCheckpoint(f"{where}: footer checksum mismatch")
        if version != FORMAT_VERSION:
            raise FormatError(
                f"{where}: shard format version {version}; this tierckpt reads version "
                f"{FORMAT_VERSION} (upgrade tierckpt)"
            )
        if fsize != file_size:
            raise CorruptCheckpoint(
                f"{where}: file is {file_size} bytes but its footer says {fsize} (truncated?)"
            )
        if ilen > limits.MAX_INDEX_BYTES or ioff + ilen + FOOTER_SIZE != file_size:
            raise CorruptCheckpoint(f"{where}: index range {ioff}+{ilen} does not end at footer")
        return cls(ioff, ilen, f"{icrc:016x}", fsize, version)


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


def _list(v: object) -> list[Any]:
    return v if isinstance(v, list) else []


def _dims(tensors: list[Any]) -> int:
    """Shape elements of a tensor table (records that are not 6-lists count none)."""
    return sum(
        len(e[3]) for e in tensors if isinstance(e, list) and len(e) == 6 and isinstance(e[3], list)
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
        "codecs": len(_list(index.get("codecs"))),
        "chunks": len(_list(index.get("chunks"))),
        "storages": len(_list(index.get("storages"))),
        "tensors": len(_list(index.get("tensors"))),
        "dims": _dims(_list(index.get("tensors"))),
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


def encode_index(index: dict[str, JSON]) -> bytes:
    """The index as compact JSON, its declared counts first (the object tree, which may be
    large, is serialized once: for the counts and for the file)."""
    tree_text = _compact(index.get("tree"), allow_nan=False)
    members = [
        f"{_compact(k)}:{tree_text if k == 'tree' else _compact(v, allow_nan=False)}"
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
    span_end = 0
    for i, s in enumerate(index["storages"]):
        if not isinstance(s, list) or len(s) != 2:
            raise FormatError(f"{where}: storage {i} record malformed")
        off = _int(s[0], f"storage {i} offset")
        n = _int(s[1], f"storage {i} size")
        if off < span_end or off + n > data_bytes:
            raise FormatError(f"{where}: storage {i} overlaps another or lies outside the data")
        span_end = off + n
    if span_end != data_bytes:
        raise FormatError(f"{where}: storages cover {span_end} of {data_bytes} data bytes")
    return index


# -- manifest -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ShardRef:
    rank: int
    file: str
    size: int
    index_checksum: str

    def to_json(self) -> dict[str, JSON]:
        return {
            "rank": self.rank,
            "file": self.file,
            "size": self.size,
            "index_checksum": self.index_checksum,
        }


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    world_size: int
    shards: tuple[ShardRef, ...]
    created: float
    library_version: str
    tier: str = ""
    raw_bytes: int = 0
    stored_bytes: int = 0
    codecs: tuple[str, ...] = ()
    metadata: dict[str, JSON] | None = None
    #: the timeline of this checkpoint (0: the first; see :class:`CheckpointId`)
    timeline: int = 0

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)

    def shard_for(self, rank: int) -> ShardRef:
        for s in self.shards:
            if s.rank == rank:
                return s
        raise FormatError(f"manifest of step {self.step} has no shard for rank {rank}")


def encode_manifest(m: Manifest) -> bytes:
    # format v2 (hashed prefixes, tierckpt.layout) only where a file has a v2 name
    version = manifest_version(
        [s.file for s in m.shards], step_prefix(m.step, timeline=m.timeline)
    )
    body: dict[str, JSON] = {
        "format": "tierckpt-manifest",
        "version": version,
        "step": m.step,
        "world_size": m.world_size,
        "created": m.created,
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(m.created)),
        "library_version": m.library_version,
        "tier": m.tier,
        "raw_bytes": m.raw_bytes,
        "stored_bytes": m.stored_bytes,
        "codecs": list(m.codecs),
        "shards": [s.to_json() for s in m.shards],
        "metadata": m.metadata or {},
    }
    if m.timeline:
        # only when non-zero: a timeline-0 manifest stays byte for byte a v1 one
        body["timeline"] = _check_timeline(m.timeline)
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    body["checksum"] = checksum(canon.encode("utf-8"))
    return json.dumps(body, sort_keys=True, indent=1, allow_nan=False).encode("utf-8")


#: a manifest's last member as tierckpt writes it (keys sorted): its world size, found before
#: parsing (the closing brace is the document's, so the member is the top-level one)
_WORLD_TAIL = re.compile(rb'"world_size"\s*:\s*(\d{1,7})\s*\}\s*$')


def _manifest_budget(raw: bytes | bytearray) -> tuple[int, str]:
    m = _WORLD_TAIL.search(raw[-64:])
    world = min(int(m.group(1)), MAX_WORLD_SIZE) if m else 1
    budget = (
        limits.MANIFEST_ITEMS_BASE
        + limits.MANIFEST_ITEMS_PER_SHARD * world
        + limits.MAX_METADATA_BYTES
        + 1
    )
    return (
        budget,
        f"allowed for {world} shard(s) and {limits.MAX_METADATA_BYTES:,} bytes of metadata",
    )


def decode_manifest(data: BytesLike, *, where: str) -> Manifest:
    """Parse and validate a manifest; the parse is bounded by the items its world size and the
    metadata limit allow (see :mod:`tierckpt.limits`)."""
    raw = data if isinstance(data, (bytes, bytearray)) else bytes(data)  # no copy of a big one
    if len(raw) > MAX_MANIFEST_BYTES:
        raise FormatError(f"{where}: manifest larger than {MAX_MANIFEST_BYTES} bytes")
    budget, why = _manifest_budget(raw)
    body = loads_within(
        raw,
        max_items=budget,
        max_depth=limits.MAX_MANIFEST_DEPTH,
        where=where,
        what="manifest",
        why=why,
    )
    if not isinstance(body, dict) or body.get("format") != "tierckpt-manifest":
        raise FormatError(f"{where}: not a tierckpt manifest")
    stored = body.pop("checksum", None)
    try:
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:  # NaN / Infinity / 1e400: never written by us
        raise FormatError(f"{where}: manifest holds values JSON cannot carry ({exc})") from None
    if stored != checksum(canon.encode("utf-8")):
        raise CorruptCheckpoint(f"{where}: manifest checksum mismatch")
    version = body.get("version")
    if version not in MANIFEST_VERSIONS:
        raise FormatError(
            f"{where}: unsupported manifest version {version!r}; this tierckpt reads versions "
            f"{', '.join(map(str, MANIFEST_VERSIONS))} (upgrade tierckpt)"
        )
    step = _check_step(body.get("step"))
    timeline = body.get("timeline", 0)
    if type(timeline) is not int or not 0 <= timeline <= MAX_TIMELINE:
        raise FormatError(f"{where}: bad timeline {timeline!r}")
    world = body.get("world_size")
    if type(world) is not int or not 1 <= world <= MAX_WORLD_SIZE:
        raise FormatError(f"{where}: bad world_size {world!r}")
    shards_json = body.get("shards")
    if not isinstance(shards_json, list) or len(shards_json) != world:
        raise FormatError(f"{where}: manifest must list exactly {world} shards")
    shards = []
    seen = set()
    for s in shards_json:
        if not isinstance(s, dict):
            raise FormatError(f"{where}: malformed shard entry")
        rank = s.get("rank")
        if type(rank) is not int or not 0 <= rank < world or rank in seen:
            raise FormatError(f"{where}: bad or duplicate shard rank {rank!r}")
        seen.add(rank)
        file = validate_name(s.get("file"))  # type: ignore[arg-type]
        if not shard_in_folder(file, step_prefix(step, timeline=timeline), version):
            raise FormatError(
                f"{where}: shard file {file!r} is outside step {step}'s folder "
                f"({'' if version == 1 else '<hh>/'}{step_prefix(step, timeline=timeline)})"
            )
        size = s.get("size")
        if type(size) is not int or not FOOTER_SIZE <= size <= 1 << 50:
            raise FormatError(f"{where}: bad shard size {size!r}")
        crc = s.get("index_checksum")
        if not isinstance(crc, str) or not re.fullmatch(r"[0-9a-f]{16}", crc):
            raise FormatError(f"{where}: bad index checksum {crc!r}")
        shards.append(ShardRef(rank, file, size, crc))
    created = body.get("created")
    codecs = body.get("codecs", [])
    metadata = body.get("metadata", {})
    return Manifest(
        step=step,
        world_size=world,
        shards=tuple(sorted(shards, key=lambda s: s.rank)),
        created=float(created) if isinstance(created, float) or (
            type(created) is int and abs(created) < 2**53
        ) else 0.0,
        library_version=str(body.get("library_version", "")),
        tier=str(body.get("tier", "")),
        raw_bytes=body.get("raw_bytes", 0) if type(body.get("raw_bytes")) is int else 0,
        stored_bytes=body.get("stored_bytes", 0) if type(body.get("stored_bytes")) is int else 0,
        codecs=tuple(str(c) for c in codecs) if isinstance(codecs, list) else (),
        metadata=metadata if isinstance(metadata, dict) else {},
        timeline=timeline,
    )
