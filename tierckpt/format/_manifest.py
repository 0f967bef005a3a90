"""The manifest: the commit record of a checkpoint, listing each rank's shard file."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from tierckpt import limits
from tierckpt._types import JSON, BytesLike
from tierckpt.backends.base import validate_name
from tierckpt.errors import CorruptCheckpoint, FormatError, NewerFormat
from tierckpt.format._names import (
    FOOTER_SIZE,
    MANIFEST_VERSIONS,
    MAX_MANIFEST_BYTES,
    MAX_TIMELINE,
    MAX_WORLD_SIZE,
    CheckpointId,
    _check_step,
    _check_timeline,
    checksum,
    step_prefix,
)
from tierckpt.jsonbound import loads_within
from tierckpt.layout import manifest_version, shard_in_folder

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
    #: a node-local copy (a private tier of a multi-rank job): it lists every rank's shard
    #: file, and holds only those of the ranks on its node
    node_local: bool = False

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
    version = manifest_version([s.file for s in m.shards], step_prefix(m.step, timeline=m.timeline))
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
    if m.node_local:
        body["node_local"] = True  # only when set, as the timeline
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
    version = body.get("version")
    # before the checksum: a newer release may sum another way, and its manifest is never
    # taken for damage (which retention and gc may delete)
    if type(version) is int and version > max(MANIFEST_VERSIONS):
        raise NewerFormat(
            f"{where}: manifest version {version}, written by a newer tierckpt; this one reads "
            f"versions {', '.join(map(str, MANIFEST_VERSIONS))} (upgrade tierckpt to read it; "
            "nothing here deletes or replaces it)"
        )
    stored = body.pop("checksum", None)
    try:
        canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (ValueError, RecursionError) as exc:  # NaN / Infinity / 1e400: never written by us
        raise FormatError(f"{where}: manifest holds values JSON cannot carry ({exc})") from None
    if stored != checksum(canon.encode("utf-8")):
        raise CorruptCheckpoint(f"{where}: manifest checksum mismatch")
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
        created=float(created)
        if isinstance(created, float) or (type(created) is int and abs(created) < 2**53)
        else 0.0,
        library_version=str(body.get("library_version", "")),
        tier=str(body.get("tier", "")),
        raw_bytes=body.get("raw_bytes", 0) if type(body.get("raw_bytes")) is int else 0,
        stored_bytes=body.get("stored_bytes", 0) if type(body.get("stored_bytes")) is int else 0,
        codecs=tuple(str(c) for c in codecs) if isinstance(codecs, list) else (),
        metadata=metadata if isinstance(metadata, dict) else {},
        timeline=timeline,
        node_local=body.get("node_local") is True,
    )
