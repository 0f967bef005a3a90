"""Lazy device-to-host capture of one chunk into an arena slot.

On CUDA the copies run on a dedicated side stream that first waits for an event recorded on
the training stream at ``save()`` time, so they are ordered after the work already queued and
overlap the next forward/backward pass. Chunks made of many small tensors are first gathered
into a reusable device staging buffer of one chunk (one kernel), then copied to the pinned
slot in one transfer. On CPU the capture thread copies with ``Tensor.copy_``, which releases
the GIL.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt import devices as cuda_api
from tierckpt.plan import ChunkPlan, ShardLayout

__all__ = ["CaptureStreams", "compress_chunk", "copy_chunk"]

#: a chunk with more pieces than this, all on one CUDA device, is gathered on the device first
GATHER_MIN_PIECES = 8


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
) -> Any:
    """Copy ``chunk``'s bytes into ``slot``; returns a CUDA event to wait on, or None."""
    dst = slot[: chunk.raw_size]
    sources = [plan.sources[p.span] for p in chunk.pieces]
    cuda_devs = {s.device for s in sources if s.is_cuda}
    if not cuda_devs:
        for p, src in zip(chunk.pieces, sources, strict=True):
            dst[p.dst_offset : p.dst_offset + p.length].copy_(
                src[p.src_offset : p.src_offset + p.length]
            )
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
    for p, src in zip(chunk.pieces, sources, strict=True):
        if not src.is_cuda:
            dst[p.dst_offset : p.dst_offset + p.length].copy_(
                src[p.src_offset : p.src_offset + p.length]
            )
    if len(events) > 1:  # several devices: wait for all of them before handing over
        for ev in events:
            ev.synchronize()  # blocking events: the thread sleeps, no core spins
        return None
    return event


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
