"""One object streamed through obstore's buffered writer: a single PUT up to one part, a
multipart upload (S3, GCS) or staged blocks (Azure) beyond.

Until the multipart upload exists (the write that takes the object past one part returned),
the writer keeps the bytes it has handed over (references: each write is copied once anyway),
so that a start whose answer was lost (CreateMultipartUpload's response cut off, which
object_store does not retry) or a lost single PUT at commit is done again from the start; an
upload such a lost start may have opened on S3 is aborted first.

:meth:`_Writer.write_lent` hands obstore the caller's memory itself, not a copy (obstore's parts
are slices of what it is given): the whole parts a write completes go uncopied and the caller's
``release`` is called once obstore has dropped them, i.e. once each such part is acknowledged
(or the upload aborted). Only a write's tail that leaves a part unfinished is copied, so that no
lent memory waits in obstore's buffer for a later write (the caller could not make that write
while its memory stays lent: a deadlock on a small arena).

obstore is handed one part per write (:meth:`_Writer._parts`): its writer waits for a free slot
once per write, so a write of many parts would put them all in flight at once, past
``max_concurrency``.

obstore's writer takes its part size and parts in flight when it is opened, so it is opened at
the first write (or at commit): ``size_hint`` before then sizes the upload from the shard's size
and the host budget (:mod:`tierckpt.backends.sizing`), as the boto3 backend's writer does."""

from __future__ import annotations

import logging
import re
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from tierckpt._types import BytesLike
from tierckpt.backends import sizing
from tierckpt.backends.base import ObjectWriter
from tierckpt.backends.objstore._errors import (
    ObjectStoreError,
    backoff,
    body_lost,
    is_panic,
    short,
)
from tierckpt.backends.sizing import UploadSizing, choose_upload, shard_size_bound
from tierckpt.errors import BackendError

log = logging.getLogger("tierckpt.backends.objstore")  # one logger for the whole backend

#: the most blocks of one Azure blob (S3 and GCS's XML API: sizing.MAX_PARTS parts)
AZURE_MAX_BLOCKS = 50_000
#: an error of the abort object_store sends when a multipart completion fails (S3, GCS)
_ABORT = re.compile(r"Error performing DELETE \S*[?&]uploadId=")


class WriterHost(Protocol):
    """What a writer uses of its backend (an ``ObjectStoreBackend``)."""

    _store: Any
    scheme: str
    bucket: str
    url: str
    part_size: int
    max_concurrency: int
    #: what the tier set (None: each upload chooses)
    part_size_set: int | None
    max_concurrency_set: int | None
    max_attempts: int

    def _where(self, key: str) -> str: ...

    def _translate(self, exc: BaseException, what: str, where: str) -> BaseException: ...

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any: ...

    def _abort_uploads_of(self, key: str) -> None: ...


class _Loan:
    """Memory lent to obstore by one :meth:`_Writer.write_lent`: ``release`` is called once,
    when the write has returned and obstore has dropped every view of it that it was handed
    (each view is watched: obstore holds a view until its part is acknowledged)."""

    def __init__(self, where: str, release: Callable[[], None]) -> None:
        self._where = where
        self._release: Callable[[], None] | None = release
        self._holds = 1  # the write itself, until it returns
        self._lock = threading.Lock()

    def lend(self, view: memoryview) -> None:
        with self._lock:
            self._holds += 1
        # not at interpreter exit: the pipeline that would be told may be gone by then
        weakref.finalize(view, self.drop).atexit = False

    def drop(self) -> None:
        """One hold is gone (may run on obstore's threads: only the caller's release)."""
        with self._lock:
            self._holds -= 1
            release = self._release if self._holds == 0 else None
            if release is not None:
                self._release = None
        if release is not None:
            try:
                release()
            except Exception as exc:  # a finalizer's error would only be printed
                log.error("%s: releasing lent memory failed: %s", self._where, exc)


class _Writer(ObjectWriter):
    """One object streamed through obstore's buffered writer (multipart beyond a part)."""

    def __init__(self, backend: WriterHost, name: str, key: str) -> None:
        super().__init__(name)

        self._b = backend
        self._key = key
        self._where = backend._where(key)
        self._lock = threading.Lock()
        self._closed = False
        #: what obstore holds while no multipart upload exists yet (None: one exists)
        #: (views of the writer's own copies, never of lent memory)
        self._held: list[memoryview] | None = []
        #: this upload's part size and parts in flight: the backend's until size_hint
        self.sizing = UploadSizing(backend.part_size, backend.max_concurrency)
        #: obstore's writer, opened with ``sizing`` at the first write (None: not yet)
        self._file: Any = None

    def size_hint(self, data_bytes: int, host_budget: int | None = None) -> None:
        """Size this upload's parts for a shard of ``data_bytes`` tensor bytes, its parts in
        flight for ``host_budget`` (:mod:`tierckpt.backends.sizing`); before the first write."""
        with self._lock:
            if self._file is not None or self._closed:
                return  # too late: obstore's writer has its part size
            b = self._b
            size_bound = shard_size_bound(data_bytes)
            self.sizing = choose_upload(
                size_bound,
                host_budget,
                part_size=b.part_size_set,
                max_concurrency=b.max_concurrency_set,
                pool=b.max_concurrency,
            )
            log.debug(
                "%s: parts of %d MiB, %d in flight (object up to %d bytes)",
                self._where,
                self.sizing.part_size >> 20,
                self.sizing.concurrency,
                size_bound,
            )

    def _open(self) -> Any:
        import obstore

        return obstore.open_writer(
            self._b._store,
            self._key,
            buffer_size=self.sizing.part_size,
            max_concurrency=self.sizing.concurrency,
        )

    def _max_parts(self) -> int:
        # read at call time: tests lower S3's limit to reach it with small objects
        return AZURE_MAX_BLOCKS if self._b.scheme == "az" else sizing.MAX_PARTS

    def _check_fits(self, end: int) -> None:
        """Refuse to take the object past the store's most parts (before any such part is
        sent: the store would refuse it only after all the others were uploaded)."""
        part, most = self.sizing.part_size, self._max_parts()
        if end > part * most:
            raise ObjectStoreError(
                f"{self._where}: more than {most} parts of {part} bytes; use a larger "
                "part_size (or leave it unset: a tier then sizes the parts of each shard)",
                url=self._b.url,
                key=self._key,
                code="TooManyParts",
            )

    def _start_again(self, exc: BaseException, attempt: int) -> bool:
        """After ``exc`` from a start (no upload yet): a fresh obstore writer given the held
        bytes again, where the failure was a lost answer and attempts remain."""
        if self._held is None or not body_lost(exc) or attempt >= self._b.max_attempts:
            return False
        log.debug("%s: the upload's start lost its answer (%s); again", self._where, short(exc))
        self._exit(self._file)
        self._b._abort_uploads_of(self._key)  # one the lost start may have opened (S3)
        backoff(attempt)
        self._file = self._open()
        return True

    def _hand(self, chunk: memoryview, at: int, lent: bool) -> None:
        """``chunk`` (the object's bytes from ``at``) to obstore; a start that lost its answer
        is done again. A lent chunk always completes a part, so the upload exists after it and
        nothing lent is ever held for a start done again (its memory may be reused by then)."""
        if self._file is None:
            self._file = self._open()
        attempt, pending = 1, [chunk]
        while True:
            try:
                for piece in pending:
                    self._file.write(piece)
                break
            except Exception as exc:
                if not self._start_again(exc, attempt):
                    raise
                attempt += 1
                pending = [*(self._held or ()), chunk]
        if self._held is not None:
            if lent or at + len(chunk) > self.sizing.part_size:
                self._held = None  # the upload exists now: obstore owns the parts
            else:
                self._held.append(chunk)  # not lent: a view of this writer's own copy

    def write(self, offset: int, data: BytesLike) -> None:
        self._write(offset, data, None)

    def write_lent(self, offset: int, data: BytesLike, release: Callable[[], None]) -> None:
        """:meth:`write`, lending ``data`` instead of copying it: ``release()`` is called once
        (maybe on another thread, maybe before this returns) when the writer no longer reads
        ``data``: every part holding it acknowledged, or the upload aborted. Always called,
        also when this raises; until then the caller must not change ``data``."""
        loan = _Loan(self._where, release)
        try:
            self._write(offset, data, loan)
        finally:
            loan.drop()

    def _lendable(self, n: int) -> int:
        """How many of the next ``n`` bytes to lend: those that complete the part being filled
        and the whole parts after it (each sent as soon as obstore has it), not the tail."""
        part = self.sizing.part_size
        head = -self.size % part  # to finish the part obstore is filling (0: none started)
        if n < head:
            return 0
        return head + (n - head) // part * part

    def _parts(self, view: memoryview, at: int) -> Iterator[tuple[int, memoryview]]:
        """``view`` (the object's bytes from ``at``) cut where the object's parts end, as
        ``(offset, piece)``. obstore's writer waits for a free upload slot once per write and
        then sends every part that write completes: handed a 64 MiB chunk whole it would send
        8 parts of 8 MiB on one free slot, so up to twice the parts in flight, sent and
        finished in bursts (measured on SeaweedFS: 15 in flight instead of 8, a slower upload
        on a busy server). One part per write keeps ``concurrency`` parts in flight, each sent
        as soon as one finishes, as ``obstore.put`` does."""
        part, n, pos = self.sizing.part_size, len(view), 0
        while pos < n:
            end = min(n, pos + part - (at + pos) % part)
            yield at + pos, view[pos:end]
            pos = end

    def _write(self, offset: int, data: BytesLike, loan: _Loan | None) -> None:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self._where}: write after commit/abort")
            self._check_sequential(offset)
            view = memoryview(data).cast("B")
            n = len(view)
            lend = self._lendable(n) if loan is not None else 0
            piece: memoryview | None = None
            try:
                self._check_fits(self.size + n)
                for at, piece in self._parts(view[:lend], self.size):
                    assert loan is not None
                    loan.lend(piece)
                    self._hand(piece, at, lent=True)
                piece = None  # only obstore holds the lent views now
                if lend < n:
                    # a copy: obstore keeps what it is given until its part is sent, and the
                    # caller reuses this memory as soon as write() returns
                    copy = memoryview(bytes(view[lend:]))
                    for at, piece in self._parts(copy, self.size + lend):
                        self._hand(piece, at, lent=False)
                    piece = None
            except BaseException as exc:
                piece = None
                # the traceback's finished frames would keep lent views alive: let them go
                traceback.clear_frames(exc.__traceback__)
                self._abort_locked()
                raise self._b._translate(exc, "write", self._where) from exc
            self.size += n

    def commit(self) -> None:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self._where}: commit after commit/abort")
            try:
                self._close()
            except BaseException as exc:
                self._abort_locked()
                raise self._commit_error(exc) from exc
            self._closed = True
            log.debug("%s: committed %d bytes", self._where, self.size)

    def _close(self) -> None:
        """Finish the object: the last part and the completion, or the single PUT of an object
        within one part (done again as one PUT if its answer was lost)."""
        if self._file is None:
            self._file = self._open()  # nothing written: an empty object
        try:
            self._file.close()
        except Exception as exc:
            if self._held is None or not body_lost(exc):
                raise
            import obstore

            log.debug("%s: the PUT lost its answer (%s); again", self._where, short(exc))
            body = b"".join(self._held)
            self._b._call("put", self._key, obstore.put, self._key, body, use_multipart=False)

    def _commit_error(self, exc: BaseException) -> BaseException:
        """The error family's exception for a failed commit. Where the completion of a
        multipart upload failed, object_store aborts the upload, and where that abort fails too
        it raises the abort's error alone: the message then says that the completion failed
        (its own error is lost) and gives the abort's as a note."""
        err = self._b._translate(exc, "commit", self._where)
        if not isinstance(exc, Exception) or not _ABORT.search(str(exc)):
            return err
        code, status = getattr(err, "code", ""), getattr(err, "status", 0)
        return ObjectStoreError(
            f"{self._where}: commit failed: completing the multipart upload "
            f"(CompleteMultipartUpload) failed after {self._b.max_attempts} attempts "
            "(object_store does not keep its error), and the abort that followed failed too, "
            f"so its parts stay stored until `tierckpt gc {self._b.url} --keep-last N "
            "--abort-incomplete` or a lifecycle rule removes them; the abort's error: "
            f"{short(exc)}",
            url=self._b.url,
            key=self._key,
            code=code if isinstance(code, str) else "",
            status=status if isinstance(status, int) else 0,
        )

    def abort(self) -> None:
        with self._lock:
            self._abort_locked()

    def _abort_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._held = None
        if self._file is not None:
            self._exit(self._file)

    def _exit(self, file: Any) -> None:
        """Abort obstore's writer ``file`` (and its multipart upload); never raises."""
        try:
            # obstore aborts the multipart upload when its context exits with an exception
            err = BackendError("aborted")
            file.__exit__(BackendError, err, None)
        except BaseException as exc:
            if not isinstance(exc, Exception) and not is_panic(exc):
                raise
            if "already closed" not in str(exc):
                log.warning("%s: abort failed: %s", self._where, short(exc))
