"""Reads of :class:`~tierckpt.backends.objstore.ObjectStoreBackend` that save a load its
round trips and its GIL: a small object in one GET (size from its headers), a file's tail
with its size in one suffix-range GET, and a GET's body copied into its pieces with the GIL
released."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, cast

from tierckpt.backends.base import Backend
from tierckpt.backends.objstore._errors import short
from tierckpt.backends.objstore._spread import _Spread
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError

__all__ = ["NOGIL_COPY_BYTES", "Kept", "fetch_ranges", "fill", "get_bounded", "read_tail"]

log = logging.getLogger("tierckpt.backends.objstore")

#: copies from a GET's body at least this large run with the GIL released
NOGIL_COPY_BYTES = 1 << 20


class Kept:
    """A stand-in for a piece of ``length`` bytes that keeps the GET's body itself (no copy:
    the buffer obstore returned) instead of being filled (``read_body``)."""

    __slots__ = ("body", "length")

    def __init__(self, length: int) -> None:
        self.length = length
        self.body: memoryview | None = None

    def __len__(self) -> int:
        return self.length


def fill(view: Any, body: memoryview) -> None:
    """``view[:] = body``, a large copy through ``ctypes.memmove``, which releases the GIL:
    a part's copy (8 MiB, a few ms) then never holds up the loading thread building tensors
    or the other fetch threads handing over their bodies (a slice assignment holds the GIL
    for the whole copy). ``view`` may be a :class:`_Spread` (several pieces, in order), or a
    :class:`Kept` (it keeps ``body``)."""
    body = body.cast("B") if body.format != "B" else body
    if isinstance(view, Kept):
        view.body = body
        return
    pieces = view._views if isinstance(view, _Spread) else [view]
    pos = 0
    for v in pieces:
        n = len(v)
        if n >= NOGIL_COPY_BYTES and v.contiguous and body.contiguous:
            import numpy as np

            dst = np.frombuffer(v, dtype=np.uint8)  # writable: the caller's memory
            src = np.frombuffer(body[pos : pos + n], dtype=np.uint8)
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)
        else:
            v[:] = body[pos : pos + n]
        pos += n


def fetch_ranges(backend: Any, key: str, pieces: list[tuple[int, Any]]) -> None:
    """``backend``: an ``ObjectStoreBackend``. Fetch ``(start, piece)`` ranges of ``key``
    concurrently (one Rust call, GIL released) and copy each into its piece; a failed batch
    is fetched again, up to ``max_attempts`` times."""
    import obstore

    where = backend._where(key)
    starts = [start for start, _ in pieces]
    lengths = [len(view) for _, view in pieces]
    for attempt in range(1, backend.max_attempts + 1):
        try:
            if len(pieces) == 1:
                got = [obstore.get_range(backend._store, key, start=starts[0], length=lengths[0])]
            else:
                got = obstore.get_ranges(
                    backend._store, key, starts=starts, lengths=lengths, coalesce=0
                )
        except Exception as exc:
            err = backend._translate(exc, "read", where)
            if (
                isinstance(err, (CheckpointNotFound, FormatError))
                or attempt == backend.max_attempts
            ):
                raise err from exc
            if attempt == 1:
                _check_end(backend, obstore, key, starts[-1] + lengths[-1], err)
            log.debug("%s: ranged read failed (%s); again", where, short(exc))
            continue
        for (start, view), part in zip(pieces, got, strict=True):
            n = len(part)
            if n != len(view):
                # object_store returns the rest of the object when a range runs past it
                raise FormatError(
                    f"{where}: read of bytes {start}-{start + len(view) - 1} past its end "
                    f"({start + n})"
                )
            fill(view, memoryview(part))
        return


def _check_end(backend: Any, obstore: Any, key: str, end: int, err: BaseException) -> None:
    """Stores answer a range past the end in their own ways (Azurite: a malformed
    Content-Range): a read that failed is checked against the object's size once."""
    try:
        size = int(obstore.head(backend._store, key)["size"])
    except Exception:
        return  # the read's own error says more
    if end > size:
        raise FormatError(
            f"{backend._where(key)}: read up to byte {end} past its end ({size})"
        ) from err


def get_bounded(backend: Any, name: str, limit: int) -> tuple[int, bytes | None]:
    """``backend``: an ``ObjectStoreBackend`` (untyped here: no import cycle). One GET: its
    headers give the size; the body is read only when it is at most
    ``limit`` bytes (larger: never read, the connection is dropped)."""
    import obstore

    key = backend._key(name)

    def one(store: Any) -> tuple[int, bytes | None]:
        got = obstore.get(store, key)
        size = int(got.meta["size"])
        return size, None if size > limit else bytes(got.bytes())

    return cast(tuple[int, "bytes | None"], backend._call("get", key, one))


def read_tail(backend: Any, name: str, length: int) -> tuple[int, bytes]:
    """The last ``length`` bytes of ``name`` (all of it where shorter) and its size, from one
    suffix-range GET; where the store answers that oddly, a HEAD and a ranged GET."""
    import obstore

    key = backend._key(name)

    def one(store: Any) -> tuple[int, bytes]:
        got = obstore.get(store, key, options={"range": {"suffix": length}})
        size = int(got.meta["size"])
        body = bytes(got.bytes())
        if len(body) != min(length, size):
            raise FormatError(
                f"{backend._where(key)}: asked for its last {length} bytes, got {len(body)} "
                f"of {size}"
            )
        return size, body

    try:
        return cast(tuple[int, bytes], backend._call("read", key, one))
    except CheckpointNotFound:
        raise
    except (FormatError, BackendError) as exc:
        # an empty object has no suffix to satisfy (416); some stores answer a suffix
        # longer than the object with all of it, unasked (moto): HEAD and ranged GET
        log.debug("%s: suffix read failed (%s); HEAD and read", backend._where(key), exc)
        size, data = Backend.read_tail(backend, name, length)
        return size, bytes(data)
