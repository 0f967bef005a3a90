"""Copy a checkpoint to another tier stored with that tier's codec (``tierckpt push``/``pull``).

:func:`~tierckpt.offline.copy_checkpoint` moves the stored bytes as they are: a checkpoint
saved raw to a local disk and pushed to S3 would sit there raw, though the S3 tier compresses
what it saves. :func:`recode_checkpoint` rewrites each shard file chunk by chunk instead: every
chunk is read and checked against its checksum, decoded, and encoded again with the codec the
destination tier would have used for it (``"auto"``: raw on local disks, compressed on remote
stores; the chunk's dtype picks the float-aware codec), or kept as stored when that is already
the codec. The new file gets its own index (chunk records, codec table) and footer; the
manifest, written last and create-only, lists the new files, their stored size and codecs, and
names the tier the copy is on. The tensors' bytes, tree and metadata are unchanged: a load of
the copy is bit-exact.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import replace
from typing import Any

from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import CorruptChunk, FormatError
from tierckpt.format import (
    FOOTER_SIZE,
    CheckpointId,
    ChunkRecord,
    Footer,
    ShardRef,
    align_up,
    checksum,
    decode_manifest,
    encode_index,
    encode_manifest,
    manifest_name,
)
from tierckpt.offline._copy import copy_checkpoint, side_files
from tierckpt.offline._listing import Progress, _id
from tierckpt.policy import CodecSpec, resolve_codec
from tierckpt.restore import read_index


def recode_checkpoint(
    src: Backend,
    dst: Backend,
    step: int | CheckpointId,
    codec: CodecSpec = "auto",
    *,
    progress: Progress | None = None,
    timeline: int | None = None,
    tier_label: str | None = None,
) -> int:
    """Copy one committed checkpoint from ``src`` to ``dst``, each chunk stored with ``codec``
    as a tier on ``dst`` with that codec setting stores it (see the module docstring); returns
    the chunk bytes stored there. ``progress`` gets the source bytes read. Raises
    ``FileExistsError`` if ``dst`` already has the checkpoint, :class:`CorruptChunk`
    (nothing committed) if a source chunk does not match its checksum."""
    cid = _id(src, step, timeline)
    name = manifest_name(cid.step, timeline=cid.timeline)
    manifest = decode_manifest(src.get(name), where=f"{src.url}/{name}")
    if manifest.id != cid:
        raise FormatError(f"{src.url}/{name}: the manifest is {manifest.id}'s, not {cid}'s")
    if dst.exists(name):
        raise FileExistsError(f"{dst.url}: {cid} is already committed there")
    target = resolve_codec(codec, dst)
    indexes = [read_index(src, ref, src.url)[0] for ref in manifest.shards]
    if not any(_changes(index, target) for index in indexes):  # already stored so: as it is
        return copy_checkpoint(src, dst, cid, progress=progress, tier_label=tier_label)
    refs: list[ShardRef] = []
    written = 0
    ids: set[str] = set()
    for ref in manifest.shards:
        new_ref, n, used = _recode_shard(src, dst, ref, target, progress)
        refs.append(new_ref)
        written += n
        ids |= used
    extra = 0
    for side in side_files(manifest.metadata):  # before the manifest: it names them
        blob = src.get(side)
        dst.put_atomic(side, blob, overwrite=True)
        extra += len(blob)
    new = replace(
        manifest,
        shards=tuple(refs),
        stored_bytes=written + extra,
        codecs=tuple(sorted(ids)) or manifest.codecs,
        tier=tier_label if tier_label is not None else manifest.tier,
    )
    dst.put_atomic(name, encode_manifest(new))
    return written


def _changes(index: dict[str, Any], target: Codec) -> bool:
    """Whether some chunk of the shard ``index`` describes is stored with another codec than
    ``target`` would store it with."""
    have = [codec_from_config(c).get_config() for c in index["codecs"]]
    dtypes = _chunk_dtypes(index)
    return any(
        target.for_dtype(dtypes[ci]).get_config() != have[rec.codec]
        for ci, rec in enumerate(index["chunks"])
    )


def _chunk_dtypes(index: dict[str, Any]) -> list[str]:
    """Each chunk's dtype name (a chunk holds one dtype; "uint8" where no tensor says)."""
    storages = index.get("storages") or []
    starts = [int(s[0]) for s in storages]
    dtype_of: dict[int, str] = {}
    for entry in index.get("tensors") or []:
        if isinstance(entry, list) and len(entry) == 6 and type(entry[0]) is int:
            dtype_of.setdefault(entry[0], str(entry[2]))
    out = []
    for rec in index["chunks"]:
        si = bisect.bisect_right(starts, rec.logical_offset) - 1
        out.append(dtype_of.get(si, "uint8") if si >= 0 else "uint8")
    return out


def _recode_shard(
    src: Backend, dst: Backend, ref: ShardRef, target: Codec, progress: Progress | None
) -> tuple[ShardRef, int, set[str]]:
    index, blob, _footer = read_index(src, ref, src.url)
    where = f"{src.url}/{ref.file}"
    src_codecs = [codec_from_config(c) for c in index["codecs"]]
    dtypes = _chunk_dtypes(index)
    codecs: list[dict[str, Any]] = []
    records: list[list[Any]] = []
    used: set[str] = set()
    stored_total = 0
    writer = dst.open_writer(ref.file)
    try:
        offset = 0
        for ci, rec in enumerate(index["chunks"]):
            stored = memoryview(src.read(ref.file, rec.file_offset, rec.stored_size)).cast("B")
            if checksum(stored) != rec.checksum:
                raise CorruptChunk(
                    f"{where}: chunk {ci} does not match its checksum; nothing was committed "
                    "at the destination",
                    tier=src.url,
                    file=ref.file,
                    chunk=ci,
                )
            data, config = _recode_chunk(stored, rec, src_codecs[rec.codec], target, dtypes[ci])
            start = align_up(offset)
            if start > offset:
                writer.write(offset, bytes(start - offset))
            writer.write(start, data)
            n = len(memoryview(data).cast("B"))
            digest = rec.checksum if data is stored else checksum(data)
            if config not in codecs:
                codecs.append(config)
            records.append(
                ChunkRecord(
                    rec.logical_offset, rec.raw_size, n, start, codecs.index(config), digest
                ).to_json()
            )
            used.add(str(config.get("id", "?")))
            offset = start + n
            stored_total += n
            if progress is not None:
                progress(rec.stored_size)
        raw_index = json.loads(bytes(blob))
        raw_index["codecs"] = codecs
        raw_index["chunks"] = records
        new_blob = encode_index(raw_index)
        writer.write(offset, new_blob)
        size = offset + len(new_blob) + FOOTER_SIZE
        footer = Footer(offset, len(new_blob), checksum(new_blob), size)
        writer.write(offset + len(new_blob), footer.encode())
        if writer.size != size:
            raise FormatError(f"{dst.url}/{ref.file}: wrote {writer.size} of {size} bytes")
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return ShardRef(ref.rank, ref.file, size, footer.index_checksum), stored_total, used


def _recode_chunk(
    stored: memoryview, rec: ChunkRecord, have: Codec, target: Codec, dtype: str
) -> tuple[Any, dict[str, Any]]:
    """The chunk's bytes and codec config as ``target`` stores it: as stored when that is
    already its codec, raw when encoding would not make it smaller (as a save does)."""
    want = target.for_dtype(dtype)
    have_config = have.get_config()
    if want.get_config() == have_config:
        return stored, have_config
    if have.is_passthrough and rec.stored_size == rec.raw_size:
        raw: memoryview = stored
    else:
        buf = bytearray(rec.raw_size)
        have.decode(stored, memoryview(buf))
        raw = memoryview(buf)
    if want.is_passthrough:
        return raw, want.get_config()
    out = want.encode(raw)
    if len(memoryview(out).cast("B")) >= len(raw):
        return raw, {"id": "raw"}
    return out, want.get_config()
