"""S3 backend: AWS S3 and S3-compatible servers (MinIO, SeaweedFS, moto).

Writing a large object
    ``open_writer`` streams a multipart upload. Bytes are copied into a part buffer; each full
    part goes to the backend's small thread pool while the caller keeps writing. At most
    ``max_concurrency`` parts are in flight across the whole backend and ``write`` blocks beyond
    that (backpressure), so memory stays near ``(max_concurrency + open writers) * part_size``
    whatever the object size. Part buffers are reused (fresh memory is slow to touch). An object
    smaller than one part is a single PutObject. Any failure (a part that fails after retries,
    a failed completion, ``abort()``) aborts the multipart upload, so no parts are orphaned.

Small atomic objects
    ``put_atomic`` is one PutObject, create-only with ``If-None-Match: *`` where the server
    honours it. Whether it does is probed once (lazily) or configured; a server that ignores
    the header gets a best-effort HEAD-then-PUT instead.

Reading
    Ranged GETs; a read larger than one part is split into parallel ranged GETs that fill the
    caller's buffer in place. A response body cut off mid-stream is resumed from the first
    missing byte.

Retries and errors
    botocore's ``standard`` retry mode retries throttling (503 SlowDown), 5xx and connection
    errors, bounded by ``max_attempts`` (the first try included) and the connect/read timeouts,
    so a stalled connection times out. With the defaults (4 attempts, 5 s to connect, 15 s
    without a byte from the server) one call against a server that accepts connections and
    never answers gives up after about 4 x 15 s = 60 s (4 x 5 s = 20 s when nothing accepts
    connections); a call that is merely slow, but sends or receives bytes, is not cut off.
    Training never waits for that: the pipeline's ``save_deadline`` bounds it. Errors are
    translated once, here: ``NoSuchKey``/404 -> :class:`~tierckpt.errors.CheckpointNotFound`,
    unsatisfiable or short ranges -> :class:`~tierckpt.errors.FormatError`, everything else ->
    :class:`S3Error` (a :class:`~tierckpt.errors.BackendError` naming the bucket, key and S3
    error code). Credentials never appear in messages or logs: every message that holds an
    endpoint URL or a botocore error goes through :func:`tierckpt.redact.redact`
    (``http://KEY:SECRET@host`` becomes ``http://***@host``), the chained botocore exception is
    scrubbed the same way, and an ``s3://`` URL with credentials in it is refused.
"""

from __future__ import annotations

import builtins
import logging
import random
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from tierckpt._types import BytesLike
from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.config import s3_read_concurrency
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact, refuse_credentials, scrub_exception

__all__ = ["MIN_PART_SIZE", "S3Backend", "S3Error"]

log = logging.getLogger(__name__)

MiB = 2**20
#: S3's smallest part (all parts but the last) and largest part
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 2**30
MAX_PARTS = 10_000
#: names of the objects used to probe conditional-put support; hidden from ``list``
PROBE_PREFIX = ".tierckpt-probe-"

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# the server refused If-None-Match itself (rather than the object)
_CONDITIONAL_REJECTED_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})
_AUTH_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)
# failures while streaming a response body: resumed by _get_range
_BODY_ERRORS: tuple[type[BaseException], ...] = (
    HTTPClientError,  # ReadTimeoutError, ResponseStreamingError, ConnectionClosedError
    BotoConnectionError,
    IncompleteReadError,
    OSError,
)


class S3Error(BackendError):
    """An S3 call failed after retries; ``code`` is the S3 error code (``SlowDown``, ...)."""

    def __init__(
        self, message: str, *, bucket: str = "", key: str = "", code: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.key = key
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_s3_error, (str(self), self.bucket, self.key, self.code, self.status))


def _rebuild_s3_error(message: str, bucket: str, key: str, code: str, status: int) -> S3Error:
    return S3Error(message, bucket=bucket, key=key, code=code, status=status)


def _error_info(exc: ClientError) -> tuple[str, int, str]:
    err = exc.response.get("Error", {})
    meta = exc.response.get("ResponseMetadata", {})
    return str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0)), str(err.get("Message", ""))


def _parse_location(url_or_bucket: str, prefix: str) -> tuple[str, str]:
    refuse_credentials(url_or_bucket if "://" in url_or_bucket else f"s3://{url_or_bucket}")
    if url_or_bucket.startswith("s3://"):
        parts = urlsplit(url_or_bucket)
        if parts.query or parts.fragment:
            raise FormatError(
                f"invalid S3 URL {redact(url_or_bucket)!r}: no query or fragment allowed"
            )
        bucket, url_prefix = parts.netloc, parts.path
    else:
        bucket, url_prefix = url_or_bucket, ""
    if not bucket or "/" in bucket:
        raise FormatError(f"invalid S3 bucket in {redact(url_or_bucket)!r}")
    full = "/".join(p for p in (url_prefix.strip("/"), prefix.strip("/")) if p)
    if full and any(c in ("", ".", "..") for c in full.split("/")):
        raise FormatError(f"invalid S3 prefix {full!r}: empty, '.' or '..' components")
    return bucket, full


class _PartBuffers:
    """A free list of part-sized buffers, so parts reuse warm memory."""

    def __init__(self, size: int, keep: int) -> None:
        self.size = size
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self.size)

    def give(self, buf: bytearray | None) -> None:
        if buf is None or len(buf) != self.size:
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


class _S3Writer(ObjectWriter):
    """One multipart upload (or one PutObject for an object smaller than a part)."""

    def __init__(self, backend: S3Backend, name: str, key: str) -> None:
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

    # -- caller side ------------------------------------------------------------------
    def write(self, offset: int, data: BytesLike) -> None:
        with self._op_lock:
            if self._closed:
                raise BackendError(f"{self._where}: write after commit/abort")
            self._check_sequential(offset)
            view = memoryview(data).cast("B")
            part_size = self._b.part_size
            pos, total = 0, len(view)
            try:
                self._raise_if_failed()
                while pos < total:
                    if self._buf is None:
                        self._buf = self._b._buffers.take()
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
        self._b._buffers.give(buf)

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
                f"{self._where}: more than {MAX_PARTS} parts of {self._b.part_size} bytes; "
                "use a larger part_size",
                bucket=self._b.bucket,
                key=self._key,
            )
        buf, length = self._buf, self._fill
        assert buf is not None
        self._buf, self._fill = None, 0
        self._next_part += 1
        slots = self._b._slots
        slots.acquire()  # backpressure: released when an in-flight part finishes
        try:
            self._raise_if_failed()
            fut = self._b._executor().submit(self._upload_part, number, buf, length)
        except BaseException:
            slots.release()
            self._b._buffers.give(buf)
            raise
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(lambda f: self._part_cancelled(f, buf))

    def _part_cancelled(self, fut: Future[None], buf: bytearray) -> None:
        with self._lock:
            self._pending.discard(fut)
        if fut.cancelled():  # never ran: _upload_part's finally did not release
            self._b._slots.release()
            self._b._buffers.give(buf)

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
            self._b._slots.release()
            self._b._buffers.give(buf)

    def _wait_pending(self) -> None:
        with self._lock:
            pending = list(self._pending)
        wait(pending)


class S3Backend(Backend):
    """Objects under ``s3://bucket/prefix``; see the module docstring.

    ``endpoint_url`` defaults to boto3's ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``;
    credentials and region come from boto3's usual chain. ``max_attempts`` counts the first
    try. ``conditional_put`` forces conditional-put support on or off instead of probing.
    With ``client=`` (a boto3 S3 client) the retry, timeout and endpoint settings are the
    client's own and the backend does not close it.
    """

    def __init__(
        self,
        url_or_bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 8 * MiB,
        max_concurrency: int = 8,
        max_attempts: int = 4,
        connect_timeout: float = 5,
        read_timeout: float = 15,
        client: Any = None,
        conditional_put: bool | None = None,
        read_concurrency: int | None = None,
    ) -> None:
        if not isinstance(part_size, int) or part_size < MIN_PART_SIZE:
            raise FormatError(
                f"part_size={part_size} is too small: S3 needs parts of at least "
                f"{MIN_PART_SIZE} bytes (5 MiB)"
            )
        if part_size > MAX_PART_SIZE:
            raise FormatError(f"part_size={part_size} exceeds S3's maximum of 5 GiB")
        if max_concurrency < 1 or max_attempts < 1:
            raise FormatError("max_concurrency and max_attempts must be at least 1")
        self.bucket, self.prefix = _parse_location(url_or_bucket, prefix)
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self._owns_client = client is None
        if client is None:
            config = Config(
                retries={"total_max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max_concurrency + 4,
                tcp_keepalive=True,
            )
            # a private session: boto3's default session is not thread-safe
            session = boto3.session.Session()
            try:
                client = session.client(
                    "s3", endpoint_url=endpoint_url, region_name=region, config=config
                )
            except ValueError as exc:  # botocore's "Invalid endpoint: <the URL>"
                raise FormatError(f"S3 client for {self.url}: {redact(str(exc))}") from None
        self._client: Any = client
        # mirror s3transfer: CRC32 part checksums when the client computes them by default
        self._checksum_args: dict[str, str] = (
            {"ChecksumAlgorithm": "CRC32"}
            if getattr(client.meta.config, "request_checksum_calculation", None) == "when_supported"
            else {}
        )
        self._conditional = conditional_put
        self._probe_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_concurrency)
        # ranged GETs at once: this rank's share of its node's budget (tierckpt.config)
        self.read_concurrency = s3_read_concurrency(read_concurrency)
        self._read_slots = threading.BoundedSemaphore(self.read_concurrency)
        self._buffers = _PartBuffers(part_size, keep=max_concurrency + 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._thread_prefix = f"tierckpt-s3-{secrets.token_hex(3)}"
        self._page_size: int | None = None  # listing page size; None: the server's (1000)
        self._closed = False

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r}, part_size={self.part_size})"

    # -- capabilities -------------------------------------------------------------------
    @property
    def supports_random_write(self) -> bool:
        return False

    @property
    def supports_conditional_put(self) -> bool:
        """Whether the server honours ``If-None-Match: *`` (probed once, on first use)."""
        if self._conditional is None:
            with self._probe_lock:
                if self._conditional is None:
                    self._conditional = self._probe_conditional_put()
        return self._conditional

    @property
    def is_durable(self) -> bool:
        return True

    @property
    def is_remote(self) -> bool:
        return True

    # -- plumbing -----------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._root + validate_name(name)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._closed:
                raise BackendError(f"{self.url}: backend is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.max_concurrency, thread_name_prefix=self._thread_prefix
                )
            return self._pool

    def _translate(self, exc: BaseException, what: str, key: str) -> BaseException:
        """The error family's exception for a botocore error; no credentials in either."""
        scrub_exception(exc)  # it stays chained as __cause__: tracebacks print it
        where = f"s3://{self.bucket}/{key}"
        if isinstance(exc, ClientError):
            code, status, message = _error_info(exc)
            if code in _NOT_FOUND_CODES or (status == 404 and code != "NoSuchUpload"):
                if code == "NoSuchBucket":
                    return S3Error(
                        f"{where}: {what} failed: NoSuchBucket (404): create the bucket or "
                        "check the URL",
                        bucket=self.bucket,
                        key=key,
                        code=code,
                        status=status,
                    )
                return CheckpointNotFound(f"{where} does not exist")
            if code == "InvalidRange" or status == 416:
                return FormatError(f"{where}: {what}: range not satisfiable (read past the end)")
            hint = ""
            if code in _AUTH_CODES or status == 403:
                hint = " (check the credentials boto3 found: env, profile or instance role)"
            return S3Error(
                f"{where}: {what} failed: {code or status} ({status}): {redact(message)}{hint}",
                bucket=self.bucket,
                key=key,
                code=code,
                status=status,
            )
        if isinstance(exc, BotoCoreError):
            return S3Error(
                f"{where}: {what} failed after retries: {redact(str(exc))}",
                bucket=self.bucket,
                key=key,
                code=type(exc).__name__,
            )
        return exc

    def _call(self, op: str, key: str, **kwargs: Any) -> Any:
        """One S3 call on ``key`` with errors translated (botocore does the retries)."""
        try:
            return getattr(self._client, op)(Bucket=self.bucket, Key=key, **kwargs)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, op, key) from exc

    def _paginate(self, op: str, prefix: str, item: str) -> Iterable[dict[str, Any]]:
        config = {"PageSize": self._page_size} if self._page_size else {}
        try:
            pages = self._client.get_paginator(op).paginate(
                Bucket=self.bucket, Prefix=prefix, PaginationConfig=config
            )
            for page in pages:
                yield from page.get(item, [])
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, op, prefix) from exc

    def _abort_other_uploads(self, key: str, keep: str) -> None:
        for upload in self._paginate("list_multipart_uploads", key, "Uploads"):
            if str(upload["Key"]) == key and str(upload["UploadId"]) != keep:
                self._abort_upload(key, str(upload["UploadId"]))

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:
            if _error_info(exc)[0] == "NoSuchUpload":
                return False
            log.warning(
                "s3://%s/%s: abort of upload failed: %s", self.bucket, key, redact(str(exc))
            )
            return False
        except BotoCoreError as exc:
            log.warning(
                "s3://%s/%s: abort of upload failed: %s", self.bucket, key, redact(str(exc))
            )
            return False
        return True

    def _backoff(self, attempt: int) -> None:
        time.sleep(random.random() * min(2.0, 0.05 * 2**attempt))

    # -- writing -------------------------------------------------------------------------
    def open_writer(self, name: str) -> ObjectWriter:
        key = self._key(name)
        if self._closed:
            raise BackendError(f"{self.url}: backend is closed")
        return _S3Writer(self, name, key)

    def put_atomic(self, name: str, data: BytesLike, *, overwrite: bool = False) -> None:
        key = self._key(name)
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        if overwrite:
            self._call("put_object", key, Body=body)
            return
        if self.supports_conditional_put:
            for _ in range(3):
                try:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=body, IfNoneMatch="*")
                    return
                except ClientError as exc:
                    code, status, _ = _error_info(exc)
                    if code == "PreconditionFailed" or status == 412:
                        if self._own_retried_put(exc, key, body):
                            return
                        raise FileExistsError(f"s3://{self.bucket}/{key} already exists") from None
                    if code == "ConditionalRequestConflict" or status == 409:
                        time.sleep(0.05)  # a concurrent create is in flight; S3 says retry
                        continue
                    if code in _CONDITIONAL_REJECTED_CODES or status == 501:
                        log.warning("%s: server rejects If-None-Match; using HEAD+PUT", self.url)
                        self._conditional = False
                        break
                    raise self._translate(exc, "put_object", key) from exc
                except BotoCoreError as exc:
                    raise self._translate(exc, "put_object", key) from exc
            else:
                raise FileExistsError(f"s3://{self.bucket}/{key} is being created concurrently")
        # best effort: two writers racing here may both succeed
        if self.exists(name):
            raise FileExistsError(f"s3://{self.bucket}/{key} already exists")
        self._call("put_object", key, Body=body)

    def _own_retried_put(self, exc: ClientError, key: str, body: bytes | bytearray) -> bool:
        """A 412 after botocore retried may be our own first attempt having landed."""
        if not exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0):
            return False
        try:
            existing = self._call("get_object", key)["Body"].read()
        except (CheckpointNotFound, S3Error):
            return False
        return bool(existing == body)

    def _probe_conditional_put(self) -> bool:
        key = self._root + PROBE_PREFIX + secrets.token_hex(8)
        try:
            for attempt in (1, 2):
                try:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=b"", IfNoneMatch="*")
                except ClientError as exc:
                    code, status, _ = _error_info(exc)
                    if attempt == 2 and (code == "PreconditionFailed" or status == 412):
                        log.debug("%s: server honours If-None-Match", self.url)
                        return True
                    if code in _CONDITIONAL_REJECTED_CODES or status in (400, 501):
                        log.info("%s: server rejects If-None-Match (%s)", self.url, code)
                        return False
                    raise self._translate(exc, "put_object (conditional probe)", key) from exc
                except BotoCoreError as exc:
                    raise self._translate(exc, "put_object (conditional probe)", key) from exc
            log.info("%s: server ignores If-None-Match; create-only puts are best effort", self.url)
            return False
        finally:
            try:
                self._client.delete_object(Bucket=self.bucket, Key=key)
            except (ClientError, BotoCoreError) as exc:
                log.warning(
                    "%s: could not delete probe object %s: %s", self.url, key, redact(str(exc))
                )

    # -- reading -------------------------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> BytesLike:
        if length < 0:
            raise FormatError(f"{self.url}/{name}: negative read length {length}")
        buf = bytearray(length)
        self.read_into(name, offset, memoryview(buf))
        return buf

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        if offset < 0:
            raise FormatError(f"{self.url}/{name}: negative offset {offset}")
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        length = len(out)
        if length == 0:
            size = self.size(name)
            if offset > size:
                raise FormatError(f"{self.url}/{name}: offset {offset} past its end ({size})")
            return
        step = self.part_size
        nested = threading.current_thread().name.startswith(self._thread_prefix)
        if length <= step or nested:
            self._get_range(key, offset, out)
            return
        futures = [
            self._executor().submit(self._get_range, key, offset + s, out[s : s + step])
            for s in range(0, length, step)
        ]
        done, not_done = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [e for f in done if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            for f in not_done:
                f.cancel()
            wait(not_done)  # nothing may write into ``out`` after we return
            # a missing object or a read past the end says more than a transport error
            for kind in (CheckpointNotFound, FormatError):
                for e in errors:
                    if isinstance(e, kind):
                        raise e
            raise errors[0]

    def _get_range(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``key`` from ``start``, at most ``read_concurrency``
        at once (the rank's share of its node's connections)."""
        with self._read_slots:
            self._get_range_now(key, start, out)

    def _get_range_now(self, key: str, start: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``key`` from ``start``; resume a cut-off body."""
        need, got, attempt = len(out), 0, 0
        while got < need:
            first, last = start + got, start + need - 1
            resp = self._call("get_object", key, Range=f"bytes={first}-{last}")
            body = resp["Body"]
            try:
                self._check_range(key, resp, first, last)
                while got < need:
                    n = body.readinto(out[got:])
                    if not n:
                        raise IncompleteReadError(actual_bytes=got, expected_bytes=need)
                    got += n
            except _BODY_ERRORS as exc:
                scrub_exception(exc)
                attempt += 1
                if attempt >= self.max_attempts:
                    raise S3Error(
                        f"s3://{self.bucket}/{key}: reading bytes {first}-{last} failed after "
                        f"{attempt} attempts: {redact(str(exc))}",
                        bucket=self.bucket,
                        key=key,
                        code=type(exc).__name__,
                    ) from exc
                log.debug(
                    "s3://%s/%s: body cut at %d (%s); resuming", self.bucket, key, got, exc
                )  # exc is scrubbed above
                self._backoff(attempt)
            finally:
                body.close()

    def _check_range(self, key: str, resp: dict[str, Any], first: int, last: int) -> None:
        want = last - first + 1
        length = int(resp.get("ContentLength", -1))
        content_range = str(resp.get("ContentRange", ""))
        total = -1
        if content_range.startswith("bytes "):
            span, _, total_s = content_range[6:].partition("/")
            begin = span.partition("-")[0]
            if begin.isdigit() and int(begin) != first:
                raise FormatError(
                    f"s3://{self.bucket}/{key}: asked for bytes from {first}, got {content_range}"
                )
            total = int(total_s) if total_s.isdigit() else -1
        elif first != 0:
            raise FormatError(f"s3://{self.bucket}/{key}: server ignored the Range header")
        if length < want:
            end = total if total >= 0 else first + max(length, 0)
            raise FormatError(
                f"s3://{self.bucket}/{key}: read of bytes {first}-{last} past its end ({end})"
            )
        if length > want:
            raise FormatError(
                f"s3://{self.bucket}/{key}: asked for {want} bytes, server sent {length}"
            )

    def get(self, name: str) -> bytes:
        """The whole object in one GET (resumed with ranged GETs if the body is cut off)."""
        key = self._key(name)
        resp = self._call("get_object", key)
        body = resp["Body"]
        out = bytearray(int(resp["ContentLength"]))
        view = memoryview(out)
        got = 0
        try:
            while got < len(out):
                n = body.readinto(view[got:])
                if not n:
                    break
                got += n
        except _BODY_ERRORS as exc:
            log.debug(
                "s3://%s/%s: body cut at %d (%s); resuming", self.bucket, key, got, redact(str(exc))
            )
        finally:
            body.close()
        if got < len(out):
            self._get_range(key, got, view[got:])
        return bytes(out)

    def size(self, name: str) -> int:
        return int(self._call("head_object", self._key(name))["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        cut = len(self._root)
        names = []
        for obj in self._paginate("list_objects_v2", self._root + prefix, "Contents"):
            rel = str(obj["Key"])[cut:]
            if rel.startswith(PROBE_PREFIX):
                continue
            try:
                names.append(validate_name(rel))
            except FormatError:
                log.debug("%s: skipping key %r (not a valid object name)", self.url, rel)
        return sorted(names)

    def list_after(self, prefix: str, start_after: str = "") -> builtins.list[str]:
        """ListObjectsV2 with ``StartAfter``: the server skips every key up to it."""
        if not start_after:
            return self.list(prefix)
        cut = len(self._root)
        names = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._root + prefix, StartAfter=self._root + start_after
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = str(obj["Key"])[cut:]
                    try:
                        names.append(validate_name(rel))
                    except FormatError:
                        log.debug("%s: skipping key %r (not a valid object name)", self.url, rel)
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, "list_objects_v2", prefix) from exc
        return sorted(names)

    def delete(self, name: str) -> None:
        try:
            self._call("delete_object", self._key(name))
        except CheckpointNotFound:
            pass

    def incomplete(self, prefix: str = "") -> builtins.list[str]:
        cut = len(self._root)
        keys = {
            str(u["Key"])[cut:]
            for u in self._paginate("list_multipart_uploads", self._root + prefix, "Uploads")
        }
        return sorted(keys)

    def cleanup_incomplete(self, prefix: str = "") -> int:
        removed = 0
        for upload in self._paginate("list_multipart_uploads", self._root + prefix, "Uploads"):
            if self._abort_upload(str(upload["Key"]), str(upload["UploadId"])):
                removed += 1
        return removed

    def close(self) -> None:
        with self._pool_lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._buffers.clear()
        if self._owns_client:
            self._client.close()
