"""Reads of :class:`~tierckpt.backends.objstore.ObjectStoreBackend` that save a load its
round trips and its GIL: a small object in one GET (size from its headers), a file's tail
with its size in one suffix-range GET, a GET's body copied into its pieces with the GIL
released, and a ranged GET streamed into its pieces as it arrives."""

from __future__ import annotations

import ctypes
import logging
from typing import Any, cast

from tierckpt.backends.base import Backend, Range
from tierckpt.backends.objstore._direct import Unusable
from tierckpt.backends.objstore._errors import backoff, short, transient
from tierckpt.backends.objstore._spread import _Spread
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError

__all__ = ["NOGIL_COPY_BYTES", "fetch", "fill", "get_bounded", "read_tail", "stream_into"]

log = logging.getLogger("tierckpt.backends.objstore")

#: copies from a GET's body at least this large run with the GIL released
NOGIL_COPY_BYTES = 1 << 20
#: a streamed body's pieces at least this large are copied with the GIL released
NOGIL_STREAM_BYTES = 1 << 16


def fill(view: Any, body: memoryview) -> None:
    """``view[:] = body``, a large copy through ``ctypes.memmove``, which releases the GIL:
    a part's copy (8 MiB, a few ms) then never holds up the loading thread building tensors
    or the other fetch threads handing over their bodies (a slice assignment holds the GIL
    for the whole copy). ``view`` may be a :class:`_Spread` (several pieces, in order)."""
    body = body.cast("B") if body.format != "B" else body
    pieces = view._views if isinstance(view, _Spread) else [view]
    pos = 0
    for v in pieces:
        n = len(v)
        _copy(v, body[pos : pos + n], NOGIL_COPY_BYTES)
        pos += n


def fetch(backend: Any, key: str, pieces: list[Range]) -> None:
    """``backend``'s ranged reads (an ``ObjectStoreBackend``): ``pieces`` fetched
    concurrently (one Rust call, GIL released) and each copied into its view; a single range
    (a load's scatter reads) read straight into its view: on the first attempt by the direct
    reads where the backend has them (:mod:`._direct`), else streamed (:func:`stream_into`). A
    failed read is made again, up to ``max_attempts`` times in all: each attempt is sent on
    the store without object_store's own retries (on the retrying store a store that stopped
    answering cost ``max_attempts`` squared timeouts per read, not ``max_attempts``)."""
    import obstore

    where = backend._where(key)
    starts = [start for start, _ in pieces]
    lengths = [len(view) for _, view in pieces]
    for attempt in range(1, backend.max_attempts + 1):
        try:
            if len(pieces) == 1:
                view = pieces[0][1]
                if attempt == 1 and _direct(backend, key, starts[0], view, where):
                    return
                stream_into(obstore, backend._once, key, starts[0], view, where)
                return
            got = obstore.get_ranges(backend._once, key, starts=starts, lengths=lengths, coalesce=0)
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
            backoff(attempt, exc)  # translate above told of a throttling answer
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


def _direct(backend: Any, key: str, start: int, view: Any, where: str) -> bool:
    """Read ``view`` through the backend's direct reads: True when done, False where they do
    not apply or got no usable answer (the caller reads through obstore instead; a store that
    refuses them turns them off, said once). Errors while the body is read are raised."""
    direct = backend._direct
    if direct is None:
        return False
    views = view._views if isinstance(view, _Spread) else [view]
    try:
        direct.read(key, start, [v.cast("B") if v.format != "B" else v for v in views], where)
    except Unusable as exc:
        if exc.disable and backend._direct is direct:
            backend._direct = None
            direct.close()
            log.info(
                "%s: direct ranged reads off (%s); reading through object_store", backend.url, exc
            )
        else:
            log.debug("%s: direct read got no usable answer (%s); through object_store", where, exc)
        return False
    return True


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
        if exc.__cause__ is not None and transient(exc.__cause__):
            raise  # no answer after every attempt (a timeout, 5xx): asking again would wait again
        # an empty object has no suffix to satisfy (416); some stores answer a suffix
        # longer than the object with all of it, unasked (moto): HEAD and ranged GET
        log.debug("%s: suffix read failed (%s); HEAD and read", backend._where(key), exc)
        size, data = Backend.read_tail(backend, name, length)
        return size, bytes(data)


def stream_into(obstore: Any, store: Any, key: str, start: int, view: Any, where: str) -> None:
    """Fill ``view`` (a memoryview or a :class:`_Spread`) with the ``len(view)`` bytes at
    ``start`` of ``key``: one ranged GET whose body is copied into place as it arrives, in
    the pieces the HTTP client reads off the socket (a few hundred KiB each).

    ``obstore.get_range`` first joins the whole body into one fresh buffer (an 8 MiB part:
    new pages, faulted and zeroed, then a copy through memory that the cache cannot hold)
    and the caller copies it again; here each piece is copied once, from the cache. A
    256 MiB load from SeaweedFS on 127.0.0.1 took ~100 ms less client CPU (0.58 vs 0.69 s,
    fresh processes, medians of 4-5). ``FormatError`` when the store sends fewer or more
    bytes than asked (``object_store`` answers a range past the end with the rest)."""
    want = len(view)
    if not want:
        return
    result = obstore.get(store, key, options={"range": (start, start + want)})
    pieces = view._views if isinstance(view, _Spread) else [view]
    it = iter([v.cast("B") if v.format != "B" else v for v in pieces])
    cur = next(it, None)
    pos = 0  # bytes of ``cur`` filled
    got = 0
    for chunk in result.stream(min_chunk_size=1):
        body = memoryview(chunk)
        body = body.cast("B") if body.format != "B" else body
        n = len(body)
        if got + n > want:
            raise FormatError(
                f"{where}: read of bytes {start}-{start + want - 1} got more than asked "
                f"({got + n} bytes)"
            )
        got += n
        off = 0
        while off < n:
            assert cur is not None  # got <= want: a piece is left
            take = min(n - off, len(cur) - pos)
            _copy(cur[pos : pos + take], body[off : off + take], NOGIL_STREAM_BYTES)
            off += take
            pos += take
            if pos == len(cur):
                cur, pos = next(it, None), 0
    if got != want:
        raise FormatError(
            f"{where}: read of bytes {start}-{start + want - 1} past its end ({start + got})"
        )


def _copy(dst: memoryview, src: memoryview, nogil_from: int) -> None:
    """``dst[:] = src``; a copy of ``nogil_from`` bytes or more through ``ctypes.memmove``,
    which releases the GIL."""
    n = len(dst)
    if n >= nogil_from and dst.contiguous and src.contiguous:
        import numpy as np

        to = np.frombuffer(dst, dtype=np.uint8)  # writable: the caller's memory
        frm = np.frombuffer(src, dtype=np.uint8)
        ctypes.memmove(to.ctypes.data, frm.ctypes.data, n)
    else:
        dst[:] = src
