"""Copy a checkpoint between tiers, manifest last (the copy is committed only when whole)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from tierckpt.backends.base import Backend
from tierckpt.errors import (
    CorruptChunk,
    FormatError,
)
from tierckpt.format import (
    CheckpointId,
    checksum,
    decode_manifest,
    encode_manifest,
    manifest_name,
)
from tierckpt.offline._listing import Progress, _id
from tierckpt.restore import read_index, read_manifest

#: copies move at most this much per read (one chunk may be larger: it is read whole)
COPY_BLOCK = 8 << 20


# -- copy --------------------------------------------------------------------------------------
def checkpoint_bytes(
    backend: Backend, step: int | CheckpointId, *, timeline: int | None = None
) -> int:
    """Total size of the shard files of one committed checkpoint."""
    cid = _id(backend, step, timeline)
    m = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
    return sum(s.size for s in m.shards)


def _pieces(index: dict[str, Any], size: int) -> Iterator[tuple[int, int, int, int]]:
    """The file as consecutive ``(offset, length, chunk number or -1, chunk start in piece)``.

    A chunk is read whole (its checksum is checked on the piece) together with the padding
    before it; other bytes (long gaps, the index and footer) go in pieces of COPY_BLOCK.
    """
    pos = 0
    for ci, rec in enumerate(index["chunks"]):
        while rec.file_offset - pos > COPY_BLOCK:
            yield pos, COPY_BLOCK, -1, 0
            pos += COPY_BLOCK
        end = rec.file_offset + rec.stored_size
        yield pos, end - pos, ci, rec.file_offset - pos
        pos = end
    while pos < size:
        n = min(COPY_BLOCK, size - pos)
        yield pos, n, -1, 0
        pos += n


def side_files(metadata: Any) -> list[str]:
    """Files a manifest's metadata names besides the shards (a DCP checkpoint's metadata)."""
    dcp = metadata.get("dcp") if isinstance(metadata, dict) else None
    f = dcp.get("file") if isinstance(dcp, dict) else None
    return [f] if isinstance(f, str) else []


def copy_checkpoint(
    src: Backend,
    dst: Backend,
    step: int | CheckpointId,
    *,
    progress: Progress | None = None,
    timeline: int | None = None,
    tier_label: str | None = None,
) -> int:
    """Copy one committed checkpoint from ``src`` to ``dst``; returns the bytes copied.

    Shard files stream through in pieces (each chunk's checksum checked on the way) and are
    committed first; the manifest is written last, create-only, so the copy exists on ``dst``
    only once it is whole. Raises ``FileExistsError`` if ``dst`` already has the checkpoint.
    The copy keeps its step and timeline. ``tier_label``: the tier the copy's manifest names
    (``ls`` shows it), e.g. ``"s3"`` for a copy pushed to S3; None keeps the source's.
    """
    cid = _id(src, step, timeline)
    name = manifest_name(cid.step, timeline=cid.timeline)
    manifest_bytes = src.get(name)
    manifest = decode_manifest(manifest_bytes, where=f"{src.url}/{name}")
    if manifest.id != cid:
        raise FormatError(f"{src.url}/{name}: the manifest is {manifest.id}'s, not {cid}'s")
    if dst.exists(name):
        raise FileExistsError(f"{dst.url}: {cid} is already committed there")
    copied = 0
    for ref in manifest.shards:
        index, _blob, _footer = read_index(src, ref, src.url)
        writer = dst.open_writer(ref.file)
        try:
            for offset, length, ci, at in _pieces(index, ref.size):
                data = src.read(ref.file, offset, length)
                if ci >= 0 and checksum(memoryview(data)[at:]) != index["chunks"][ci].checksum:
                    raise CorruptChunk(
                        f"{src.url}/{ref.file}: chunk {ci} does not match its checksum; "
                        "nothing was committed at the destination",
                        tier=src.url,
                        file=ref.file,
                        chunk=ci,
                    )
                writer.write(offset, data)
                copied += length
                if progress is not None:
                    progress(length)
            if writer.size != ref.size:
                raise FormatError(f"{src.url}/{ref.file}: copied {writer.size} of {ref.size} bytes")
            writer.commit()
        except BaseException:
            writer.abort()
            raise
    for side in side_files(manifest.metadata):  # a DCP checkpoint's metadata: before the manifest
        dst.put_atomic(side, src.get(side), overwrite=True)
    if tier_label is not None and tier_label != manifest.tier:
        manifest_bytes = encode_manifest(replace(manifest, tier=tier_label))
    dst.put_atomic(name, manifest_bytes)
    return copied
