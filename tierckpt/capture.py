"""Lazy device-to-host capture of one chunk into an arena slot.

On CUDA the copies run on a dedicated side stream that first waits for an event recorded on
the training stream at ``save()`` time, so they are ordered after the work already queued and
overlap the next forward/backward pass. Chunks made of many small tensors are first gathered
into a reusable device staging buffer of one chunk (one kernel), then copied to the pinned
slot in one transfer. On CPU the capture thread copies with ``Tensor.copy_``, which releases
the GIL.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.plan import ChunkPlan, ShardLayout

__all__ = ["CaptureStreams", "copy_chunk"]

#: a chunk with more pieces than this, all on one CUDA device, is gathered on the device first
GATHER_MIN_PIECES = 8


@dataclass
class CaptureStreams:
    """Per-device side streams and staging buffers, created on first use and reused."""

    streams: dict[torch.device, Any] = field(default_factory=dict)
    staging: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stream(self, device: torch.device) -> Any:
        with self.lock:
            s = self.streams.get(device)
            if s is None:
                s = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                self.streams[device] = s
            return s

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
            ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
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
    for dev in cuda_devs:
        stream = streams.stream(dev)
        with torch.cuda.stream(stream):
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
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
    # host-side pieces of a mixed chunk
    for p, src in zip(chunk.pieces, sources, strict=True):
        if not src.is_cuda:
            dst[p.dst_offset : p.dst_offset + p.length].copy_(
                src[p.src_offset : p.src_offset + p.length]
            )
    if len(cuda_devs) > 1:  # several devices: wait for all of them before handing over
        for dev in cuda_devs:
            streams.stream(dev).synchronize()
        return None
    return event
