"""A remote load's first data parts, fetched while its index is read.

From a remote store the index is one round trip (the shard file's tail), and turning it into
the load's requests (decoding a few thousand tensor records, the codecs, the first storages)
takes tens of ms more of Python on a busy host: the data GETs would all wait for both. The
file's name and size come from the manifest, so its first parts (whole ``PIECE_BYTES`` parts
from the start of the file, where the first chunk's bytes lie) are fetched on the fetch pool
at the same time as the tail, into the bodies the store hands over
(:meth:`~tierckpt.backends.base.Backend.read_owned`: no buffer of this module's, no copy).
Once the index says where they go, the chunk reads (:mod:`tierckpt.restore._chunks`) that fall
inside a fetched part are served from it (one copy into the storages, the copy a GET's body
would take anyway); any other read goes to the backend as before.

Nothing is trusted for being fetched early: the bytes are the manifest's file's, and every
chunk is still checked against the index's checksum (which the footer and the manifest vouch
for) before it counts as read, exactly as a chunk fetched after the index.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from tierckpt._types import BytesLike as Buffer
from tierckpt.backends.base import Backend
from tierckpt.backends.objstore._reads import fill

__all__ = ["EarlyParts", "early_parts"]


def early_parts(
    backend: Backend, file: str, size: int, pool: ThreadPoolExecutor, parts: int, step: int
) -> EarlyParts | None:
    """Start fetching the first ``parts`` whole parts of ``step`` bytes of ``file`` (``size``
    bytes: the manifest's) on ``pool``; None where not one whole part fits in the file (a
    small file's data and tail are read as before)."""
    n = min(parts, size // step)
    if n <= 0:
        return None
    return EarlyParts(backend, file, pool, n, step)


class EarlyParts:
    """The reads of one shard file: the first parts from their early fetches, the rest from
    ``backend`` (``read_into_pieces`` and ``read_into``, as the chunk reads call them)."""

    def __init__(
        self, backend: Backend, file: str, pool: ThreadPoolExecutor, parts: int, step: int
    ) -> None:
        self.backend = backend
        self.file = file
        self.step = step
        self.end = parts * step
        self._lock = threading.Lock()
        self._futures: list[Future[Buffer] | None] = [
            pool.submit(backend.read_owned, file, i * step, step) for i in range(parts)
        ]
        #: bytes of each part handed out so far: a part served whole is dropped
        self._served = [0] * parts

    def _take(self, offset: int, n: int) -> memoryview | None:
        """Bytes ``offset..offset+n`` of the file where one early part holds them all (its
        body, waited for; a failed fetch re-raises), else None."""
        if n <= 0 or offset < 0 or offset + n > self.end:
            return None
        i = offset // self.step
        if offset + n > (i + 1) * self.step:
            return None  # across two parts: not a read the chunk reader makes
        with self._lock:
            f = self._futures[i]
            if f is None:
                return None  # served already (never asked twice for the same bytes)
            self._served[i] += n
            if self._served[i] >= self.step:
                self._futures[i] = None
        body = memoryview(f.result()).cast("B")
        a = offset - i * self.step
        return body[a : a + n]

    def read_into_pieces(self, name: str, offset: int, outs: Sequence[memoryview]) -> None:
        src = self._take(offset, sum(len(o) for o in outs)) if name == self.file else None
        if src is None:
            self.backend.read_into_pieces(name, offset, outs)
            return
        pos = 0
        for o in outs:
            _copy(o, src[pos : pos + len(o)])
            pos += len(o)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        src = self._take(offset, len(out)) if name == self.file else None
        if src is None:
            self.backend.read_into(name, offset, out)
        else:
            _copy(out, src)


def _copy(out: memoryview, src: memoryview) -> None:
    """``out[:] = src``; large copies with the GIL released (the obstore backend's ``fill``),
    so the loading thread's Python runs beside them."""
    fill(out.cast("B") if out.format != "B" else out, src)
