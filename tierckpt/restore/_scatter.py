"""A raw chunk from an object store read straight into the storages it spans, in segments
fetched on all fetch threads.

Such a chunk is not read into a chunk-sized buffer and copied out: its stored bytes are cut,
in file order, into *pieces* that are the storages' own memory (and a small buffer for gap
bytes no storage holds; a store without a cheap scatter read, where each piece would be a
request of its own, reads the chunk through the reader thread's buffer instead). The pieces
are grouped into *segments* of one part (8 MiB), each read by the fetch pool
(``read_into_pieces``: through obstore, part-sized ranged GETs whose bodies are spread over
the pieces), in file order: as many ranged GETs in flight as fetch threads, and a load ends
with every fetch thread busy on the last chunks instead of one reader finishing the last
chunk alone. (A local file is read by the reader threads instead, one ``preadv`` per chunk:
the same through the fetch pool measured more CPU and no gain here.)

The reader thread hashes the segments in order as they arrive (overlapping the fetch); the
chunk is accepted only if the whole checksum matches the index's. Until then its bytes sit in
the load's fresh storages, never in the caller's tensors (``load(into=)`` copies after the
whole load succeeded). Peak extra memory: gap bytes only where the scatter read is cheap (plus
the bodies in flight), else one chunk per reader thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import xxhash

from tierckpt.backends.base import Backend
from tierckpt.restore._fetch import _started

__all__ = ["Boundaries", "Joint", "ScatterFetch", "segments"]


def segments(
    pieces: Sequence[memoryview], offset: int, step: int
) -> list[tuple[int, list[memoryview]]]:
    """``pieces`` (contiguous in the file from ``offset``, in order) grouped into segments
    that end at the file's multiples of ``step`` (at most ``step`` bytes each): ``(file
    offset, views)``; a piece that crosses a segment's end is split there.

    The cuts are at the file's offsets, not the chunk's: an object uploaded in parts of
    ``step`` (or a multiple) is stored part by part, and a ranged GET across two parts costs
    the store two reads (SeaweedFS here: about 25% more server CPU per byte, on the same
    two cores as the client)."""
    out: list[tuple[int, list[memoryview]]] = []
    cur: list[memoryview] = []
    start, filled = offset, 0
    limit = step - offset % step  # the first segment ends at the next multiple of step
    for p in pieces:
        pos = 0
        while pos < len(p):
            take = min(len(p) - pos, limit - filled)
            cur.append(p[pos : pos + take])
            pos += take
            filled += take
            if filled == limit:
                out.append((start, cur))
                start += filled
                cur, filled, limit = [], 0, step
    if cur:
        out.append((start, cur))
    return out


@dataclass(frozen=True, slots=True)
class Joint:
    """One part that holds the end of a chunk and the start of the next, fetched once: its
    ranged GET fills ``left`` (the earlier chunk's pieces) and then ``right`` (the later
    chunk's); each chunk folds its own pieces into its own checksum."""

    offset: int  # file offset of the part
    left: list[memoryview]
    right: list[memoryview]
    future: Future[None]


class Boundaries:
    """The parts two neighbouring raw chunks share, each fetched by one ranged GET.

    A chunk's file range seldom starts at a multiple of the part size (the file's header, the
    chunks before it), so reading each chunk's own bytes splits the part at every chunk
    boundary into two GETs (a 256 MiB file of 4 chunks: 35 data GETs for 32 parts; each GET
    costs the store a request and a part read). Here whichever of the two chunks' readers
    comes first builds the views of both sides and submits one GET (:meth:`claim`); the other
    picks it up. The views are memory of the load's storages, or fresh buffers for the gap
    bytes no storage holds (never a reader thread's buffer: the other chunk's reader reuses
    its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._joints: dict[int, Joint] = {}

    def claim(self, part: int, make: Callable[[], Joint]) -> Joint:
        """The joint part at file offset ``part``: made (and submitted) by ``make``
        at the first call, handed over (and forgotten) at the second."""
        with self._lock:
            got = self._joints.pop(part, None)
            if got is None:
                got = self._joints[part] = make()
            return got


class ScatterFetch:
    """Fetch ``pieces`` (the stored bytes at ``offset`` of ``file``, in order) as segments of
    at most ``step`` bytes on ``pool``.

    ``finish()`` waits for every segment, folding each into the checksum in order as it
    arrives, and returns the checksum (hex, as the index) or re-raises the first failed
    segment's error; ``close()`` (always, also after an error) cancels what has not started
    and waits for what has, so nothing writes into the pieces after it returns.
    """

    def __init__(
        self,
        backend: Backend,
        file: str,
        offset: int,
        pieces: Sequence[memoryview],
        pool: ThreadPoolExecutor,
        step: int,
        on_start: Callable[[], None] | None = None,
        *,
        head: tuple[Future[None], list[memoryview]] | None = None,
        tail: tuple[Future[None], list[memoryview]] | None = None,
    ) -> None:
        self._segments = segments(pieces, offset, max(1, step))
        self._lock = threading.Lock()
        read = _started(on_start, backend.read_into_pieces)
        self._futures: list[Future[None]] = [
            pool.submit(read, file, off, views) for off, views in self._segments
        ]
        #: this chunk's share of the joint parts (``head``: before its own segments, ``tail``:
        #: after), whose GET it waits for and never cancels: the neighbour needs it too
        self._shared = [x for x in (head, tail) if x is not None]
        self._order: list[tuple[Future[None], list[memoryview]]] = [
            *([head] if head is not None else []),
            *((f, v) for f, (_o, v) in zip(self._futures, self._segments, strict=True)),
            *([tail] if tail is not None else []),
        ]

    def finish(self) -> str:
        """Wait for every segment; the checksum of all of them, in file order."""
        h = xxhash.xxh3_64()  # the same digest as format.checksum over the joined bytes
        with self._lock:
            for f, views in self._order:
                f.result()
                for v in views:
                    h.update(v)
        return h.hexdigest()

    def close(self) -> None:
        """Stop: cancel the segments not started, wait for the running ones (errors dropped)."""
        for f in self._futures:
            f.cancel()
        for f in [*self._futures, *(sf for sf, _v in self._shared)]:
            if not f.cancelled():
                f.exception()
