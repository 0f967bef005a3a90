"""One bucket and prefix through one boto3 client: the client's configuration (retries,
timeouts, pool), the thread pool and part buffers shared by the backend's uploads, and every
S3 call with its errors translated."""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ProfileNotFound,
)

from tierckpt.backends._denied import AUTH_CODES, delete_denied_hint
from tierckpt.backends._throttle import throttled
from tierckpt.backends.base import validate_name
from tierckpt.backends.s3._errors import _AUTH_CODES, _NOT_FOUND_CODES, S3Error, _error_info
from tierckpt.backends.sizing import AUTO_CONCURRENCY, AUTO_PART_SIZE
from tierckpt.config import s3_endpoint_url
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import (
    redact,
    refuse_control_characters,
    refuse_credentials,
    scrub_exception,
    warn_bucket_in_endpoint,
)

log = logging.getLogger("tierckpt.backends.s3")  # one logger for the whole backend

#: S3's codes for a request refused to slow its sender down (with 503 or 429)
_THROTTLING_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded"}
)

MiB = 2**20
#: S3's smallest part (all parts but the last) and largest part
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * 2**30
MAX_PARTS = 10_000
#: fields of which every store's answer to a listing has at least one
_LISTING_FIELDS = {
    "list_objects_v2": ("KeyCount", "Name", "IsTruncated", "MaxKeys"),
    "list_multipart_uploads": ("Bucket", "IsTruncated", "MaxUploads"),
}


def _parse_location(url_or_bucket: str, prefix: str) -> tuple[str, str]:
    refuse_credentials(url_or_bucket if "://" in url_or_bucket else f"s3://{url_or_bucket}")
    refuse_control_characters(f"{url_or_bucket}/{prefix}", "S3 URL")
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


def _watch_throttling(client: Any, url: str) -> None:
    """Tell :func:`~tierckpt.backends._throttle.throttled` of each throttling answer to
    ``client``'s requests: botocore retries them itself (its ``standard`` mode), unseen."""

    def on_needs_retry(response: object = None, **_: object) -> None:
        if not isinstance(response, tuple) or len(response) < 2:
            return  # no answer (a connection error): not throttling
        status = int(getattr(response[0], "status_code", 0) or 0)
        parsed = response[1] if isinstance(response[1], dict) else {}
        code = str(parsed.get("Error", {}).get("Code", ""))
        if status in (429, 503) or code in _THROTTLING_CODES:
            throttled(url, f"{status} {code}".strip())

    events = getattr(getattr(client, "meta", None), "events", None)
    if events is not None:  # returns None: botocore's own handler still decides the retry
        events.register("needs-retry.s3", on_needs_retry, unique_id=f"tierckpt-throttle {url}")


class S3Connection:
    """What every S3 call of a backend goes through (see the package docstring): the location,
    the client and its settings, the shared part pool and buffers, error translation."""

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
        profile: str | None = None,
    ) -> None:
        # unset: each upload chooses from its shard's size and the host budget
        # (tierckpt.backends.sizing); the resolved values are the reads' range size and the
        # connection pool
        self.part_size_set, self.max_concurrency_set = part_size, max_concurrency
        part_size = AUTO_PART_SIZE if part_size is None else part_size
        max_concurrency = AUTO_CONCURRENCY if max_concurrency is None else max_concurrency
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
            warn_bucket_in_endpoint(s3_endpoint_url(endpoint_url), self.bucket, self.url)
            config = Config(
                retries={"total_max_attempts": max_attempts, "mode": "standard"},
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                max_pool_connections=max_concurrency + 4,
                tcp_keepalive=True,
            )
            # a private session: boto3's default session is not thread-safe. profile: a
            # named profile of ~/.aws/config (else AWS_PROFILE / the default chain)
            try:
                session = boto3.session.Session(profile_name=profile)
            except ProfileNotFound as exc:
                raise FormatError(
                    f"S3 client for {self.url}: {exc}; name a profile of ~/.aws/config or "
                    "~/.aws/credentials, or leave profile unset to use the default chain"
                ) from None
            try:
                client = session.client(
                    "s3", endpoint_url=endpoint_url, region_name=region, config=config
                )
            except ValueError as exc:  # botocore's "Invalid endpoint: <the URL>"
                raise FormatError(f"S3 client for {self.url}: {redact(str(exc))}") from None
        self._client: Any = client
        _watch_throttling(client, self.url)
        # mirror s3transfer: CRC32 part checksums when the client computes them by default
        self._checksum_args: dict[str, str] = (
            {"ChecksumAlgorithm": "CRC32"}
            if getattr(client.meta.config, "request_checksum_calculation", None) == "when_supported"
            else {}
        )
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._buffers = _PartBuffers(part_size, keep=max_concurrency + 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._thread_prefix = f"tierckpt-s3-{secrets.token_hex(3)}"
        self._page_size: int | None = None  # listing page size; None: the server's (1000)
        self._closed = False

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
                        f"{where}: {what} failed: NoSuchBucket: the bucket {self.bucket!r} "
                        "does not exist (404): create the bucket or check the URL",
                        bucket=self.bucket,
                        key=key,
                        code=code,
                        status=status,
                    )
                return CheckpointNotFound(f"{where} does not exist")
            if code == "InvalidRange" or status == 416:
                return FormatError(f"{where}: {what}: range not satisfiable (read past the end)")
            hint = ""
            if status == 403 and what.startswith("delete_object") and code not in AUTH_CODES:
                # the credentials work (an auth code would say otherwise): a permission
                hint = f" ({delete_denied_hint('s3', self.url)})"
            elif code in _AUTH_CODES or status == 403:
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

    def _paginate(
        self, op: str, prefix: str, item: str, limit: int | None = None
    ) -> Iterable[dict[str, Any]]:
        config = {"PageSize": self._page_size} if self._page_size else {}
        if limit is not None:
            config["MaxItems"] = limit
        try:
            pages = self._client.get_paginator(op).paginate(
                Bucket=self.bucket, Prefix=prefix, PaginationConfig=config
            )
            for page in pages:
                self._check_listing(page, op)
                yield from page.get(item, [])
        except (ClientError, BotoCoreError) as exc:
            raise self._translate(exc, op, prefix) from exc

    def _check_listing(self, page: dict[str, Any], op: str) -> None:
        """Raise :class:`BackendError` where a listing's answer has none of the fields every
        store's has: botocore reads an HTML page answered with status 200 (a captive portal,
        a web server or a proxy at the endpoint) as a listing of no objects, so a new node
        found "nothing saved" and trained from step 0 beside the run's checkpoints."""
        if any(k in page for k in _LISTING_FIELDS.get(op, ("IsTruncated",))):
            return
        raise BackendError(
            f"s3://{self.bucket}: the endpoint's answer to a listing ({op}) is not an S3 "
            "listing (it has no KeyCount, Name or IsTruncated): something other than the "
            "object store answered (a web server, captive portal or proxy in the way?). "
            "Check the endpoint URL (AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, endpoint_url=) "
            "and HTTP(S)_PROXY"
        )

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
