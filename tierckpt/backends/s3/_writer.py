"""The multipart upload behind ``S3Backend.open_writer`` (one PutObject below one part)."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, wait
from typing import Any

from tierckpt._types import BytesLike
from tierckpt.backends.base import ObjectWriter
from tierckpt.backends.s3._client import MAX_PARTS, S3Connection, _PartBuffers
from tierckpt.backends.s3._errors import S3Error
from tierckpt.backends.sizing import UploadSizing, choose_upload, shard_size_bound
from tierckpt.errors import BackendError
from tierckpt.redact import redact

log = logging.getLogger("tierckpt.backends.s3")  # one logger for the whole backend


class _S3Writer(ObjectWriter):
    """One multipart upload (or one PutObject for an object smaller than a part)."""

    def __init__(self, backend: S3Connection, name: str, key: str) -> None:
        super().__init__(name)
        self._b = backend
        self._key = key
        self._where = f"s3://{backend.bucket}/{key}"
        self._buf: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._next_part = 1
        self._op_lock = threading.RLock()  # write / commit / abort, one at a time
        self._lock = threading.Lock()  # parts, pending, failure (touched by workers)
        self._parts: dict[int, dict[str, Any]] = {}
        self._pending: set[Future[None]] = set()
        self._failure: tuple[int, BaseException] | None = None
        self._closed = False  # committed or aborted
        self._aborted = False
        # the backend's part size, buffers and slots until size_hint chooses others
        self._part_size = backend.part_size
        self._buffers = backend._buffers
        self._own_slots: threading.BoundedSemaphore | None = None
        self.sizing = UploadSizing(backend.part_size, backend.max_concurrency)

    def size_hint(self, data_bytes: int, host_budget: int | None = None) -> None:
        """Size this upload's parts for a shard of ``data_bytes`` tensor bytes, its parts in
        flight for ``host_budget`` (:mod:`tierckpt.backends.sizing`); before the first write."""
        with self._op_lock:
            if self.size or self._buf is not None or self._upload_id is not None:
                return  # too late: parts already cut
            b = self._b
            size_bound = shard_size_bound(data_bytes)
            sizing = choose_upload(
                size_bound,
                host_budget,
                part_size=b.part_size_set,
                max_concurrency=b.max_concurrency_set,
                pool=b.max_concurrency,
            )
            self.sizing = sizing
            if sizing.part_size != b.part_size:
                self._part_size = sizing.part_size
                self._buffers = _PartBuffers(sizing.part_size, keep=sizing.concurrency + 1)
            if sizing.concurrency < b.max_concurrency:
                self._own_slots = threading.BoundedSemaphore(sizing.concurrency)
            log.debug(
                "%s: parts of %d MiB, %d in flight (object up to %d bytes)",
                self._where,
                sizing.part_size >> 20,
                min(sizing.concurrency, b.max_concurrency),
                size_bound,
            )

    # -- caller side ------------------------------------------------------------------
    def write(self, offset: int, data: BytesLike) -> None:
        with self._op_lock:
            if self._closed:
                raise BackendError(f"{self._where}: write after commit/abort")
            self._check_sequential(offset)
            view = memoryview(data).cast("B")
            part_size = self._part_size
            pos, total = 0, len(view)
            try:
                self._raise_if_failed()
                while pos < total:
                    if self._buf is None:
                        self._buf = self._buffers.take()
                    take = min(part_size - self._fill, total - pos)
                    self._buf[self._fill : self._fill + take] = view[pos : pos + take]
                    self._fill += take
                    pos += take
                    self.size += take
                    if self._fill == part_size:
                        self._submit_part()
            except BaseException:
                self.abort()  # no orphaned parts, whatever went wrong
                raise

    def commit(self) -> None:
        with self._op_lock:
            if self._closed:
                raise BackendError(f"{self._where}: commit after commit/abort")
            try:
                if self._upload_id is None:
                    body = bytes(memoryview(self._buf)[: self._fill]) if self._buf else b""
                    self._release_buffer()
                    self._b._call("put_object", self._key, Body=body)
                else:
                    if self._fill:
                        self._submit_part()
                    self._release_buffer()
                    self._wait_pending()
                    self._raise_if_failed()
                    with self._lock:
                        parts = [self._parts[n] for n in sorted(self._parts)]
                    if len(parts) != self._next_part - 1:
                        raise S3Error(
                            f"{self._where}: {self._next_part - 1 - len(parts)} parts missing "
                            "at completion",
                            bucket=self._b.bucket,
                            key=self._key,
                        )
                    self._b._call(
                        "complete_multipart_upload",
                        self._key,
                        UploadId=self._upload_id,
                        MultipartUpload={"Parts": parts},
                    )
            except BaseException:
                self.abort()
                raise
            self._closed = True
            log.debug("%s: committed %d bytes", self._where, self.size)

    def abort(self) -> None:
        with self._op_lock:
            if self._aborted or self._closed:
                return
            self._aborted = self._closed = True
            try:
                with self._lock:
                    pending = list(self._pending)
                for fut in pending:
                    fut.cancel()
                wait(pending)  # each running part is bounded by timeouts and retries
                self._release_buffer()
                if self._upload_id is not None:
                    self._b._abort_upload(self._key, self._upload_id)
            except Exception as exc:  # abort never raises
                log.warning("%s: abort failed: %s", self._where, redact(str(exc)))

    # -- internals --------------------------------------------------------------------
    def _release_buffer(self) -> None:
        buf, self._buf, self._fill = self._buf, None, 0
        self._buffers.give(buf)

    def _raise_if_failed(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is None:
            return
        number, cause = failure
        self.abort()
        code = getattr(cause, "code", "") or type(cause).__name__
        raise S3Error(
            f"{self._where}: part {number} failed ({code}); multipart upload aborted: "
            + redact(str(cause)),
            bucket=self._b.bucket,
            key=self._key,
            code=code,
            status=getattr(cause, "status", 0),
        ) from cause

    def _submit_part(self) -> None:
        if self._upload_id is None:
            resp = self._b._call("create_multipart_upload", self._key, **self._b._checksum_args)
            self._upload_id = str(resp["UploadId"])
            if resp.get("ResponseMetadata", {}).get("RetryAttempts", 0):
                # CreateMultipartUpload is not idempotent: a retried create may have made an
                # upload whose id we never saw; abort every other upload of this key
                self._b._abort_other_uploads(self._key, self._upload_id)
        number = self._next_part
        if number > MAX_PARTS:
            raise S3Error(
                f"{self._where}: more than {MAX_PARTS} parts of {self._part_size} bytes; "
                "use a larger part_size",
                bucket=self._b.bucket,
                key=self._key,
            )
        buf, length = self._buf, self._fill
        assert buf is not None
        self._buf, self._fill = None, 0
        self._next_part += 1
        self._acquire_slot()  # backpressure: released when an in-flight part finishes
        try:
            self._raise_if_failed()
            fut = self._b._executor().submit(self._upload_part, number, buf, length)
        except BaseException:
            self._release_slot()
            self._buffers.give(buf)
            raise
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._part_cancelled(f, buf))

    def _part_cancelled(self, fut: Future[None], buf: bytearray) -> None:
        with self._lock:
            self._pending.discard(fut)
        if fut.cancelled():  # never ran: _upload_part's finally did not release
            self._release_slot()
            self._buffers.give(buf)

    def _upload_part(self, number: int, buf: bytearray, length: int) -> None:
        try:
            with self._lock:
                skip = self._failure is not None or self._aborted
            if skip:
                return
            # a full buffer goes as is; the (short) last part is copied once
            body: bytes | bytearray = buf if length == len(buf) else bytes(memoryview(buf)[:length])
            resp = self._b._call(
                "upload_part",
                self._key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
                **self._b._checksum_args,
            )
            entry: dict[str, Any] = {"PartNumber": number, "ETag": resp["ETag"]}
            if "ChecksumCRC32" in resp and self._b._checksum_args:
                entry["ChecksumCRC32"] = resp["ChecksumCRC32"]
            with self._lock:
                self._parts[number] = entry
            log.debug("%s: part %d uploaded (%d bytes)", self._where, number, length)
        except BaseException as exc:
            with self._lock:
                if self._failure is None:
                    self._failure = (number, exc)
            log.warning("%s: part %d failed: %s", self._where, number, redact(str(exc)))
        finally:
            self._release_slot()
            self._buffers.give(buf)

    def _acquire_slot(self) -> None:
        """This upload's own bound on parts in flight (size_hint), then the backend's."""
        if self._own_slots is not None:
            self._own_slots.acquire()
        self._b._slots.acquire()

    def _release_slot(self) -> None:
        self._b._slots.release()
        if self._own_slots is not None:
            self._own_slots.release()

    def _wait_pending(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)
