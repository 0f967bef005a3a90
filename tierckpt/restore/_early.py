"""A remote load's first data GETs sent as soon as its index is read, before the memory they
fill exists.

Between the index's arrival and the first data request a load used to allocate every
storage, lay out the chunks and start its reader and fetch threads (20-35 ms on a busy
2-core host, measured: a few percent of a 256 MiB restore, spent with the link idle). Now the
loading thread first sends the GETs of the first segments of the first raw chunk in the file
(exactly the segments :class:`~tierckpt.restore._scatter.ScatterFetch` would send: from the
chunk's offset, one part each) on the fetch pool; each fetch thread holds its GET's body
(obstore's own buffer, no copy) until the chunk's reader hands it the destination
(:meth:`EarlyReads.take`, in place of sending that segment itself), then copies it there.

Nothing changes in what is accepted: the reader folds every segment into the chunk's
checksum in order and accepts the chunk only when it matches the index's. A segment no
reader takes (its chunk failed, was read another way, or the load stopped) is dropped:
:meth:`EarlyReads.release` / :meth:`EarlyReads.close` let its thread go without copying.
At most ``fetch threads - 1`` are sent early, so that one fetch thread is always free for the
running chunks while early ones wait for their reader (no deadlock whatever the order the
readers start in). Extra memory: the early bodies, until their reader takes them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from tierckpt.format import ChunkRecord

__all__ = ["EarlyReads", "SupportsReadBody", "early_ranges"]


@runtime_checkable
class SupportsReadBody(Protocol):
    """A backend whose ranged GET can hand back its own body, to be copied later
    (:class:`~tierckpt.backends.objstore.ObjectStoreBackend`)."""

    def read_body(self, name: str, offset: int, length: int) -> memoryview: ...

    def fill_pieces(self, body: memoryview, outs: Sequence[memoryview]) -> None: ...


def early_ranges(
    chunks: Sequence[ChunkRecord], raw: Sequence[bool], step: int, most: int
) -> list[tuple[int, int]]:
    """``(file offset, length)`` of the first segments (``step`` bytes each from its offset)
    of the first chunk, when it is ``raw`` (read in segments), at most ``most``."""
    if not chunks or most < 1 or not raw[0]:
        return []
    rec = chunks[0]
    n = rec.stored_size
    return [(rec.file_offset + a, min(step, n - a)) for a in range(0, min(n, most * step), step)]


class _Early:
    __slots__ = ("event", "future", "views")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.views: list[memoryview] | None = None
        self.future: Future[None] | None = None


class EarlyReads:
    """The early GETs of one load (see the module docstring)."""

    def __init__(
        self,
        backend: SupportsReadBody,
        file: str,
        ranges: Sequence[tuple[int, int]],
        pool: ThreadPoolExecutor,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._backend = backend
        self._file = file
        self._lock = threading.Lock()
        self._open: dict[tuple[int, int], _Early] = {}
        for off, n in ranges:
            slot = _Early()
            self._open[(off, n)] = slot
            slot.future = pool.submit(self._run, off, n, slot, on_start)

    def _run(self, off: int, n: int, slot: _Early, on_start: Callable[[], None] | None) -> None:
        """On a fetch thread: the GET, then (once a reader gave the destination) the copy."""
        if on_start is not None:
            on_start()
        body = self._backend.read_body(self._file, off, n)
        slot.event.wait()
        if slot.views is not None:
            self._backend.fill_pieces(body, slot.views)

    def take(self, offset: int, views: Sequence[memoryview]) -> Future[None] | None:
        """The future of the early GET of exactly these bytes (``views``, in order, from
        ``offset``), now told to copy into ``views``; None where none was sent (the caller
        sends its own)."""
        n = sum(len(v) for v in views)
        with self._lock:
            slot = self._open.pop((offset, n), None)
        if slot is None:
            return None
        slot.views = list(views)
        slot.event.set()
        return slot.future

    def release(self, start: int, end: int) -> None:
        """Drop the early GETs inside file bytes ``start..end`` nobody took (a chunk's read
        is over, however it ended)."""
        with self._lock:
            gone = [k for k in self._open if start <= k[0] < end]
            slots = [self._open.pop(k) for k in gone]
        for slot in slots:
            slot.event.set()

    def close(self) -> None:
        """Drop every early GET not taken (the load ends or failed): their threads finish
        without copying, so the fetch pool can shut down."""
        self.release(0, 1 << 63)
