"""Where a chunk's bytes land: storage spans, per-thread buffers, decode errors."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence

import torch

from tierckpt.codecs import Codec, SupportsProgressiveDecode
from tierckpt.errors import CorruptChunk

__all__ = ["SpanLayout", "ThreadBuffers", "decode_chunk", "span_view"]


def span_view(span: torch.Tensor, a: int, b: int) -> memoryview:
    """Bytes ``a..b`` of a uint8 storage span, as a writable memoryview."""
    return memoryview(span[a:b].numpy())  # type: ignore[arg-type]


def decode_chunk(
    codec: Codec,
    stored: memoryview,
    out: memoryview,
    ci: int,
    tier: str,
    where: str,
    file: str,
    ready: Callable[[int], None] | None = None,
) -> None:
    """Decode chunk ``ci`` into ``out``; with ``ready`` (a streamed fetch's), progressively:
    the codec asks for each prefix of ``stored`` it needs before it reads it."""
    try:
        if ready is not None and isinstance(codec, SupportsProgressiveDecode):
            codec.decode_progressive(stored, out, ready)
        else:
            if ready is not None:
                ready(len(stored))
            codec.decode(stored, out)
    except CorruptChunk as exc:
        raise CorruptChunk(f"{where}: chunk {ci}: {exc}", tier=tier, file=file, chunk=ci) from exc


class ThreadBuffers:
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


class SpanLayout:
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
