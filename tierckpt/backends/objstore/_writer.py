"""One object streamed through obstore's buffered writer: a single PUT up to one part, a
multipart upload (S3, GCS) or staged blocks (Azure) beyond."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from tierckpt._types import BytesLike
from tierckpt.backends.base import ObjectWriter
from tierckpt.backends.objstore._errors import short
from tierckpt.errors import BackendError

if TYPE_CHECKING:
    from tierckpt.backends.objstore._backend import ObjectStoreBackend

log = logging.getLogger("tierckpt.backends.objstore")  # one logger for the whole backend


class _Writer(ObjectWriter):
    """One object streamed through obstore's buffered writer (multipart beyond a part)."""

    def __init__(self, backend: ObjectStoreBackend, name: str, key: str) -> None:
        super().__init__(name)
        import obstore

        self._b = backend
        self._where = backend._where(key)
        self._lock = threading.Lock()
        self._closed = False
        self._file: Any = obstore.open_writer(
            backend._store,
            key,
            buffer_size=backend.part_size,
            max_concurrency=backend.max_concurrency,
        )

    def write(self, offset: int, data: BytesLike) -> None:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self._where}: write after commit/abort")
            self._check_sequential(offset)
            view = memoryview(data).cast("B")
            try:
                # a copy: obstore keeps what it is given until its part is sent, and the
                # caller reuses this memory as soon as write() returns
                self._file.write(bytes(view))
            except BaseException as exc:
                self._abort_locked()
                raise self._b._translate(exc, "write", self._where) from exc
            self.size += len(view)

    def commit(self) -> None:
        with self._lock:
            if self._closed:
                raise BackendError(f"{self._where}: commit after commit/abort")
            try:
                self._file.close()
            except BaseException as exc:
                self._abort_locked()
                raise self._b._translate(exc, "commit", self._where) from exc
            self._closed = True
            log.debug("%s: committed %d bytes", self._where, self.size)

    def abort(self) -> None:
        with self._lock:
            self._abort_locked()

    def _abort_locked(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # obstore aborts the multipart upload when its context exits with an exception
            err = BackendError("aborted")
            self._file.__exit__(BackendError, err, None)
        except Exception as exc:  # abort never raises
            if "already closed" not in str(exc):
                log.warning("%s: abort failed: %s", self._where, short(exc))
