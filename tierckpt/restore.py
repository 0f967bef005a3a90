"""The load path: choose tier and step, read ranges in parallel, verify, decode, rebuild.

For the wanted step, tiers are tried fastest first. Each chunk's stored bytes are checked
against the checksum in the index before decoding; a failure names the tier, file and chunk
and the reader moves on to the next tier holding the same step. Everything is decoded into
fresh buffers and verified before a single byte is copied into the caller's tensors, so a
failed load never leaves ``into=`` half overwritten.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.arena import total_ram
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import (
    BackendError,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    StateMismatch,
    TierCkptError,
    UnknownCodec,
)
from tierckpt.format import (
    FOOTER_SIZE,
    HEAD_PROBE_BYTES,
    MAX_MANIFEST_BYTES,
    ChunkRecord,
    Footer,
    Manifest,
    ShardRef,
    check_index_head,
    checksum,
    decode_index,
    decode_manifest,
    encode_manifest,
    manifest_name,
    tree_args,
)
from tierckpt.limits import MAX_DIMS
from tierckpt.tree import decode_tree, dtype_from_name
from tierckpt.verify import read_verified, read_verified_pieces

__all__ = ["LoadedShard", "read_manifest", "read_shard", "restore_into"]

log = logging.getLogger("tierckpt")
#: errors that make the reader try the next tier (or step)
RECOVERABLE = (CorruptCheckpoint, FormatError, BackendError, CheckpointNotFound, UnknownCodec)


@dataclass
class LoadedShard:
    state: Any
    manifest: Manifest
    tier: str
    raw_bytes: int
    stored_bytes: int
    seconds: float
    #: faster tiers this rank's shard file was copied to while loading (committed files)
    repopulated: list[Backend] = field(default_factory=list)


def read_manifest(backend: Backend, step: int, tier: str, *, timeline: int = 0) -> Manifest:
    """The manifest of ``step`` on ``timeline``, validated; it must say it is that one's."""
    name = manifest_name(step, timeline=timeline)
    where = f"tier {tier!r} {backend.url}/{name}"
    size = backend.size(name)
    if size > MAX_MANIFEST_BYTES:  # before reading it: a hostile manifest may be huge
        raise FormatError(f"{where}: manifest is {size} bytes, more than {MAX_MANIFEST_BYTES}")
    manifest = decode_manifest(backend.get(name), where=where)
    if manifest.step != step:
        raise FormatError(f"{where}: the manifest is step {manifest.step}'s, not step {step}'s")
    if manifest.timeline != timeline:
        raise FormatError(
            f"{where}: the manifest is timeline {manifest.timeline}'s, not timeline {timeline}'s"
        )
    return manifest


def read_index(
    backend: Backend, ref: ShardRef, tier: str
) -> tuple[dict[str, Any], bytes | bytearray, bytes]:
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    size = backend.size(ref.file)
    if size != ref.size:
        raise CorruptCheckpoint(
            f"{where}: file is {size} bytes, the manifest says {ref.size} (truncated or replaced)"
        )
    footer_bytes = bytes(backend.read(ref.file, size - FOOTER_SIZE, FOOTER_SIZE))
    footer = Footer.decode(footer_bytes, file_size=size, where=where)
    if footer.index_checksum != ref.index_checksum:
        raise CorruptCheckpoint(f"{where}: index checksum differs from the manifest's")
    if footer.index_length > HEAD_PROBE_BYTES:  # a large index: its counts first
        head = backend.read(ref.file, footer.index_offset, 512)
        check_index_head(head, index_length=footer.index_length, file_size=size, where=where)
    blob = backend.read(ref.file, footer.index_offset, footer.index_length)
    if not isinstance(blob, (bytes, bytearray)):
        blob = bytes(blob)
    if checksum(blob) != footer.index_checksum:
        raise CorruptCheckpoint(f"{where}: index bytes do not match their checksum")
    return decode_index(blob, file_size=size, where=where), blob, footer_bytes


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One validated entry of an index's tensor table."""

    storage: int  # -1: no elements, no storage
    offset: int  # bytes into the storage span
    dtype: torch.dtype
    shape: list[int]
    stride: list[int]
    extent: int  # bytes from ``offset`` to the end of the last element (0 if empty)


def parse_tensor_entry(
    entry: Any, i: int, where: str, storage_sizes: Sequence[int]
) -> TensorRecord:
    """Validate tensor ``i``'s record against the storage table; ``FormatError`` if hostile."""
    if not isinstance(entry, list) or len(entry) != 6:
        raise FormatError(f"{where}: tensor {i} record malformed")
    sid, off, dtype_s, shape, stride, _device = entry
    dtype = dtype_from_name(dtype_s)
    if (
        not isinstance(shape, list)
        or not isinstance(stride, list)
        or len(shape) != len(stride)
        or len(shape) > MAX_DIMS
        or not all(type(v) is int and 0 <= v < 1 << 48 for v in shape + stride)
    ):
        raise FormatError(f"{where}: tensor {i} has a malformed shape/stride")
    numel = math.prod(shape)
    if numel >= 1 << 62:  # zero strides can declare more elements than torch can count
        raise FormatError(f"{where}: tensor {i} declares {numel} elements")
    if sid == -1:
        if numel != 0:
            raise FormatError(f"{where}: tensor {i} has elements but no storage")
        return TensorRecord(-1, 0, dtype, shape, stride, 0)
    if type(sid) is not int or not 0 <= sid < len(storage_sizes) or type(off) is not int or off < 0:
        raise FormatError(f"{where}: tensor {i} points outside the storage table")
    item = torch.empty((), dtype=dtype).element_size()
    extent = (sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) + 1) * item
    if numel == 0 or off % item or off + extent > storage_sizes[sid]:
        raise FormatError(f"{where}: tensor {i} does not fit its storage")
    return TensorRecord(sid, off, dtype, shape, stride, extent)


def as_parameters(tensors: list[torch.Tensor], table: object, where: str) -> None:
    """Make the tensors the index lists as ``nn.Parameter`` again, with their
    ``requires_grad`` (the index field ``parameters``: ``2 * tensor + requires_grad`` per
    parameter, as :func:`tierckpt.plan.collect_state` records them), so a load gives back
    what ``torch.load`` gives back. An index without the field holds no parameters."""
    if table is None:
        return
    if not isinstance(table, list) or len(table) > len(tensors):
        raise FormatError(f"{where}: index field 'parameters' malformed")
    seen: set[int] = set()
    for v in table:
        if type(v) is not int or not 0 <= v < 2 * len(tensors) or v // 2 in seen:
            raise FormatError(f"{where}: index field 'parameters' names no tensor ({v!r})")
        i, grad = divmod(v, 2)
        seen.add(i)
        t = tensors[i]
        if grad and not (t.is_floating_point() or t.is_complex()):
            raise FormatError(
                f"{where}: index field 'parameters': tensor {i} of {t.dtype} cannot require grad"
            )
        tensors[i] = torch.nn.Parameter(t, requires_grad=bool(grad))


def _rebuild_tensor(
    entry: Any, spans: list[torch.Tensor], sizes: Sequence[int], i: int, where: str
) -> torch.Tensor:
    rec = parse_tensor_entry(entry, i, where, sizes)
    if rec.storage == -1:
        return torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype)
    item = torch.empty((), dtype=rec.dtype).element_size()
    t = torch.empty(0, dtype=rec.dtype)
    t.set_(spans[rec.storage].untyped_storage(), rec.offset // item, rec.shape, rec.stride)
    return t


def read_shard(
    backend: Backend,
    tier: str,
    manifest: Manifest,
    rank: int,
    pool: ThreadPoolExecutor,
    *,
    repopulate: Sequence[Backend] = (),
    publish: bool = True,
) -> LoadedShard:
    """Read, verify and decode one rank's shard from one tier.

    ``repopulate``: also copy the shard file to these tiers; ``publish``: and write the
    manifest there (False where the caller commits the copies: a Checkpointer's commit
    strategy, which with several ranks waits for every rank's file)."""
    t0 = time.perf_counter()
    ref = manifest.shard_for(rank)
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    index, index_blob, footer_blob = read_index(backend, ref, tier)
    codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
    data_bytes = int(index["data_bytes"])
    if data_bytes > total_ram():
        raise FormatError(
            f"{where}: declares {data_bytes} bytes of tensor data, more than this machine's "
            "memory; refusing to allocate it"
        )
    for ci, rec in enumerate(index["chunks"]):
        if codecs[rec.codec].is_passthrough and rec.stored_size != rec.raw_size:
            raise FormatError(
                f"{where}: raw chunk {ci} stores {rec.stored_size} bytes "
                f"but declares {rec.raw_size}"
            )
    spans = [torch.empty(int(n), dtype=torch.uint8) for _off, n in index["storages"]]
    span_offsets = [int(s[0]) for s in index["storages"]]
    chunks: list[ChunkRecord] = index["chunks"]
    repop = _Repopulation(repopulate, ref.file)
    layout = _SpanLayout(span_offsets, [sp.numel() for sp in spans])
    # a local file is read straight into the storages (one preadv per chunk); from a remote
    # store one ranged read per chunk beats one per tensor, so its bytes land in a buffer
    scatter = not backend.is_remote
    # buffers of one thread, reused from chunk to chunk: a fresh buffer per chunk would pay
    # the first touch of new pages every time (peak extra memory: a chunk or two per thread)
    scratch = _ThreadBuffers()

    def one(ci: int) -> int:
        rec = chunks[ci]
        codec = codecs[rec.codec]
        lo, hi = rec.logical_offset, rec.logical_offset + rec.raw_size
        parts = layout.parts(lo, hi)
        if parts is not None and len(parts) == 1 and parts[0][0] >= 0:
            # inside one span: read (raw) or decode straight into it
            si, a, b = parts[0]
            dest_view = _view(spans[si], a - span_offsets[si], b - span_offsets[si])
            stored = dest_view if codec.is_passthrough else scratch.get("stored", rec.stored_size)
            read_verified(backend, ref.file, rec, ci, stored, tier=tier, where=where)
            repop.write(rec.file_offset, stored)
            if stored is not dest_view:
                _decode(codec, stored, dest_view, ci, tier, where, ref.file)
            return rec.stored_size
        if parts is not None and codec.is_passthrough and scatter:
            # across spans, raw: scatter the read into every storage it touches
            views = [
                _view(spans[si], a - span_offsets[si], b - span_offsets[si])
                if si >= 0
                else scratch.get("gap", b - a)  # bytes no storage holds: read, checked, dropped
                for si, a, b in parts
            ]
            read_verified_pieces(backend, ref.file, rec, ci, views, tier=tier, where=where)
            pos = rec.file_offset
            for v in views:
                repop.write(pos, v)
                pos += len(v)
            return rec.stored_size
        # across spans via this thread's (warm) buffer, then one copy into each storage
        whole = scratch.get("decoded", rec.raw_size)
        stored = whole if codec.is_passthrough else scratch.get("stored", rec.stored_size)
        read_verified(backend, ref.file, rec, ci, stored, tier=tier, where=where)
        repop.write(rec.file_offset, stored)
        if stored is not whole:
            _decode(codec, stored, whole, ci, tier, where, ref.file)
        src = torch.frombuffer(whole, dtype=torch.uint8) if len(whole) else None
        for si, a, b in parts if parts is not None else layout.overlaps(lo, hi):
            if si >= 0 and src is not None:
                off = span_offsets[si]
                spans[si][a - off : b - off].copy_(src[a - lo : b - lo])
        return rec.stored_size

    try:
        stored_total = sum(pool.map(one, range(len(chunks))))
        # cover every span byte: the chunks must tile the data stream
        covered = sum(c.raw_size for c in chunks)
        if covered != int(index["data_bytes"]):
            raise FormatError(f"{where}: chunks cover {covered} of {index['data_bytes']} bytes")
        sizes = [sp.numel() for sp in spans]
        tensors = [
            _rebuild_tensor(e, spans, sizes, i, where) for i, e in enumerate(index["tensors"])
        ]
        as_parameters(tensors, index.get("parameters"), where)
        state = decode_tree(index.get("tree"), tensors, **tree_args(index))
    except BaseException:
        repop.abort()
        raise
    copied = repop.finish(
        ref.size - FOOTER_SIZE - len(index_blob),
        index_blob + footer_blob,
        manifest if publish else None,
    )
    return LoadedShard(
        state,
        manifest,
        tier,
        int(index["data_bytes"]),
        stored_total,
        time.perf_counter() - t0,
        copied,
    )


def _view(span: torch.Tensor, a: int, b: int) -> memoryview:
    """Bytes ``a..b`` of a uint8 storage span, as a writable memoryview."""
    return memoryview(span[a:b].numpy())  # type: ignore[arg-type]


def _decode(
    codec: Codec, stored: memoryview, out: memoryview, ci: int, tier: str, where: str, file: str
) -> None:
    try:
        codec.decode(stored, out)
    except CorruptChunk as exc:
        raise CorruptChunk(f"{where}: chunk {ci}: {exc}", tier=tier, file=file, chunk=ci) from exc


class _ThreadBuffers:
    """Per-thread byte buffers, grown on demand and reused (warm pages, no allocation)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, kind: str, n: int) -> memoryview:
        bufs: dict[str, torch.Tensor] | None = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        buf = bufs.get(kind)
        if buf is None or buf.numel() < n:
            buf = bufs[kind] = torch.empty(n, dtype=torch.uint8)
        return memoryview(buf.numpy())[:n]  # type: ignore[arg-type]


class _SpanLayout:
    """Where a range of the data stream lands: which storage spans, which gaps."""

    def __init__(self, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        self.offsets = list(offsets)
        self.sizes = list(sizes)
        # spans in order without overlap (what every writer produces); anything else takes
        # the slow path below, which copies each span's share wherever it is
        self.tiled = all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(offsets) - 1))

    def parts(self, lo: int, hi: int) -> list[tuple[int, int, int]] | None:
        """``(span or -1 for a gap, start, end)`` covering ``lo..hi`` in order; None where
        the spans are not tiled."""
        if not self.tiled:
            return None
        offs, sizes = self.offsets, self.sizes
        out: list[tuple[int, int, int]] = []
        si = max(bisect.bisect_right(offs, lo) - 1, 0)
        pos = lo
        while pos < hi:
            if si < len(offs) and offs[si] + sizes[si] <= pos:
                si += 1
                continue
            if si >= len(offs) or offs[si] > pos:
                end = hi if si >= len(offs) else min(hi, offs[si])
                out.append((-1, pos, end))
            else:
                end = min(hi, offs[si] + sizes[si])
                out.append((si, pos, end))
            pos = end
        return out

    def overlaps(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """Every span's share of ``lo..hi``, in span order (any layout)."""
        out = []
        for si, (off, n) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((si, a, b))
        return out


class _Repopulation:
    """Copies of a shard being read, written to faster tiers so the next restart is local.

    Best effort: a tier that fails (disk full, permissions) is dropped with a warning and the
    load goes on — a full local disk must never stop a restore from S3.
    """

    def __init__(self, backends: Sequence[Backend], name: str) -> None:
        self._writers: list[tuple[Backend, ObjectWriter]] = []
        self._failed: set[int] = set()
        for b in backends:
            try:
                self._writers.append((b, b.open_writer(name)))
            except (OSError, TierCkptError) as exc:
                log.warning("not repopulating %s/%s: %s", b.url, name, exc)

    def _drop(self, i: int, exc: BaseException) -> None:
        if i not in self._failed:
            self._failed.add(i)
            b, w = self._writers[i]
            log.warning("repopulating %s/%s failed; the load goes on: %s", b.url, w.name, exc)

    def write(self, offset: int, data: Any) -> None:
        for i, (_b, w) in enumerate(self._writers):
            if i not in self._failed:
                try:
                    w.write(offset, data)
                except (OSError, TierCkptError) as exc:
                    self._drop(i, exc)

    def finish(
        self, offset: int, tail: bytes | bytearray, manifest: Manifest | None
    ) -> list[Backend]:
        """Write index + footer and commit on every healthy tier, then the manifest (last)
        unless ``manifest`` is None (the caller publishes it: see
        ``tierckpt.commit.CommitStrategy.publish_repopulated``). Returns the tiers whose
        shard file is now committed."""
        done = []
        for i, (b, w) in enumerate(self._writers):
            if i in self._failed:
                w.abort()
                continue
            try:
                w.write(offset, tail)
                w.commit()
                done.append(b)
                if manifest is not None:
                    b.put_atomic(
                        manifest_name(manifest.step, timeline=manifest.timeline),
                        encode_manifest(manifest),
                    )
            except FileExistsError:
                pass
            except (OSError, TierCkptError) as exc:
                w.abort()
                self._drop(i, exc)
        return done

    def abort(self) -> None:
        for _b, w in self._writers:
            w.abort()


def restore_into(target: Any, loaded: Any, path: str = "<root>", *, strict: bool = True) -> Any:
    """Copy ``loaded`` into ``target`` in place (tensors keep their storage); returns target.

    Everything is checked before a byte is copied. ``strict=True``: the dicts must have the
    same keys (:class:`StateMismatch` otherwise). ``strict=False`` (``load_state_dict``'s
    and torchsnapshot's partial restore): only the keys both sides hold are restored; the
    others are left as they are and logged. Shapes must match either way. A tensor loads into
    a tensor of another floating-point dtype by casting (``copy_``, as ``load_state_dict``
    does: float32 into bfloat16 rounds); any other dtype difference is refused."""
    skipped: list[str] = []
    _check_into(target, loaded, path, strict, skipped)
    if skipped:
        log.info(
            "load(strict=False): %d keys not restored (in only one side): %s",
            len(skipped),
            ", ".join(skipped[:10]) + (", ..." if len(skipped) > 10 else ""),
        )
    return _copy_into(target, loaded)


def _castable(a: torch.dtype, b: torch.dtype) -> bool:
    return a == b or (a.is_floating_point and b.is_floating_point)


def _check_into(target: Any, loaded: Any, path: str, strict: bool, skipped: list[str]) -> None:
    if isinstance(target, torch.Tensor):
        if not isinstance(loaded, torch.Tensor):
            raise StateMismatch(
                f"{path}: the checkpoint holds a {type(loaded).__name__}, the target a tensor"
            )
        if target.shape != loaded.shape or not _castable(target.dtype, loaded.dtype):
            raise StateMismatch(
                f"{path}: checkpoint has {loaded.dtype} {tuple(loaded.shape)}, target has "
                f"{target.dtype} {tuple(target.shape)}"
                + (
                    "; a tensor loads into another dtype only between floating-point dtypes"
                    if target.shape == loaded.shape
                    else ""
                )
            )
        return
    if isinstance(target, dict):
        if not isinstance(loaded, dict):
            raise StateMismatch(f"{path}: target is a dict, checkpoint a {type(loaded).__name__}")
        missing = [k for k in target if k not in loaded]
        extra = [k for k in loaded if k not in target]
        if (missing or extra) and strict:
            raise StateMismatch(
                f"{path}: keys differ — missing from checkpoint: {missing[:10]}, "
                f"not in target: {extra[:10]} (load(..., strict=False) restores the keys both "
                "hold)"
            )
        skipped.extend(f"{path}[{k!r}]" for k in missing + extra)
        for k in target:
            if k in loaded:
                _check_into(target[k], loaded[k], f"{path}[{k!r}]", strict, skipped)
        return
    if isinstance(target, (list, tuple)):
        if not isinstance(loaded, (list, tuple)) or len(loaded) != len(target):
            raise StateMismatch(f"{path}: sequence length or type differs")
        for i, (a, b) in enumerate(zip(target, loaded, strict=True)):
            _check_into(a, b, f"{path}[{i}]", strict, skipped)


def _copy_into(target: Any, loaded: Any) -> Any:
    if isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(loaded)
        return target
    if isinstance(target, dict):
        for k in target:
            if k not in loaded:
                continue  # strict=False: a key the checkpoint does not hold stays as it is
            new = _copy_into(target[k], loaded[k])
            if new is not target[k]:
                target[k] = new
        return target
    if isinstance(target, list):
        for i in range(len(target)):
            new = _copy_into(target[i], loaded[i])
            if new is not target[i]:
                target[i] = new
        return target
    if isinstance(target, tuple):
        for a, b in zip(target, loaded, strict=True):
            _copy_into(a, b)
        return target
    return loaded


def is_recoverable(exc: BaseException) -> bool:
    return isinstance(exc, RECOVERABLE) or (
        isinstance(exc, TierCkptError) and not isinstance(exc, StateMismatch)
    )
