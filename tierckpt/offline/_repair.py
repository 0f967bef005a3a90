"""Before ``tierckpt pull`` / ``push`` skip a checkpoint the destination already has: is that
copy the source's checkpoint, and is it intact? And replacing a damaged copy.

A copy is committed by its manifest alone, so a name that exists says nothing of the shard
files it lists (a flipped byte, a truncated file). :func:`destination_copy` reads the
destination's copy whole as ``tierckpt verify`` does (:func:`verify_checkpoint`) on a local
disk; on an object store, which checks its objects' bytes itself and bills every byte read, it
checks each shard file's size and its index (footer and index checksums) unless asked to read
it whole. Then it compares the copy with the source's: the same id (step and timeline) may
hold another run's checkpoint.
A copy made by another tier or codec has other shard files and its own ``created`` time (each
tier's commit stamps its own), so it is compared by what every copy keeps: world size, raw
size, metadata, each shard's object tree and tensor table, the chunks' checksums where both
store a chunk with the same codec, and else the decoded bytes of a few chunks.

:func:`replace_copy` repairs a damaged copy: its manifest is deleted first (the copy is no
longer committed), then the copy is written as a fresh one, shard files first and the manifest
last, create-only. A crash midway leaves an uncommitted leftover (a rerun copies it again, gc
removes it), never a committed step whose files are broken.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from tierckpt.backends.base import Backend
from tierckpt.codecs import codec_from_config
from tierckpt.errors import (
    CheckpointNotFound,
    CorruptChunk,
    FormatError,
    NewerFormat,
    WriterConflict,
)
from tierckpt.format import (
    CheckpointId,
    Manifest,
    ShardRef,
    checksum,
    decode_manifest,
    manifest_name,
)
from tierckpt.offline._leases import leases
from tierckpt.offline._listing import Progress
from tierckpt.offline._verify import verify_checkpoint
from tierckpt.restore import read_index

#: chunks per shard whose decoded bytes are compared where no checksum can be (other codecs)
SAMPLED_CHUNKS = 2


@dataclass(frozen=True, slots=True)
class DestinationCopy:
    """What the destination holds under a checkpoint's id: ``absent``, ``intact`` (the
    source's checkpoint, every chunk checked), ``damaged`` (unreadable or failing a check:
    ``why``) or ``other`` (another checkpoint under the same id: ``why``)."""

    state: Literal["absent", "intact", "damaged", "other"]
    why: str = ""


def destination_copy(
    src: Backend,
    dst: Backend,
    cid: CheckpointId,
    *,
    progress: Progress | None = None,
    read_whole: bool | None = None,
) -> DestinationCopy:
    """Judge ``dst``'s copy of ``src``'s committed checkpoint ``cid`` (module docstring).
    ``read_whole``: read and check every chunk (default: where ``dst`` is not remote); else
    sizes and indexes. ``progress`` gets the destination's bytes read. Errors of the stores
    themselves (a connection lost) are raised, not taken for damage."""
    name = manifest_name(cid.step, timeline=cid.timeline)
    if not dst.exists(name):
        return DestinationCopy("absent")
    mine = decode_manifest(src.get(name), where=f"{src.url}/{name}")
    try:
        theirs = decode_manifest(dst.get(name), where=f"{dst.url}/{name}")
    except CheckpointNotFound:
        return DestinationCopy("absent")  # removed meanwhile
    except NewerFormat as exc:  # a newer release's checkpoint: never replaced
        return DestinationCopy("other", str(exc))
    except FormatError as exc:
        return DestinationCopy("damaged", f"its manifest: {exc}")
    why = _manifests_differ(mine, theirs)
    if why:
        return DestinationCopy("other", why)
    if read_whole is None:
        read_whole = not dst.is_remote
    try:
        if read_whole:
            verify_checkpoint(dst, cid, progress=progress)
        else:
            _whole_files(dst, theirs)
    except (FormatError, CheckpointNotFound) as exc:  # CorruptChunk and a truncated file too
        return DestinationCopy("damaged", str(exc))
    by_rank = {ref.rank: ref for ref in theirs.shards}
    for ref in mine.shards:
        try:
            why = _shards_differ(src, ref, dst, by_rank[ref.rank])
        except CorruptChunk as exc:  # a chunk compared by its bytes (not read whole before)
            if exc.tier == src.url:
                raise  # the source's copy is damaged: nothing to copy from
            return DestinationCopy("damaged", str(exc))
        if why:
            return DestinationCopy("other", f"rank {ref.rank}: {why}")
    return DestinationCopy("intact")


def _whole_files(dst: Backend, manifest: Manifest) -> None:
    """Each shard file of ``manifest`` is there at its size, with an intact index (its footer
    and the checksum the manifest names); raises as :func:`verify_checkpoint` would."""
    for ref in manifest.shards:
        read_index(dst, ref, dst.url)  # the size, the footer and the index checksum


def _manifests_differ(mine: Manifest, theirs: Manifest) -> str:
    """How ``theirs`` is not a copy of ``mine`` by what a copy keeps ("": it may be)."""
    if theirs.id != mine.id:
        return f"its manifest is {theirs.id}'s"
    for what, a, b in (
        ("world size", mine.world_size, theirs.world_size),
        ("raw size", mine.raw_bytes, theirs.raw_bytes),
        ("ranks", sorted(s.rank for s in mine.shards), sorted(s.rank for s in theirs.shards)),
        ("metadata", mine.metadata or {}, theirs.metadata or {}),
    ):
        if a != b:
            return f"its {what} is {b!r}, the source's {a!r}"
    return ""


def _shards_differ(src: Backend, mine: ShardRef, dst: Backend, theirs: ShardRef) -> str:
    a = read_index(src, mine, src.url)[0]
    b = read_index(dst, theirs, dst.url)[0]
    for key in ("tree", "tensors", "storages", "data_bytes"):
        if a.get(key) != b.get(key):
            return f"its shard's {'object tree' if key == 'tree' else key} differs"
    ca, cb = a["chunks"], b["chunks"]
    if [(r.logical_offset, r.raw_size) for r in ca] != [(r.logical_offset, r.raw_size) for r in cb]:
        return "its chunks cover other bytes"
    other_codec = []
    for ci, (ra, rb) in enumerate(zip(ca, cb, strict=True)):
        if _config(a, ra.codec) == _config(b, rb.codec):
            if ra.checksum != rb.checksum:
                return f"chunk {ci} holds other bytes"
        else:
            other_codec.append(ci)
    if len(other_codec) < len(ca):  # some chunks compared by their checksums
        return ""
    # stored with other codecs throughout: the decoded bytes of a few chunks
    picks = sorted({other_codec[0], other_codec[-1]})[:SAMPLED_CHUNKS]
    for ci in picks:
        if _raw(src, mine.file, a, ca[ci]) != _raw(dst, theirs.file, b, cb[ci]):
            return f"chunk {ci} holds other bytes"
    return ""


def _config(index: dict[str, Any], i: int) -> Any:
    return codec_from_config(index["codecs"][i]).get_config()


def _raw(backend: Backend, file: str, index: dict[str, Any], rec: Any) -> bytes:
    stored = backend.read(file, rec.file_offset, rec.stored_size)
    if checksum(stored) != rec.checksum:  # damage, not another checkpoint's bytes
        raise CorruptChunk(
            f"{backend.url}/{file}: the chunk at file bytes {rec.file_offset}.."
            f"+{rec.stored_size} does not match its checksum",
            tier=backend.url,
            file=file,
        )
    out = bytearray(rec.raw_size)
    codec_from_config(index["codecs"][rec.codec]).decode(stored, memoryview(out))
    return bytes(out)


def replace_copy(dst: Backend, cid: CheckpointId, copy: Callable[[], int]) -> int:
    """Replace ``dst``'s damaged copy of ``cid``: its manifest is deleted (uncommitted), then
    ``copy()`` (``copy_checkpoint`` or ``recode_checkpoint``) writes the shard files and, last,
    the manifest; shard files of the old copy the new one does not name are deleted after.
    Returns what ``copy()`` returns. Refused with :class:`WriterConflict` (nothing changed)
    while a writer holds ``dst``'s lease, dead or not: its retention takes an uncommitted
    step's files for a killed save's leftovers."""
    held = [info for info in leases(dst) if info.alive]
    if held:
        raise WriterConflict(
            f"{dst.url}: its copy of {cid} is damaged, but a writer holds this location "
            f"(rank {held[0].rank}: {held[0].describe()}), and replacing a checkpoint under "
            "a writer could race with its retention; nothing was changed. Run this again "
            f"once that job has ended (if it is dead: `tierckpt unlock {dst.url}`)",
            url=dst.url,
            holder=held[0].record,
        )
    name = manifest_name(cid.step, timeline=cid.timeline)
    old = _files(dst, name)
    dst.delete(name)
    n = copy()
    for f in sorted(old - _files(dst, name)):
        dst.delete(f)
    return n


def _files(backend: Backend, name: str) -> set[str]:
    """The shard files ``name``'s manifest lists (none where it cannot be read)."""
    try:
        m = decode_manifest(backend.get(name), where=f"{backend.url}/{name}")
    except (FormatError, CheckpointNotFound):
        return set()
    return {ref.file for ref in m.shards}
