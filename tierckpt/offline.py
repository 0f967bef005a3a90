"""Offline operations on stored checkpoints: list, inspect, verify, copy, collect garbage.

These work on any tier's storage given its URL (a local folder or ``s3://bucket/prefix``),
with no :class:`~tierckpt.Checkpointer` and no training job. The ``tierckpt`` command is a
thin layer over them; they are also usable from Python::

    from tierckpt import offline
    src = offline.open_backend("s3://bucket/run1")
    for m in offline.list_checkpoints(src):
        print(m.step, m.stored_bytes)
    offline.verify_checkpoint(src, step=1000)         # raises CorruptChunk on a bad chunk
    offline.copy_checkpoint(src, offline.open_backend("/nvme/run1"), step=1000)

A step names the checkpoint of the newest timeline holding it (a run resumed from an older
step saves on a new timeline, see :class:`~tierckpt.format.CheckpointId`); pass ``timeline=``
or a ``CheckpointId`` to name another one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt import config
from tierckpt.arena import total_ram
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.catalog import committed_ids, data_ids
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import (
    CheckpointNotFound,
    CorruptChunk,
    FormatError,
    TierCkptError,
    WriterConflict,
)
from tierckpt.format import (
    CheckpointId,
    ChunkRecord,
    Manifest,
    checksum,
    decode_manifest,
    manifest_name,
    tree_args,
)
from tierckpt.layout import data_folder_part
from tierckpt.lease import LeaseRecord, lease_name, list_leases, owner_status
from tierckpt.redact import redact
from tierckpt.restore import read_index, read_manifest
from tierckpt.retention import gc_tier
from tierckpt.tree import decode_tree, dtype_from_name

__all__ = [
    "GroupStats",
    "Inspection",
    "LeaseInfo",
    "TensorInfo",
    "copy_checkpoint",
    "gc",
    "inspect_checkpoint",
    "is_s3_url",
    "leases",
    "list_checkpoints",
    "open_backend",
    "resolve_id",
    "resolve_step",
    "tensor_paths",
    "unlock",
    "verify_checkpoint",
]

#: called with a number of bytes just processed (progress bars)
Progress = Callable[[int], Any]

#: copies move at most this much per read (one chunk may be larger: it is read whole)
COPY_BLOCK = 8 << 20


# -- opening a URL -----------------------------------------------------------------------------
def is_s3_url(url: str) -> bool:
    return url.startswith("s3://")


def open_backend(url: str, *, endpoint_url: str | None = None, create: bool = False) -> Backend:
    """Open a tier's storage: ``s3://bucket/prefix``, ``file:///path`` or a local path.

    ``endpoint_url`` defaults to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` (S3-compatible
    servers). A local folder must exist unless ``create``.
    """
    if is_s3_url(url):
        from tierckpt.backends.s3 import S3Backend

        return S3Backend(url, endpoint_url=config.s3_endpoint_url(endpoint_url))
    if "://" in url and not url.startswith("file://"):
        scheme = url.split("://", 1)[0]
        raise ValueError(
            f"unsupported URL scheme {scheme!r} in {redact(url)!r}: use a local path, "
            "file:///path or s3://bucket/prefix"
        )
    path = url.removeprefix("file://")
    if not create and not os.path.isdir(path):
        raise CheckpointNotFound(f"{path}: no such folder")
    return LocalBackend(path)  # creates the folder; a read-only location raises BackendError


# -- listing -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ListedCheckpoint:
    """One committed checkpoint: its manifest, or why the manifest could not be read.

    ``abandoned``: it is on an older timeline than the newest checkpoint there — the run went
    back to an older step and went on from it; retention removes these first, as older."""

    step: int
    manifest: Manifest | None
    error: str = ""
    timeline: int = 0
    abandoned: bool = False

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)


def list_checkpoints(backend: Backend) -> list[ListedCheckpoint]:
    """Every committed checkpoint on ``backend``, oldest first (by timeline, then step), with
    its manifest; the last one is the newest."""
    out = []
    ids = committed_ids(backend)
    newest = ids[-1].timeline if ids else 0
    for cid in ids:
        abandoned = cid.timeline < newest
        try:
            m = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
            out.append(ListedCheckpoint(cid.step, m, "", cid.timeline, abandoned))
        except TierCkptError as exc:
            out.append(ListedCheckpoint(cid.step, None, str(exc), cid.timeline, abandoned))
    return out


def uncommitted_ids(backend: Backend) -> list[CheckpointId]:
    """Checkpoints with data but no manifest: saves in progress, or leftovers of killed ones."""
    committed = set(committed_ids(backend))
    return [c for c in data_ids(backend) if c not in committed]


def uncommitted_steps(backend: Backend) -> list[int]:
    """Steps with data but no manifest (on any timeline): saves in progress, or leftovers."""
    return sorted({c.step for c in uncommitted_ids(backend)})


def resolve_id(
    backend: Backend, step: int | CheckpointId | None, timeline: int | None = None
) -> CheckpointId:
    """The committed checkpoint ``step`` names on ``backend``: of ``timeline`` if given, else of
    the newest timeline holding it; the newest checkpoint (of ``timeline``) if ``step`` is None.
    Raises ``CheckpointNotFound`` naming what is there."""
    ids = committed_ids(backend)
    if isinstance(step, CheckpointId):
        timeline = step.timeline
        step = step.step
    pool = [c for c in ids if timeline is None or c.timeline == timeline]
    of = "" if timeline is None else f" of timeline {timeline}"
    if step is None:
        if not pool:
            raise CheckpointNotFound(f"{backend.url}: no committed checkpoint{of} here")
        return pool[-1]
    holding = [c for c in pool if c.step == step]
    if not holding:
        shown = ", ".join(id_text(c) for c in ids[-10:]) or "none"
        raise CheckpointNotFound(
            f"{backend.url}: step {step}{of} is not committed here (committed: {shown})"
        )
    return holding[-1]


def resolve_step(backend: Backend, step: int | None) -> int:
    """``step`` if it is committed on ``backend``; the newest checkpoint's step if None."""
    return resolve_id(backend, step).step


def id_text(cid: CheckpointId) -> str:
    """A short form for listings: ``"1200"`` on timeline 0, ``"1200 (timeline 2)"`` else."""
    return f"{cid.step}" + (f" (timeline {cid.timeline})" if cid.timeline else "")


def _id(backend: Backend, step: int | CheckpointId, timeline: int | None) -> CheckpointId:
    """What a ``step`` argument names: a CheckpointId as it is; a step of ``timeline``; or a
    bare step: of the newest timeline holding it (timeline 0 when none does, so that the
    manifest read that follows says it is missing)."""
    if isinstance(step, CheckpointId):
        return step
    if timeline is not None:
        return CheckpointId(step, timeline)
    holding = [c for c in committed_ids(backend) if c.step == step]
    return holding[-1] if holding else CheckpointId(step)


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


# -- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VerifyReport:
    step: int
    shards: int
    chunks: int
    raw_bytes: int
    stored_bytes: int
    timeline: int = 0


def verify_checkpoint(
    backend: Backend,
    step: int | CheckpointId,
    *,
    progress: Progress | None = None,
    timeline: int | None = None,
) -> VerifyReport:
    """Read every chunk of every rank, check its checksum and decode it.

    Raises on the first problem: :class:`~tierckpt.errors.CorruptChunk` (naming the file and
    chunk) for a bad chunk, :class:`~tierckpt.errors.CorruptCheckpoint` or
    :class:`~tierckpt.errors.FormatError` for a bad manifest, footer or index. Memory use is
    one chunk, not the checkpoint.
    """
    cid = _id(backend, step, timeline)
    manifest = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
    n_chunks = raw_total = stored_total = 0
    for ref in manifest.shards:
        where = f"{backend.url}/{ref.file}"
        index, _blob, _footer = read_index(backend, ref, backend.url)
        codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
        chunks: list[ChunkRecord] = index["chunks"]
        for ci, rec in enumerate(chunks):
            stored = backend.read(ref.file, rec.file_offset, rec.stored_size)
            if checksum(stored) != rec.checksum:
                raise CorruptChunk(
                    f"{where}: chunk {ci} of {len(chunks)} (file bytes "
                    f"{rec.file_offset}..+{rec.stored_size}) does not match its checksum",
                    tier=backend.url,
                    file=ref.file,
                    chunk=ci,
                )
            if rec.raw_size > total_ram():  # a hostile size: refuse before allocating
                raise FormatError(
                    f"{where}: chunk {ci} declares {rec.raw_size} raw bytes, "
                    "more than this machine's memory"
                )
            # uninitialized (a zeroed bytearray would touch every page of a declared size
            # that a bomb's frame never fills); memory is used only as a frame decodes
            out = torch.empty(rec.raw_size, dtype=torch.uint8)
            try:
                codecs[rec.codec].decode(stored, memoryview(out.numpy()))  # type: ignore[arg-type]
            except CorruptChunk as exc:
                raise CorruptChunk(
                    f"{where}: chunk {ci} does not decode: {exc}",
                    tier=backend.url,
                    file=ref.file,
                    chunk=ci,
                ) from exc
            n_chunks += 1
            raw_total += rec.raw_size
            stored_total += rec.stored_size
            if progress is not None:
                progress(rec.stored_size)
        covered = sum(c.raw_size for c in chunks)
        if covered != int(index["data_bytes"]):
            raise FormatError(f"{where}: chunks cover {covered} of {index['data_bytes']} bytes")
        _check_tree(index, where)
    return VerifyReport(
        cid.step, len(manifest.shards), n_chunks, raw_total, stored_total, cid.timeline
    )


def _check_tree(index: dict[str, Any], where: str) -> None:
    """Decode the object tree; every tensor reference must be in the tensor table."""
    n = len(index["tensors"])

    def ref(i: int) -> None:
        if not 0 <= i < n:
            raise FormatError(f"{where}: object tree refers to tensor {i} of {n}")

    decode_tree(index.get("tree"), ref, **tree_args(index))


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


def copy_checkpoint(
    src: Backend,
    dst: Backend,
    step: int | CheckpointId,
    *,
    progress: Progress | None = None,
    timeline: int | None = None,
) -> int:
    """Copy one committed checkpoint from ``src`` to ``dst``; returns the bytes copied.

    Shard files stream through in pieces (each chunk's checksum checked on the way) and are
    committed first; the manifest is written last, create-only, so the copy exists on ``dst``
    only once it is whole. Raises ``FileExistsError`` if ``dst`` already has the checkpoint.
    The copy keeps its step and timeline.
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
    dst.put_atomic(name, manifest_bytes)
    return copied


# -- gc ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class GcPlan:
    """What gc deletes: old committed checkpoints (retention) and leftovers of uncommitted
    saves."""

    retained: list[CheckpointId]
    expired: list[CheckpointId]
    leftovers: list[CheckpointId]


def gc(
    backend: Backend,
    keep_last: int,
    *,
    dry_run: bool = False,
    abort_incomplete: bool = False,
    force: bool = False,
) -> GcPlan:
    """Keep the newest ``keep_last`` committed checkpoints; remove older ones and leftovers.

    Newest means by timeline, then step: checkpoints of a timeline a run abandoned (it went
    back to an older step) are older than every checkpoint of the newer timeline. Leftovers are
    data folders without a manifest older than the newest committed checkpoint (saves that
    never committed). ``abort_incomplete`` also discards unfinished writes (temporary files,
    open multipart uploads) — only when no job is writing to this location.

    While a live writer holds the location's lease this raises :class:`WriterConflict`
    (its saves in progress look like leftovers) unless ``force``; ``dry_run`` never refuses.
    """
    if type(keep_last) is not int or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    live = [info for info in leases(backend) if info.alive]
    if live and not dry_run and not force:
        first = live[0]
        raise WriterConflict(
            f"{backend.url} has a live writer: rank {first.rank}'s lease is held by "
            f"{first.describe()}. Its own retention runs after every commit; a gc now could "
            "delete its saves in progress. Stop that job first, or pass --force (force=True)",
            url=backend.url,
            holder=first.record,
        )
    committed = committed_ids(backend)
    newest = committed[-1] if committed else None
    expired = committed[: max(len(committed) - keep_last, 0)]
    committed_set = set(committed)
    leftovers = [
        c for c in data_ids(backend) if c not in committed_set and newest is not None and c < newest
    ]
    plan = GcPlan(committed[len(expired) :], expired, leftovers)
    if dry_run:
        return plan
    gc_tier(backend, keep_last)
    if abort_incomplete:
        backend.cleanup_incomplete("steps/")
        backend.cleanup_incomplete("manifests/")
        for name in backend.incomplete(""):  # format v2: under hashed prefixes <hh>/steps/
            if data_folder_part(name) != name:
                backend.cleanup_incomplete(name)
    return plan


# -- writer leases -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LeaseInfo:
    """One writer lease on a location (``leases/rank-<r>.json``) and whether its owner looks
    alive from here; an unreadable lease object counts as alive (nobody can tell)."""

    rank: int
    record: LeaseRecord | None
    alive: bool
    why: str

    def describe(self) -> str:
        if self.record is None:
            return f"an unreadable lease ({self.why})"
        return f"{self.record.describe()}; {'live' if self.alive else 'dead'}: {self.why}"


def leases(backend: Backend) -> list[LeaseInfo]:
    """The writer leases on ``backend``, by rank."""
    out = []
    for rank, rec, error in list_leases(backend):
        if rec is None:
            out.append(LeaseInfo(rank, None, True, error))
        else:
            alive, why = owner_status(rec)
            out.append(LeaseInfo(rank, rec, alive, why))
    return out


def unlock(backend: Backend, rank: int | None = None) -> list[LeaseInfo]:
    """Remove the writer lease of ``rank`` (every rank's if None) and return what was removed.

    For a writer that died on another machine, so a new job need not wait for the lease's
    ttl. A writer still running loses the location at its next lease check: it stops writing
    and deleting there, and its later saves on that tier fail.
    """
    found = leases(backend)
    if rank is not None:
        found = [info for info in found if info.rank == rank]
    for info in found:
        backend.delete(lease_name(info.rank))
    return found
