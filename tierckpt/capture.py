"""Lazy device-to-host capture of one chunk into an arena slot.

On CUDA the copies run on a dedicated side stream that first waits for an event recorded on
the training stream at ``save()`` time, so they are ordered after the work already queued and
overlap the next forward/backward pass. Chunks made of many small tensors are first gathered
into a reusable device staging buffer of one chunk (one kernel), then copied to the pinned
slot in one transfer. On CPU the capture thread copies host bytes itself (:func:`host_copy`),
with streaming stores where :mod:`tierckpt._native` could build them, else ``memmove``: no
tensor views per piece, no OpenMP team of its own competing with the training thread's, and
the GIL held only for small pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import xxhash

from tierckpt import _native
from tierckpt import devices as cuda_api
from tierckpt.errors import UnsupportedObject
from tierckpt.plan import ChunkPlan, ShardLayout

__all__ = ["CaptureStreams", "ChunkHash", "compress_chunk", "copy_chunk", "host_copy"]

#: a chunk with more pieces than this, all on one CUDA device, is gathered on the device first
GATHER_MIN_PIECES = 8

#: host pieces from this size on are copied with the GIL released; smaller ones keep it: a
#: few microseconds of copying, where releasing it would let another Python thread (training)
#: take it and hold it for up to the interpreter's switch interval (5 ms) before the next piece
RELEASE_GIL_BYTES = 256 << 10

#: a host chunk of at least this many bytes is split among the copy team's threads
SPLIT_MIN_BYTES = 4 << 20

#: a host chunk hashed as it is copied (:class:`ChunkHash`) is copied in blocks of this size,
#: each block's source hashed and copied one right after the other, while its bytes are in
#: the core's cache: copy 64 MiB then hash it costs ~17 ms of CPU here, copy and hash by
#: 128-512 KiB blocks ~12 (the separate hash reads the whole chunk back from memory)
HASH_BLOCK_BYTES = 512 << 10

_VOIDP_SIG = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
#: libc's memmove (non-temporal stores for large copies): ~1.6x torch's own CPU copy kernel
#: here. ``ctypes.memmove`` releases the GIL; the PyDLL binding of the same symbol keeps it
_memmove_nogil: Any = ctypes.memmove
_memmove_gil: Any
try:
    _memmove_gil = ctypes.PyDLL(None).memmove
    _memmove_gil.argtypes = _VOIDP_SIG
    _memmove_gil.restype = ctypes.c_void_p
except (OSError, AttributeError, TypeError):  # no C library symbols in the process (Windows)
    _memmove_gil = ctypes.memmove


class CopyRunner(Protocol):
    """Runs parts of one chunk's host copy at once (``pipeline._copyteam.CopyTeam``)."""

    threads: int

    def run(self, parts: Sequence[Callable[[], None]]) -> None: ...


class ChunkHash:
    """The xxh3-64 of a host chunk (:func:`tierckpt.format.checksum` of its bytes), computed
    while :func:`copy_chunk` copies it: every block is hashed in order, from its source, right
    before (or, a helper thread's block, right after) it is copied. The digest is the plain
    xxh3-64 of the chunk (a streaming hash over its blocks equals the one-shot hash), so
    nothing in the format changes.

    The source, not the copy, is hashed so that the copy can use streaming stores
    (:mod:`tierckpt._native`), which leave the copy out of the cache: hashing the source
    brings it into the cache, and the copy then reads it from there. The two are the same
    bytes: the state does not change while it is captured (what forward writes is copied at
    ``save()``). Were a source written anyway between its hash and its copy, the chunk would
    be stored with a checksum that does not match it, and every read of it fails
    (:class:`~tierckpt.errors.CorruptChunk`): loudly, never silently loading other bytes.

    ``stop`` (set when someone waits for the capture) ends the hashing at the next block:
    a blocking save must not wait for checksums; the chunk is then hashed later, as before,
    and :attr:`digest` stays None."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self._stop = stop
        self._h: Any = xxhash.xxh3_64()
        self._on = True
        #: 16 hex digits once the whole chunk was hashed; None if hashing stopped
        self.digest: str | None = None

    @property
    def on(self) -> bool:
        if self._on and self._stop is not None and self._stop.is_set():
            self._on = False
        return self._on

    def update(self, block: memoryview) -> None:
        if self.on:
            self._h.update(block)

    def abandon(self) -> None:
        """Stop hashing: :attr:`digest` stays None."""
        self._on = False

    def finish(self) -> None:
        if self.on:
            self.digest = self._h.hexdigest()
        self._on = False


@dataclass
class CaptureStreams:
    """Per-device side streams and staging buffers, created on first use and reused."""

    streams: dict[torch.device, Any] = field(default_factory=dict)
    staging: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, device: torch.device) -> Any:
        """The capture stream of ``device``: one per device, never the default stream."""
        with self.lock:
            s = self.streams.get(device)
            if s is None:
                cuda_api.use_device(device)
                s = cuda_api.new_stream(device)
                self.streams[device] = s
            return s

    @contextlib.contextmanager
    def ordered_after(self, ready: dict[torch.device, Any]) -> Iterator[None]:
        """Run the block on the capture streams of ``ready``'s devices, each first waiting for
        its ``save()``-time event: work the capture thread queues there (``resolve_conj`` /
        ``resolve_neg`` while laying the plan out) is ordered after the training stream's
        work at ``save()`` and before the copies, which run on the same stream."""
        streams = []
        for dev, ev in ready.items():
            s = self.stream(dev)
            s.wait_event(ev)
            streams.append(s)
        with cuda_api.on_streams(streams):
            yield

    def staging_buffer(self, device: torch.device, nbytes: int) -> torch.Tensor:
        buf = self.staging.get(device)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.staging[device] = buf
        return buf


def record_ready_events(devices: ShardLayout | set[str]) -> dict[torch.device, Any]:
    """At ``save()`` time: an event on each CUDA device's current stream (ordering point)."""
    events: dict[torch.device, Any] = {}
    for dev in devices.devices if isinstance(devices, ShardLayout) else devices:
        d = torch.device(dev)
        if d.type == "cuda":
            ev = cuda_api.blocking_event()
            ev.record(torch.cuda.current_stream(d))
            events[d] = ev
    return events


def copy_chunk(
    plan: ShardLayout,
    chunk: ChunkPlan,
    slot: torch.Tensor,
    streams: CaptureStreams,
    ready: dict[torch.device, Any],
    team: CopyRunner | None = None,
    hasher: ChunkHash | None = None,
) -> Any:
    """Copy ``chunk``'s bytes into ``slot``; returns a CUDA event to wait on, or None.

    A host chunk of :data:`SPLIT_MIN_BYTES` or more is cut in ``team.threads`` byte ranges
    of about equal size, copied at once by ``team``'s threads. With ``hasher``, a host chunk
    is hashed as it is copied (:func:`_copy_hashed`); a chunk with device pieces ignores it."""
    dst = slot[: chunk.raw_size]
    sources = [plan.sources[p.span] for p in chunk.pieces]
    cuda_devs = {s.device for s in sources if s.is_cuda}
    if not cuda_devs:
        base = _host_base(dst, chunk.raw_size)
        copies = [
            (base + p.dst_offset, src, p.src_offset, p.length)
            for p, src in zip(chunk.pieces, sources, strict=True)
        ]
        split = team is not None and team.threads > 1 and chunk.raw_size >= SPLIT_MIN_BYTES
        if hasher is not None:
            _copy_hashed(copies, chunk.raw_size, hasher, team if split else None)
        elif split:
            assert team is not None
            team.run(_split(copies, chunk.raw_size, team.threads))
        else:
            _copy_all(copies)
        return None
    event = None
    events = []
    for dev in sorted(cuda_devs, key=lambda d: d.index or 0):
        cuda_api.use_device(dev)
        stream = streams.stream(dev)
        with cuda_api.on_streams([stream]):
            if dev in ready:
                stream.wait_event(ready[dev])
            pieces = [(p, s) for p, s in zip(chunk.pieces, sources, strict=True) if s.device == dev]
            for _, s in pieces:
                s.record_stream(stream)
            contiguous_run = all(
                a[0].dst_offset + a[0].length == b[0].dst_offset
                for a, b in itertools.pairwise(pieces)
            )
            if len(pieces) > GATHER_MIN_PIECES and contiguous_run:
                lo = pieces[0][0].dst_offset
                total = sum(p.length for p, _ in pieces)
                staging = streams.staging_buffer(dev, total)[:total]
                torch.cat(
                    [s[p.src_offset : p.src_offset + p.length] for p, s in pieces], out=staging
                )
                dst[lo : lo + total].copy_(staging, non_blocking=True)
            else:
                for p, s in pieces:
                    dst[p.dst_offset : p.dst_offset + p.length].copy_(
                        s[p.src_offset : p.src_offset + p.length], non_blocking=True
                    )
            event = cuda_api.blocking_event()
            event.record(stream)
            events.append(event)
    # host-side pieces of a mixed chunk
    base = _host_base(dst, chunk.raw_size)
    for p, src in zip(chunk.pieces, sources, strict=True):
        if not src.is_cuda:
            host_copy(base + p.dst_offset, src, p.src_offset, p.length)
    if len(events) > 1:  # several devices: wait for all of them before handing over
        for ev in events:
            ev.synchronize()  # blocking events: the thread sleeps, no core spins
        return None
    return event


_Copy = tuple[int, torch.Tensor, int, int]  # (destination address, source span, offset, length)


def _copy_all(copies: Sequence[_Copy]) -> None:
    for dst_addr, src, offset, length in copies:
        host_copy(dst_addr, src, offset, length)


def _split(copies: Sequence[_Copy], total: int, n: int) -> list[Callable[[], None]]:
    """``copies`` (consecutive in the destination, ``total`` bytes) cut into ``n`` parts of
    about ``total / n`` bytes each, a copy that crosses a cut split in two."""
    quota = -(-total // n)
    parts: list[list[_Copy]] = [[]]
    room = quota
    for dst_addr, src, offset, length in copies:
        while length > 0:
            if room == 0 and len(parts) < n:
                parts.append([])
                room = quota
            take = length if len(parts) == n else min(length, room)
            parts[-1].append((dst_addr, src, offset, take))
            dst_addr, offset, length, room = (
                dst_addr + take,
                offset + take,
                length - take,
                room - take,
            )
    return [functools.partial(_copy_all, part) for part in parts if part]


def _blocks(copies: Sequence[_Copy], total: int, size: int) -> list[list[_Copy]]:
    """``copies`` (consecutive in the destination, ``total`` bytes from its start) cut at
    every multiple of ``size`` bytes: block ``k`` copies destination bytes
    ``[k * size, min((k + 1) * size, total))``."""
    blocks: list[list[_Copy]] = [[] for _ in range(-(-total // size))]
    if not copies:
        return blocks
    start = copies[0][0]  # the destination's base: the first copy lands at offset 0
    for dst_addr, src, offset, length in copies:
        while length > 0:
            k = (dst_addr - start) // size
            take = min(length, (k + 1) * size - (dst_addr - start))
            blocks[k].append((dst_addr, src, offset, take))
            dst_addr, offset, length = dst_addr + take, offset + take, length - take
    return blocks


def _hash_block(block: Sequence[_Copy], hasher: ChunkHash, copy: bool) -> None:
    """Hash the source bytes of ``block`` in order; with ``copy``, copy each piece right after
    it is hashed (it is then read from the cache)."""
    for dst_addr, src, offset, length in block:
        if length <= 0:
            continue
        addr = _source_addr(src, offset, length)
        if hasher.on:  # (the span is a uint8 host tensor: its numpy view shares its bytes)
            hasher.update(memoryview(src.numpy())[offset : offset + length])  # type: ignore[arg-type]
        if copy:
            _copy_bytes(dst_addr, addr, length)


def _copy_hashed(
    copies: Sequence[_Copy],
    total: int,
    hasher: ChunkHash,
    team: CopyRunner | None,
) -> None:
    """Copy ``copies`` (``total`` bytes) in blocks of :data:`HASH_BLOCK_BYTES`, and hash
    every block's source in order right before it is copied (:class:`ChunkHash`).

    With ``team``, thread ``t`` of ``n`` copies blocks ``t, t + n, ...`` in order and says
    so on its queue; this thread hashes and copies its own blocks and hashes every block in
    order, taking a helper's block as soon as the helper says it is copied (its source still
    in a cache)."""
    blocks = _blocks(copies, total, HASH_BLOCK_BYTES)
    n = 1 if team is None else max(1, min(team.threads, len(blocks)))
    if n == 1:
        for block in blocks:
            _hash_block(block, hasher, copy=True)
        hasher.finish()
        return
    assert team is not None
    done: list[queue.SimpleQueue[int]] = [queue.SimpleQueue() for _ in range(n)]

    def helper(t: int) -> None:
        k = -1
        try:
            for k in range(t, len(blocks), n):
                _copy_all(blocks[k])
                done[t].put(k)
        finally:
            done[t].put(-1)  # the end, or a failure: the hashing thread must not wait on

    def lead() -> None:
        for k, block in enumerate(blocks):
            t = k % n
            if t == 0:
                _hash_block(block, hasher, copy=True)
                continue
            if not hasher.on:
                continue  # hashing stopped (someone waits): the helpers copy the rest
            if done[t].get() != k:
                hasher.abandon()  # a helper failed: stop hashing (team.run raises its error)
                continue
            _hash_block(block, hasher, copy=False)
        hasher.finish()

    team.run([lead] + [functools.partial(helper, t) for t in range(1, n)])


def _host_base(dst: torch.Tensor, nbytes: int) -> int:
    """The address of ``dst``, a contiguous host byte buffer of at least ``nbytes``."""
    if dst.device.type != "cpu" or dst.dtype != torch.uint8 or not dst.is_contiguous():
        raise ValueError("a chunk is copied into a contiguous host uint8 slot")
    if dst.numel() < nbytes:
        raise ValueError(f"arena slot of {dst.numel()} bytes is smaller than the chunk ({nbytes})")
    return int(dst.data_ptr())


def host_copy(dst_addr: int, src: torch.Tensor, src_offset: int, length: int) -> None:
    """Copy ``length`` bytes of ``src`` (a host uint8 span, as in ``ShardLayout.sources``)
    from ``src_offset`` to the address ``dst_addr`` (inside an arena slot).

    Reads are checked against the storage as it is now, not as it was at ``save()``: a
    storage freed or shrunk since (``untyped_storage().resize_(0)``) is refused with a clear
    error instead of read out of bounds.
    """
    if length > 0:
        _copy_bytes(dst_addr, _source_addr(src, src_offset, length), length)


def _source_addr(src: torch.Tensor, src_offset: int, length: int) -> int:
    """The address of byte ``src_offset`` of ``src``, once ``length`` bytes from there are
    known to lie inside its storage as it is now."""
    storage_end = src.untyped_storage().nbytes()
    start = src.storage_offset() + src_offset
    if src_offset < 0 or src_offset + length > src.numel() or start + length > storage_end:
        raise UnsupportedObject(
            f"a tensor's storage holds {storage_end} bytes but the checkpoint needs bytes "
            f"{start}..{start + length} of it: it was freed or resized after save() (e.g. an "
            "FSDP parameter outside forward); keep the state's storages until wait_captured()"
        )
    return int(src.data_ptr()) + src_offset


def _copy_bytes(dst_addr: int, src_addr: int, length: int) -> None:
    """Copy with streaming stores (:mod:`tierckpt._native`) once they are ready, else
    ``memmove``; the GIL is released from :data:`RELEASE_GIL_BYTES` on."""
    if length >= RELEASE_GIL_BYTES:
        (_native.copier() or _memmove_nogil)(dst_addr, src_addr, length)
    else:
        (_native.copier(gil=True) or _memmove_gil)(dst_addr, src_addr, length)


def _device_compressible(device: torch.device) -> bool:
    """Whether a chunk on ``device`` is compressed there (tests widen this to the CPU)."""
    return device.type == "cuda"


def compress_chunk(
    plan: ShardLayout,
    chunk: ChunkPlan,
    slot: torch.Tensor,
    streams: CaptureStreams,
    ready: dict[torch.device, Any],
    codec: Any,
) -> tuple[int, Any] | None:
    """Compress ``chunk`` on its device, then copy only the stored bytes into ``slot``.

    On the capture stream of the chunk's device: gather its pieces into the device staging
    buffer (after the save point), encode with ``codec`` (an nvCOMP codec: byte planes split
    on the device, pieces compressed in RAW mode, so the CPU decodes the result), and queue
    one non-blocking copy of the stored chunk into the pinned slot. Returns (stored size, the
    event to wait on), or None when the chunk is not on one device that compresses, or the
    stored chunk would be no smaller than the raw one (the caller then copies raw bytes).
    """
    sources = [plan.sources[p.span] for p in chunk.pieces]
    devs = {s.device for s in sources}
    if len(devs) != 1:
        return None
    (dev,) = devs
    if not _device_compressible(dev):
        return None
    cuda = dev.type == "cuda"
    cuda_api.use_device(dev)
    stream = streams.stream(dev) if cuda else None
    with cuda_api.on_streams([stream] if stream is not None else []):
        if stream is not None:
            if dev in ready:
                stream.wait_event(ready[dev])
            for s in sources:
                s.record_stream(stream)
        staging = streams.staging_buffer(dev, chunk.raw_size)[: chunk.raw_size]
        for p, s in zip(chunk.pieces, sources, strict=True):
            staging[p.dst_offset : p.dst_offset + p.length].copy_(
                s[p.src_offset : p.src_offset + p.length], non_blocking=True
            )
        stored = codec.encode_device(staging)
        n = int(stored.numel())
        if n >= chunk.raw_size or n > slot.numel():
            return None
        slot[:n].copy_(stored, non_blocking=True)
        event = cuda_api.blocking_event()
        event.record(stream)
    return n, event
