"""The GPU side of the nvcomp codec that makes no nvCOMP call: the stream its work runs on,
the chunk's body laid out for nvCOMP (byte planes, 16-byte aligned), where each piece lies in
it, and the stored chunk packed from the compressed pieces (:mod:`tierckpt.codecs.nvcomp`
holds the codec and the nvCOMP calls)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from tierckpt import devices
from tierckpt.codecs._nvcomp_framing import _ALIGN, _align, _Layout

if TYPE_CHECKING:
    import torch

__all__ = ["device_body", "from_body", "pack_pieces", "piece_offsets", "work_stream"]


@contextlib.contextmanager
def work_stream(device: torch.device, *inputs: torch.Tensor) -> Iterator[list[torch.Tensor]]:
    """Run the block on a stream that is not the default one (usually the training stream):
    the caller's current stream when it is a side stream already (the capture stream), else
    this thread's own stream (:func:`tierckpt.devices.thread_stream`). The work stream first
    waits for the caller's stream (the inputs were made there), and the caller's stream then
    waits for the work stream; the block appends to the yielded list each tensor it makes and
    hands back, so the allocator keeps it until the caller's stream has used it."""
    import torch

    if device.type != "cuda":  # tests drive the GPU code with host tensors
        yield []
        return
    devices.use_device(device)
    caller = torch.cuda.current_stream(device)
    if caller != torch.cuda.default_stream(device):
        yield []
        return
    work = devices.thread_stream(device)
    work.wait_stream(caller)
    for t in inputs:
        t.record_stream(work)
    handed: list[torch.Tensor] = []
    with devices.on_streams([work]):
        yield handed
    caller.wait_stream(work)
    for t in handed:
        t.record_stream(caller)


def device_body(t: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The bytes nvCOMP compresses: ``t`` itself (16-byte aligned), or its byte planes, each
    in a row of ``layout.plane_stride`` bytes."""
    import torch

    if layout.n_planes == 1:
        if t.data_ptr() % _ALIGN:
            t = t.clone()
        return t
    n = layout.n_elems
    body = torch.empty(layout.n_planes, layout.plane_stride, dtype=torch.uint8, device=t.device)
    body[:, :n].copy_(t[: n * layout.itemsize].view(n, layout.itemsize).t())
    return body.view(-1)


def piece_offsets(layout: _Layout) -> tuple[list[int], list[int]]:
    """Where each piece starts in the body :func:`device_body` lays out, and its raw size."""
    offsets, sizes = [], []
    stride = layout.plane_stride if layout.n_planes > 1 else 0
    for i in range(layout.n_pieces):
        plane, start, n = layout.piece(i)
        offsets.append(plane * stride + start)
        sizes.append(n)
    return offsets, sizes


def pack_pieces(
    device: torch.device,
    header: bytes,
    packed: torch.Tensor | None,
    at: Sequence[int],
    stored: Sequence[int],
    layout: _Layout,
    tail: torch.Tensor,
) -> torch.Tensor:
    """The stored chunk on ``device``: ``header``, then each compressed piece (``stored[i]``
    bytes at ``packed[at[i]:]``) 16-byte aligned, then the raw ``tail``; one ``torch.cat``, so
    no per-piece Python object is made."""
    import torch

    parts: list[torch.Tensor] = []
    if packed is not None:
        zeros = torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
        pos = layout.header_len()
        for start, n in zip(at, stored, strict=True):
            pad = _align(pos) - pos
            if pad:
                parts.append(zeros[:pad])
            parts.append(packed[start : start + n])
            pos += pad + n
    head = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    parts.insert(0, head.to(device))
    if layout.tail:
        parts.append(tail)
    return torch.cat(parts)


def from_body(body: torch.Tensor, out: torch.Tensor, layout: _Layout) -> None:
    """Copy the decoded body (planes, or bytes) into ``out``; nothing when it is ``out``."""
    n = layout.n_elems
    if layout.n_planes > 1:
        planes = body.view(layout.n_planes, layout.plane_stride)[:, :n]
        out[: n * layout.itemsize].view(n, layout.itemsize).copy_(planes.t())
    elif body is not out:
        out[:n].copy_(body[:n])
