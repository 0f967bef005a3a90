"""The S3 :class:`~tierckpt.backends.base.Backend`: capabilities, writes, reads, listing."""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, wait
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    IncompleteReadError,
    ParamValidationError,
)

from tierckpt._types import BytesLike
from tierckpt.backends.base import (
    PROBE_PREFIX,
    ObjectWriter,
    Range,
    RemoteBackend,
    most_telling_error,
    read_in_ranges,
    read_new,
    validate_name,
)
from tierckpt.backends.s3._client import S3Connection
from tierckpt.backends.s3._errors import (
    _BODY_ERRORS,
    _CONDITIONAL_REJECTED_CODES,
    S3Error,
    _client_lacks_if_none_match,
    _error_info,
)
from tierckpt.backends.s3._writer import _S3Writer
from tierckpt.config import s3_read_concurrency
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact, scrub_exception


def _readinto(body: Any, out: memoryview) -> int:
    """``body.readinto(out)``; botocore before 1.38.20 has no ``StreamingBody.readinto``.

    The fallback reads at most ``len(out)`` bytes and copies them (one extra copy, only on
    those versions), keeping botocore's own length check on the body.
    """
    readinto = getattr(body, "readinto", None)
    if readinto is not None:
        return int(readinto(out))
    data = body.read(len(out))
    out[: len(data)] = data
    return len(data)


log = logging.getLogger("tierckpt.backends.s3")  # one logger for the whole backend


class S3Backend(S3Connection, RemoteBackend):
    """Objects under ``s3://bucket/prefix``; see :mod:`tierckpt.backends.s3`.

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
        part_size: int | None = None,
        max_concurrency: int | None = None,
        max_attempts: int = 4,
        connect_timeout: float = 5,
        read_timeout: float = 15,
        client: Any = None,
        conditional_put: bool | None = None,
        profile: str | None = None,
        read_concurrency: int | None = None,
    ) -> None:
        super().__init__(
            url_or_bucket,
            prefix,
            endpoint_url=endpoint_url,
            region=region,
            part_size=part_size,
            max_concurrency=max_concurrency,
            max_attempts=max_attempts,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            client=client,
            profile=profile,
        )
        self._conditional = conditional_put
        self._probe_lock = threading.Lock()
        # ranged GETs at once: this rank's share of its node's budget (tierckpt.config)
        self.read_concurrency = s3_read_concurrency(read_concurrency)
        self._read_slots = threading.BoundedSemaphore(self.read_concurrency)

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r}, part_size={self.part_size})"

    # -- capabilities -------------------------------------------------------------------
    @property
    def supports_random_write(self) -> bool:
        return False

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
                except ParamValidationError as exc:
                    if not _client_lacks_if_none_match(exc):
                        raise self._translate(exc, "put_object", key) from exc
                    log.warning(
                        "%s: botocore is too old for If-None-Match; using HEAD+PUT", self.url
                    )
                    self._conditional = False
                    break
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
        created = False  # a put answered: a failed delete would leave an object behind
        try:
            for attempt in (1, 2):
                try:
                    self._client.put_object(Bucket=self.bucket, Key=key, Body=b"", IfNoneMatch="*")
                    created = True
                except ClientError as exc:
                    code, status, _ = _error_info(exc)
                    if attempt == 2 and (code == "PreconditionFailed" or status == 412):
                        log.debug("%s: server honours If-None-Match", self.url)
                        return True
                    if code in _CONDITIONAL_REJECTED_CODES or status in (400, 501):
                        log.info("%s: server rejects If-None-Match (%s)", self.url, code)
                        return False
                    raise self._translate(exc, "put_object (conditional probe)", key) from exc
                except ParamValidationError as exc:
                    if not _client_lacks_if_none_match(exc):
                        raise self._translate(exc, "put_object (conditional probe)", key) from exc
                    log.info(
                        "%s: botocore is too old to send If-None-Match (boto3/botocore >= 1.35 "
                        "has it); create-only puts are best effort",
                        self.url,
                    )
                    return False
                except BotoCoreError as exc:
                    raise self._translate(exc, "put_object (conditional probe)", key) from exc
            log.info("%s: server ignores If-None-Match; create-only puts are best effort", self.url)
            return False
        finally:
            try:
                self._client.delete_object(Bucket=self.bucket, Key=key)
            except (ClientError, BotoCoreError) as exc:  # after a failed put: only noise
                lvl = logging.WARNING if created else logging.DEBUG
                log.log(lvl, "%s: could not delete probe %s: %s", self.url, key, redact(str(exc)))

    # -- reading -------------------------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> BytesLike:
        return read_new(self, name, offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        # a read from one of our own pool's threads stays one GET (no waiting on the pool)
        nested = threading.current_thread().name.startswith(self._thread_prefix)
        read_in_ranges(
            self,
            name,
            offset,
            out,
            range_size=max(out.nbytes, 1) if nested else self.part_size,
            batch=max(1, -(-out.nbytes // self.part_size)),  # all at once: the pool bounds it
            fetch=lambda pieces: self._fetch(key, pieces),
        )

    def _fetch(self, key: str, pieces: builtins.list[Range]) -> None:
        """Each piece by a ranged GET on the pool (one piece: on this thread)."""
        if len(pieces) == 1:
            start, view = pieces[0]
            self._get_range(key, start, view)
            return
        pool = self._executor()
        futures = [pool.submit(self._get_range, key, start, view) for start, view in pieces]
        done, not_done = wait(futures, return_when=FIRST_EXCEPTION)
        errors = [e for f in done if not f.cancelled() and (e := f.exception()) is not None]
        if errors:
            for f in not_done:
                f.cancel()
            wait(not_done)  # nothing may write into the caller's buffer after we return
            raise most_telling_error(errors)

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
                    n = _readinto(body, out[got:])
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
        if 0 < length < want and total > last:
            # fewer bytes than asked of a range inside the object (a server or proxy cut the
            # answer short, its headers consistent): read them; the rest is asked again
            log.debug(
                "s3://%s/%s: asked for bytes %d-%d, the answer holds %d (%s)",
                self.bucket,
                key,
                first,
                last,
                length,
                content_range,
            )
            return
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
                n = _readinto(body, view[got:])
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

    def modified(self, name: str) -> float | None:
        return float(self._call("head_object", self._key(name))["LastModified"].timestamp())

    def list(self, prefix: str = "") -> list[str]:
        return self._names(prefix, None)

    def list_first(self, prefix: str, limit: int) -> builtins.list[str]:
        return self._names(prefix, limit)

    def _names(self, prefix: str, limit: int | None) -> builtins.list[str]:
        cut = len(self._root)
        names = []
        for obj in self._paginate("list_objects_v2", self._root + prefix, "Contents", limit):
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
                self._check_listing(page, "list_objects_v2")
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
