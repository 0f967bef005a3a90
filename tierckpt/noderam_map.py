"""Restore from node RAM without a copy: a shard in a :class:`~tierckpt.NodeRamTier` is mapped
copy-on-write, and the loaded tensors are views of the mapping.

A node-RAM shard file is already memory (tmpfs pages). Reading it into fresh tensors, as every
other tier does, is one more copy of every byte: the same work as a read from the page cache,
so a restore from node RAM could be no faster than one from a local disk whose files are
cached. Here the file is mapped ``MAP_PRIVATE`` (``mmap.ACCESS_COPY``) and each storage of the
shard becomes a uint8 tensor over its bytes in the mapping (``torch.frombuffer``); the tensors
are views of those storages at their offsets, as :func:`tierckpt.restore.read_shard` builds
them. A restore then costs the mapping and the checksum of every chunk (read from the mapped
pages, in parallel on the load's reader threads, all verified before the load returns: a
corrupt chunk fails the load, which goes on to the next tier as before).

Copy-on-write: the mapped pages are the tmpfs file's own until written; the first write to a
page (training updating the restored tensors in place) gives the process a private copy of
that page, so the committed segment never changes and its checksums keep verifying.

Only raw chunks are mapped; a shard with any compressed chunk is read as before (None from
:func:`read_shard_mapped`). A storage whose bytes are not one contiguous, 16-byte aligned run
of the file (chunks cut inside it at unaligned places), or that is smaller than
:data:`MAP_MIN_BYTES` (an optimizer's ``step``, a bias's moments, a scaler's scale: kept by
reference after ``load_state_dict``, each would hold the whole segment), is copied out of
the mapping into fresh memory instead; the rest stay mapped.

Memory: a mapped segment holds its tmpfs pages while any tensor of the load is alive, even
after retention deletes the file (tmpfs frees an unlinked file's pages once the last mapping
goes). So the node-RAM budget counts, besides the files, the bytes of every segment this
process still maps whose file is gone (:func:`unlinked_mapped_bytes`); dropping the loaded
state (``load(into=...)`` does at once) releases them.
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import cast

import torch

from tierckpt.arena import total_ram
from tierckpt.backends.base import Backend
from tierckpt.codecs import codec_from_config
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.format import FOOTER_SIZE, ChunkRecord, Manifest, checksum, tree_args
from tierckpt.restore import LoadedShard, as_parameters, read_index
from tierckpt.restore._index import rebuild_tensors
from tierckpt.tree import decode_tree
from tierckpt.verify import corrupt_chunk

__all__ = [
    "MAP_ALIGNMENT",
    "MAP_MIN_BYTES",
    "live_mappings",
    "map_segment",
    "read_shard_mapped",
    "unlinked_mapped_bytes",
]

#: a storage is mapped only where its first byte lies at a multiple of this in the file (the
#: largest itemsize, complex128), so every tensor view is aligned for its dtype
MAP_ALIGNMENT = 16
#: a storage smaller than this is copied out of the mapping, not mapped. A view, however
#: small, keeps the whole segment's tmpfs pages (the mapping holds the file, and an unlinked
#: file's pages go with its last mapping), and small storages are what code keeps by reference
#: after ``load_state_dict``: Adam's 0-d ``step`` tensors (kept as they are), its moments of a
#: bias or a norm's weight (4 KiB at width 1024; the ``exp_avg`` of any tensor of the same
#: dtype is kept as it is), a scaler's scale, counters. One ``step`` and two 4 KiB moments kept
#: a 24 MiB segment after retention deleted it, charged to the node-RAM budget until saves
#: failed. 64 KiB covers the per-channel vectors of models up to width 16Ki in fp32; copying
#: such a storage costs a few microseconds and at most 64 KiB, and they are a tiny share of a
#: state's bytes: what is worth not copying, the large tensors, stays mapped (a segment then
#: stays while one of them is alive: a restored state in use, counted in the budget).
MAP_MIN_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class _Live:
    path: str
    dev: int
    ino: int
    nbytes: int


_lock = threading.Lock()
_live: dict[int, _Live] = {}
_serial = 0


def _release(key: int) -> None:
    with _lock:
        _live.pop(key, None)


def map_segment(path: str, size: int, *, where: str) -> mmap.mmap:
    """A private (copy-on-write) mapping of the committed file ``path`` of ``size`` bytes,
    registered as live until the mapping object is collected (every tensor over it gone)."""
    global _serial
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise CorruptCheckpoint(f"{where}: shard file vanished before it was mapped") from exc
    try:
        st = os.fstat(fd)
        if st.st_size != size:
            raise CorruptCheckpoint(
                f"{where}: file is {st.st_size} bytes, the manifest says {size}"
            )
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)  # the mapping holds the file; unlinking it now changes nothing mapped
    with _lock:
        _serial += 1
        key = _serial
        _live[key] = _Live(os.path.abspath(path), st.st_dev, st.st_ino, st.st_blocks * 512)
    weakref.finalize(mm, _release, key)
    return mm


def live_mappings(roots: Sequence[str]) -> list[tuple[str, int, bool]]:
    """``(path, bytes, unlinked)`` of every segment under ``roots`` this process still maps;
    ``unlinked``: its file is gone (retention), so only the mapping holds its memory."""
    prefixes = tuple(os.path.abspath(r) + os.sep for r in roots)
    with _lock:
        entries = [e for e in _live.values() if e.path.startswith(prefixes)]
    out = []
    for e in entries:
        try:
            st = os.stat(e.path)
            gone = (st.st_dev, st.st_ino) != (e.dev, e.ino)
        except OSError:
            gone = True
        out.append((e.path, e.nbytes, gone))
    return out


def unlinked_mapped_bytes(roots: Sequence[str]) -> int:
    """Bytes of node RAM held only by this process's mappings of deleted segments."""
    return sum(n for _p, n, gone in live_mappings(roots) if gone)


def _span_runs(
    chunks: Sequence[ChunkRecord], starts: Sequence[int], lo: int, hi: int, where: str
) -> list[tuple[int, int, int]]:
    """``(logical start, logical end, file position)`` of the chunks' bytes covering
    ``lo..hi``, in order; ``FormatError`` where a byte of it is in no chunk."""
    out: list[tuple[int, int, int]] = []
    pos = lo
    ci = max(bisect.bisect_right(starts, lo) - 1, 0)
    while pos < hi:
        if ci >= len(chunks) or chunks[ci].logical_offset > pos:
            raise FormatError(f"{where}: data bytes {pos}..{hi} are in no chunk")
        rec = chunks[ci]
        end = min(hi, rec.logical_offset + rec.raw_size)
        if end > pos:
            out.append((pos, end, rec.file_offset + pos - rec.logical_offset))
            pos = end
        ci += 1
    return out


def read_shard_mapped(
    backend: Backend, tier: str, manifest: Manifest, rank: int, pool: ThreadPoolExecutor
) -> LoadedShard | None:
    """Rank ``rank``'s shard of ``manifest`` as tensors over a private mapping of its file
    (see the module docstring), every chunk verified; None where it is not mapped (the
    backend does not map reads: no true ``map_reads`` and ``mapped_path(name)``, as
    :class:`~tierckpt.noderam.NodeRamBackend` has; or a chunk is compressed): read it the
    usual way."""
    if not getattr(backend, "map_reads", False):
        return None
    t0 = time.perf_counter()
    ref = manifest.shard_for(rank)
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    path: str = backend.mapped_path(ref.file)  # type: ignore[attr-defined]
    # one open of the file: the map; the footer and index are read from it (no syscall)
    mm = map_segment(path, ref.size, where=where)
    try:
        index, index_blob, _footer = read_index(
            cast(Backend, _MappedFile(mm, backend.url)), ref, tier
        )
        codecs = [codec_from_config(c) for c in index["codecs"]]
    except BaseException:
        _close(mm)
        raise
    chunks: list[ChunkRecord] = sorted(index["chunks"], key=lambda c: c.logical_offset)
    if not all(codecs[c.codec].is_passthrough for c in chunks):
        _close(mm)
        return None  # compressed chunks decode into fresh memory, as before
    data_end = ref.size - FOOTER_SIZE - len(index_blob)
    for ci, rec in enumerate(index["chunks"]):
        if rec.stored_size != rec.raw_size:
            raise FormatError(
                f"{where}: raw chunk {ci} stores {rec.stored_size} bytes "
                f"but declares {rec.raw_size}"
            )
        if rec.file_offset < 0 or rec.file_offset + rec.stored_size > data_end:
            raise FormatError(f"{where}: chunk {ci} lies outside the file's data")
    data_bytes = int(index["data_bytes"])
    covered = sum(c.raw_size for c in chunks)
    if covered != data_bytes:
        raise FormatError(f"{where}: chunks cover {covered} of {data_bytes} bytes")
    if data_bytes > total_ram():  # storages copied out of the map are allocated
        raise FormatError(
            f"{where}: declares {data_bytes} bytes of tensor data, more than this machine's "
            "memory; refusing it"
        )
    view = memoryview(mm)
    futures = [
        pool.submit(_verify, view, rec, ci, ref.file, tier, where)
        for ci, rec in enumerate(index["chunks"])
    ]
    try:
        starts = [c.logical_offset for c in chunks]
        spans: list[torch.Tensor] = []
        for off, n in index["storages"]:
            off, n = int(off), int(n)
            if off < 0 or n < 0 or off + n > data_bytes:
                raise FormatError(f"{where}: storage {off}..+{n} outside the data")
            spans.append(_span(mm, chunks, starts, off, n, where))
        sizes = [sp.numel() for sp in spans]
        tensors = rebuild_tensors(index["tensors"], spans, sizes, where)
        as_parameters(tensors, index, where)
        state = decode_tree(index.get("tree"), tensors, **tree_args(index))
        for f in futures:
            f.result()  # every checksum holds before the state is handed out
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise
    finally:
        view.release()
    seconds = time.perf_counter() - t0
    return LoadedShard(state, manifest, tier, data_bytes, covered, seconds, [], seconds, False)


class _MappedFile:
    """What :func:`~tierckpt.restore.read_index` reads of a shard file, served from its
    mapping: slices of memory instead of opening the file again for its tail and index."""

    is_remote = False

    def __init__(self, mm: mmap.mmap, url: str) -> None:
        self._mm = mm
        self.url = url

    def read(self, name: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > len(self._mm):
            raise FormatError(f"{self.url}/{name}: read {offset}..+{length} past the end")
        return self._mm[offset : offset + length]

    def read_tail(self, name: str, length: int) -> tuple[int, bytes]:
        size = len(self._mm)
        n = max(0, min(length, size))
        return size, self._mm[size - n : size]


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view still lives: unmapped when collected


def _verify(view: memoryview, rec: ChunkRecord, ci: int, file: str, tier: str, where: str) -> None:
    with view[rec.file_offset : rec.file_offset + rec.stored_size] as piece:
        if checksum(piece) != rec.checksum:
            corrupt_chunk(file, rec, ci, tier=tier, where=where)


def _span(
    mm: mmap.mmap,
    chunks: Sequence[ChunkRecord],
    starts: Sequence[int],
    off: int,
    n: int,
    where: str,
) -> torch.Tensor:
    """Storage bytes ``off..off+n`` of the data: a view of the mapping where they are one
    aligned run of the file of at least ``MAP_MIN_BYTES``, else a fresh copy of them."""
    if n == 0:
        return torch.empty(0, dtype=torch.uint8)
    runs = _span_runs(chunks, starts, off, off + n, where)
    contiguous = all(
        runs[i][2] + runs[i][1] - runs[i][0] == runs[i + 1][2] for i in range(len(runs) - 1)
    )
    if n >= MAP_MIN_BYTES and contiguous and runs[0][2] % MAP_ALIGNMENT == 0:
        return torch.frombuffer(mm, dtype=torch.uint8, count=n, offset=runs[0][2])
    out = torch.empty(n, dtype=torch.uint8)
    for a, b, pos in runs:
        out[a - off : b - off].copy_(
            torch.frombuffer(mm, dtype=torch.uint8, count=b - a, offset=pos)
        )
    return out
