"""Object-store backend on obstore (the Rust ``object_store`` crate): S3, Google Cloud Storage
and Azure Blob Storage behind one driver.

URLs
    ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``. The same
    :class:`~tierckpt.backends.base.Backend` contract and shared test suite as the boto3
    backend (:mod:`tierckpt.backends.s3`); the bytes move in Rust, off the GIL.

Credentials (each cloud's standard chain, never in the URL)
    ``s3://``: boto3's chain (environment, ``AWS_PROFILE`` / ``~/.aws``, SSO, container and
    instance roles), handed to obstore, so both S3 drivers find the same credentials; region
    from ``region=``, else boto3's. Endpoint: ``endpoint_url=``, else ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` (S3-compatible servers). ``gs://``: object_store's chain
    (``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application default
    credentials, the metadata server); ``endpoint_url=`` or ``STORAGE_EMULATOR_HOST`` points it at
    an emulator (no OAuth then). ``az://``: object_store's chain (``AZURE_STORAGE_ACCOUNT_NAME``
    with ``AZURE_STORAGE_ACCOUNT_KEY`` / a SAS / a client secret, workload or managed identity,
    the Azure CLI); ``endpoint_url=`` names the account's blob endpoint (Azurite:
    ``http://127.0.0.1:10000/devstoreaccount1``). ``config=`` passes any further obstore store
    setting (``S3Config`` / ``GCSConfig`` / ``AzureConfig`` keys).

Writing a large object
    ``open_writer`` streams into obstore's buffered writer: an object up to ``part_size`` is one
    PUT, a larger one a multipart upload (S3, GCS) or staged blocks (Azure) of ``part_size``
    parts, ``max_concurrency`` of them in flight per writer; ``write`` blocks beyond that. Each
    write's bytes are copied once on the way in (obstore would otherwise hold the caller's
    buffer until its part is sent, and the pipeline reuses arena slots as soon as ``write``
    returns). ``abort()`` aborts the multipart upload.

Small atomic objects
    ``put_atomic`` is one PUT; create-only ones use the store's conditional create (S3
    ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``). For S3 the
    server's support is probed once, lazily, as the boto3 backend does; a server that ignores
    the header gets the same best-effort HEAD-then-PUT. object_store retries requests without
    saying so, so a create whose first attempt landed and whose retry then met the object
    reports ``FileExistsError`` (the boto3 backend tells this case apart): the commit is then
    reported failed although it landed, never the reverse.

Reading
    ``read_into`` splits a read larger than one part into ``part_size`` ranges fetched
    concurrently (obstore ``get_ranges``, ``max_concurrency`` at a time) and copies each into the
    caller's buffer; a failed or short batch is fetched again, up to ``max_attempts`` times.

Retries, timeouts, errors
    The boto3 backend's defaults: 4 attempts (the first included), 5 s to connect, 15 s without
    a byte read from the server (``read_timeout``); a request that keeps moving bytes is cut off
    only after ``request_timeout`` (10 min). Errors are translated here, once: a missing object ->
    :class:`~tierckpt.errors.CheckpointNotFound`, an unsatisfiable or short range ->
    :class:`~tierckpt.errors.FormatError`, everything else -> :class:`ObjectStoreError` (a
    :class:`~tierckpt.errors.BackendError` naming the URL, the HTTP status and what to do).
    Messages go through :func:`tierckpt.redact.redact`.

Leftovers
    ``incomplete`` / ``cleanup_incomplete`` list and abort open multipart uploads on ``s3://``
    (through boto3: obstore has no call for it). GCS and Azure have none to list from here:
    Azure drops uncommitted blocks after 7 days; give a GCS bucket a lifecycle rule that
    aborts incomplete multipart uploads.
"""

from __future__ import annotations

import builtins
import logging
import re
import secrets
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tierckpt._types import BytesLike
from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact, refuse_credentials, scrub_exception

if TYPE_CHECKING:
    from tierckpt.backends.s3 import S3Backend

__all__ = ["SCHEMES", "ObjectStoreBackend", "ObjectStoreError"]

log = logging.getLogger(__name__)

MiB = 2**20
#: the URL schemes this backend serves
SCHEMES = ("s3", "gs", "az")
#: S3's (and GCS's XML API's) smallest part but the last
MIN_PART_SIZE = 5 * MiB
#: names of the objects used to probe conditional-put support; hidden from ``list``
PROBE_PREFIX = ".tierckpt-probe-"
#: a request that keeps moving bytes is cut off only after this long
REQUEST_TIMEOUT_S = 600.0

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>|\"reason\":\s*\"([A-Za-z ]+)\"")
_MISSING_CONTAINER = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
_CREDENTIAL_HINTS = {
    "s3": "check the credentials boto3 finds: env, AWS_PROFILE / ~/.aws, or an instance role",
    "gs": "check GOOGLE_APPLICATION_CREDENTIALS, gcloud's application default credentials or "
    "the instance's service account",
    "az": "check AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY / a SAS, or the "
    "identity (az login, workload or managed identity)",
}
_NO_CONTAINER_WORD = {"s3": "bucket", "gs": "bucket", "az": "container"}


class ObjectStoreError(BackendError):
    """An object-store call failed after retries; ``status`` is the HTTP status (0: none),
    ``code`` the store's error code or the exception's kind."""

    def __init__(
        self, message: str, *, url: str = "", key: str = "", code: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.url = url
        self.key = key
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (str(self), self.url, self.key, self.code, self.status))


def _rebuild_error(message: str, url: str, key: str, code: str, status: int) -> ObjectStoreError:
    return ObjectStoreError(message, url=url, key=key, code=code, status=status)


def _short(exc: BaseException) -> str:
    """obstore's message without its multi-line debug dump."""
    text = str(exc).split("\n\nDebug source", 1)[0]
    return redact(" ".join(text.split()))


def parse_url(url: str, prefix: str = "") -> tuple[str, str, str]:
    """``(scheme, bucket, key prefix)`` of ``s3://``, ``gs://`` or ``az://bucket/prefix``."""
    refuse_credentials(url)
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or "://" not in url:
        raise FormatError(
            f"invalid object-store URL {redact(url)!r}: use s3://bucket/prefix, "
            "gs://bucket/prefix or az://container/prefix"
        )
    if parts.query or parts.fragment:
        raise FormatError(f"invalid URL {redact(url)!r}: no query or fragment allowed")
    bucket = parts.netloc
    if not bucket or "/" in bucket:
        raise FormatError(f"invalid bucket in {redact(url)!r}")
    full = "/".join(p for p in (parts.path.strip("/"), prefix.strip("/")) if p)
    if full and any(c in ("", ".", "..") for c in full.split("/")):
        raise FormatError(f"invalid prefix {full!r} in {redact(url)!r}: empty, '.' or '..' parts")
    return parts.scheme, bucket, full


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
                log.warning("%s: abort failed: %s", self._where, _short(exc))


class ObjectStoreBackend(Backend):
    """Objects under ``s3://``, ``gs://`` or ``az://bucket/prefix``; see the module docstring.

    ``part_size`` is the multipart part size and the size of one concurrent ranged GET;
    ``max_concurrency`` bounds the parts in flight per writer and the ranges in flight per read.
    ``conditional_put`` forces conditional-create support on or off instead of probing (S3).
    ``store=`` takes a ready obstore store (its own settings apply).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int = 8 * MiB,
        max_concurrency: int = 8,
        max_attempts: int = 4,
        connect_timeout: float = 5,
        read_timeout: float = 15,
        request_timeout: float = REQUEST_TIMEOUT_S,
        conditional_put: bool | None = None,
        config: dict[str, Any] | None = None,
        store: Any = None,
    ) -> None:
        try:
            import obstore  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                f"the object-store backend for {redact(url)} needs obstore: pip install obstore"
            ) from exc
        if not isinstance(part_size, int) or part_size < MIN_PART_SIZE:
            raise FormatError(
                f"part_size={part_size} is too small: multipart uploads need parts of at least "
                f"{MIN_PART_SIZE} bytes (5 MiB)"
            )
        if max_concurrency < 1 or max_attempts < 1:
            raise FormatError("max_concurrency and max_attempts must be at least 1")
        self.scheme, self.bucket, self.prefix = parse_url(url, prefix)
        base = f"{self.scheme}://{self.bucket}"
        self.url = f"{base}/{self.prefix}" if self.prefix else base
        self._root = f"{self.prefix}/" if self.prefix else ""
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self._endpoint_url = endpoint_url
        self._region = region
        self._conditional = conditional_put if self.scheme == "s3" else True
        self._probe_lock = threading.Lock()
        self._s3_admin: S3Backend | None = None
        self._admin_lock = threading.Lock()
        self._closed = False
        if store is None:
            store = self._make_store(
                endpoint_url=endpoint_url,
                region=region,
                max_attempts=max_attempts,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                request_timeout=request_timeout,
                extra=dict(config or {}),
            )
        self._store: Any = store

    def __repr__(self) -> str:
        return f"ObjectStoreBackend({self.url!r}, part_size={self.part_size})"

    # -- the store -----------------------------------------------------------------------
    def _make_store(
        self,
        *,
        endpoint_url: str | None,
        region: str | None,
        max_attempts: int,
        connect_timeout: float,
        read_timeout: float,
        request_timeout: float,
        extra: dict[str, Any],
    ) -> Any:
        import importlib

        # typed as Any: obstore's TypedDict configs are checked by obstore at run time
        stores: Any = importlib.import_module("obstore.store")

        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=connect_timeout),
            "read_timeout": timedelta(seconds=read_timeout),
            "timeout": timedelta(seconds=request_timeout),
            "pool_idle_timeout": timedelta(seconds=60),
        }
        retry: dict[str, Any] = {
            "max_retries": max_attempts - 1,
            "retry_timeout": timedelta(
                seconds=max(180.0, max_attempts * (connect_timeout + read_timeout) * 2)
            ),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=2),
                "base": 2,
            },
        }
        try:
            if self.scheme == "s3":
                from tierckpt import config as knobs

                endpoint = knobs.s3_endpoint_url(endpoint_url)
                cfg, provider = self._s3_credentials(region)
                if endpoint:
                    refuse_credentials(endpoint)
                    cfg["endpoint"] = endpoint
                    client["allow_http"] = endpoint.startswith("http://")
                cfg["conditional_put"] = "etag"
                cfg.update(extra)
                return stores.S3Store(
                    self.bucket,
                    config=cfg,
                    client_options=client,
                    retry_config=retry,
                    credential_provider=provider,
                )
            if self.scheme == "gs":
                cfg = {}
                from tierckpt import config as knobs

                endpoint = knobs.gcs_emulator_host(endpoint_url)
                if endpoint:
                    import json

                    if "://" not in endpoint:
                        endpoint = f"http://{endpoint}"
                    refuse_credentials(endpoint)
                    # object_store's documented way to an emulator: a key naming the base URL,
                    # with OAuth off
                    cfg["service_account_key"] = json.dumps(
                        {
                            "gcs_base_url": endpoint.rstrip("/"),
                            "disable_oauth": True,
                            "client_email": "",
                            "private_key": "",
                            "private_key_id": "",
                        }
                    )
                    client["allow_http"] = endpoint.startswith("http://")
                cfg.update(extra)
                return stores.GCSStore(
                    self.bucket, config=cfg, client_options=client, retry_config=retry
                )
            cfg = {}
            if endpoint_url:
                refuse_credentials(endpoint_url)
                cfg["endpoint"] = endpoint_url.rstrip("/")
                client["allow_http"] = endpoint_url.startswith("http://")
            cfg.update(extra)
            return stores.AzureStore(
                self.bucket, config=cfg, client_options=client, retry_config=retry
            )
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{self.url}: cannot configure the store: {_short(exc)}") from None
        except Exception as exc:  # obstore's configuration errors
            scrub_exception(exc)
            raise ObjectStoreError(
                f"{self.url}: cannot configure the store: {_short(exc)}",
                url=self.url,
                code=type(exc).__name__,
            ) from exc

    def _s3_credentials(self, region: str | None) -> tuple[dict[str, Any], Any]:
        """boto3's credential chain, as a provider obstore calls when credentials expire."""
        import boto3
        from obstore.auth.boto3 import Boto3CredentialProvider

        session = boto3.session.Session()
        cfg: dict[str, Any] = {"region": region or session.region_name or "us-east-1"}
        if session.get_credentials() is None:
            raise ObjectStoreError(
                f"{self.url}: no AWS credentials found: set AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE (~/.aws) or run with an instance role "
                "(or pass config={'skip_signature': True} for a public bucket)",
                url=self.url,
                code="NoCredentials",
            )
        return cfg, Boto3CredentialProvider(session)

    # -- capabilities ----------------------------------------------------------------------
    @property
    def supports_conditional_put(self) -> bool:
        """Whether create-only puts are conditional on the server (S3: probed once)."""
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

    # -- plumbing --------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        if self._closed:
            raise BackendError(f"{self.url}: backend is closed")
        return self._root + validate_name(name)

    def _where(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def _translate(self, exc: BaseException, what: str, where: str) -> BaseException:
        """The error family's exception for an obstore error; no credentials in it."""
        if isinstance(exc, (BackendError, FormatError, CheckpointNotFound)):
            return exc
        if not isinstance(exc, Exception):
            return exc  # KeyboardInterrupt and friends pass through
        scrub_exception(exc)
        text = _short(exc)
        m = _STATUS.search(text)
        status = int(m.group(1)) if m else 0
        cm = _CODE.search(text)
        code = (cm.group(1) or cm.group(2) or "").replace(" ", "") if cm else ""
        key = where.split("/", 3)[3] if where.count("/") >= 3 else ""
        if any(s in text for s in _MISSING_CONTAINER):
            word = _NO_CONTAINER_WORD[self.scheme]
            return ObjectStoreError(
                f"{where}: {what} failed: the {word} {self.bucket!r} does not exist ({status}): "
                f"create the {word} or check the URL",
                url=self.url,
                key=key,
                code=code or "NoSuchBucket",
                status=status,
            )
        if isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError":
            return CheckpointNotFound(f"{where} does not exist")
        if status == 416 or code == "InvalidRange" or "InvalidRangeRequest" in str(exc):
            return FormatError(f"{where}: {what}: range not satisfiable (read past the end)")
        hint = ""
        kind = type(exc).__name__
        if status in (401, 403) or kind in ("PermissionDeniedError", "UnauthenticatedError"):
            hint = f" ({_CREDENTIAL_HINTS[self.scheme]})"
        elif not status:
            hint = " (after retries: check that the endpoint is reachable)"
        return ObjectStoreError(
            f"{where}: {what} failed: {code or status or kind}: {text}{hint}",
            url=self.url,
            key=key,
            code=code or kind,
            status=status,
        )

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self._store, *args, **kwargs)
        except Exception as exc:
            raise self._translate(exc, what, self._where(key)) from exc

    # -- writing ---------------------------------------------------------------------------
    def open_writer(self, name: str) -> ObjectWriter:
        key = self._key(name)
        return _Writer(self, name, key)

    def put_atomic(self, name: str, data: BytesLike, *, overwrite: bool = False) -> None:
        import obstore

        key = self._key(name)
        body = bytes(memoryview(data).cast("B"))
        if overwrite:
            self._call("put", key, obstore.put, key, body, use_multipart=False)
            return
        if self.supports_conditional_put:
            for _ in range(3):
                try:
                    obstore.put(self._store, key, body, mode="create", use_multipart=False)
                    return
                except Exception as exc:
                    kind = type(exc).__name__
                    if kind in ("AlreadyExistsError", "PreconditionError"):
                        raise FileExistsError(f"{self._where(key)} already exists") from None
                    if "409" in _STATUS.findall(str(exc)):
                        time.sleep(0.05)  # a concurrent create is in flight; S3 says retry
                        continue
                    if kind == "NotSupportedError" or "501" in _STATUS.findall(str(exc)):
                        log.warning("%s: server rejects conditional puts; HEAD+PUT", self.url)
                        self._conditional = False
                        break
                    raise self._translate(exc, "put (create-only)", self._where(key)) from exc
            else:
                raise FileExistsError(f"{self._where(key)} is being created concurrently")
        # best effort: two writers racing here may both succeed
        if self.exists(name):
            raise FileExistsError(f"{self._where(key)} already exists")
        self._call("put", key, obstore.put, key, body, use_multipart=False)

    def _probe_conditional_put(self) -> bool:
        import obstore

        key = self._root + PROBE_PREFIX + secrets.token_hex(8)
        try:
            for attempt in (1, 2):
                try:
                    obstore.put(self._store, key, b"", mode="create", use_multipart=False)
                except Exception as exc:
                    kind = type(exc).__name__
                    if attempt == 2 and kind in ("AlreadyExistsError", "PreconditionError"):
                        log.debug("%s: server honours conditional puts", self.url)
                        return True
                    statuses = _STATUS.findall(str(exc))
                    if kind == "NotSupportedError" or "400" in statuses or "501" in statuses:
                        log.info("%s: server rejects conditional puts (%s)", self.url, kind)
                        return False
                    raise self._translate(exc, "put (conditional probe)", self._where(key)) from exc
            log.info("%s: server ignores If-None-Match; create-only puts are best effort", self.url)
            return False
        finally:
            try:
                obstore.delete(self._store, key)
            except Exception as exc:
                log.warning("%s: could not delete probe object %s: %s", self.url, key, _short(exc))

    # -- reading ---------------------------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> BytesLike:
        if length < 0:
            raise FormatError(f"{self.url}/{name}: negative read length {length}")
        buf = bytearray(length)
        self.read_into(name, offset, memoryview(buf))
        return buf

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        import obstore

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
        starts = list(range(0, length, step))
        batch = self.max_concurrency
        for i in range(0, len(starts), batch):
            rel = starts[i : i + batch]
            lengths = [min(step, length - s) for s in rel]
            self._fetch(obstore, key, offset, rel, lengths, out)

    def _fetch(
        self,
        obstore: Any,
        key: str,
        offset: int,
        rel: builtins.list[int],
        lengths: builtins.list[int],
        out: memoryview,
    ) -> None:
        """Fetch ranges concurrently (one Rust call, GIL released) and copy them into ``out``."""
        where = self._where(key)
        for attempt in range(1, self.max_attempts + 1):
            try:
                if len(rel) == 1:
                    parts = [
                        obstore.get_range(
                            self._store, key, start=offset + rel[0], length=lengths[0]
                        )
                    ]
                else:
                    parts = obstore.get_ranges(
                        self._store,
                        key,
                        starts=[offset + s for s in rel],
                        lengths=lengths,
                        coalesce=0,
                    )
            except Exception as exc:
                err = self._translate(exc, "read", where)
                if (
                    isinstance(err, (CheckpointNotFound, FormatError))
                    or attempt == self.max_attempts
                ):
                    raise err from exc
                if attempt == 1:
                    self._check_end(obstore, key, offset + rel[-1] + lengths[-1], err)
                log.debug("%s: ranged read failed (%s); again", where, _short(exc))
                continue
            for s, n, part in zip(rel, lengths, parts, strict=True):
                got = len(part)
                if got != n:
                    # object_store returns the rest of the object when a range runs past it
                    raise FormatError(
                        f"{where}: read of bytes {offset + s}-{offset + s + n - 1} past its end "
                        f"({offset + s + got})"
                    )
                out[s : s + n] = memoryview(part)
            return

    def _check_end(self, obstore: Any, key: str, end: int, err: BaseException) -> None:
        """Stores answer a range past the end in their own ways (Azurite: a malformed
        Content-Range): a read that failed is checked against the object's size once."""
        try:
            size = int(obstore.head(self._store, key)["size"])
        except Exception:
            return  # the read's own error says more
        if end > size:
            raise FormatError(
                f"{self._where(key)}: read up to byte {end} past its end ({size})"
            ) from err

    def get(self, name: str) -> bytes:
        """The whole object in one GET."""
        import obstore

        key = self._key(name)
        result = self._call("get", key, obstore.get, key)
        try:
            return bytes(result.bytes())
        except Exception as exc:
            raise self._translate(exc, "get", self._where(key)) from exc

    def size(self, name: str) -> int:
        import obstore

        key = self._key(name)
        return int(self._call("head", key, obstore.head, key)["size"])

    def list(self, prefix: str = "") -> builtins.list[str]:
        import obstore

        if self._closed:
            raise BackendError(f"{self.url}: backend is closed")
        full = self._root + prefix
        # object_store lists whole path segments: list the folder, keep the names that match
        folder = full if full.endswith("/") or not full else full.rpartition("/")[0]
        cut = len(self._root)
        names = []
        try:
            for batch in obstore.list(self._store, folder or None, chunk_size=1000):
                for meta in batch:
                    path = str(meta["path"])
                    if not path.startswith(full):
                        continue
                    rel = path[cut:]
                    if rel.startswith(PROBE_PREFIX):
                        continue
                    try:
                        names.append(validate_name(rel))
                    except FormatError:
                        log.debug("%s: skipping key %r (not a valid object name)", self.url, rel)
        except Exception as exc:
            raise self._translate(exc, "list", self._where(full)) from exc
        return sorted(names)

    def delete(self, name: str) -> None:
        import obstore

        key = self._key(name)
        try:
            self._call("delete", key, obstore.delete, key)
        except CheckpointNotFound:
            pass

    # -- leftovers (S3 only, through boto3) --------------------------------------------------
    def _admin(self) -> S3Backend | None:
        if self.scheme != "s3":
            return None
        with self._admin_lock:
            if self._s3_admin is None:
                from tierckpt import config as knobs
                from tierckpt.backends.s3 import S3Backend

                self._s3_admin = S3Backend(
                    self.url,
                    endpoint_url=knobs.s3_endpoint_url(self._endpoint_url),
                    region=self._region,
                    conditional_put=False,
                )
            return self._s3_admin

    def incomplete(self, prefix: str = "") -> builtins.list[str]:
        admin = self._admin()
        return [] if admin is None else admin.incomplete(prefix)

    def cleanup_incomplete(self, prefix: str = "") -> int:
        admin = self._admin()
        return 0 if admin is None else admin.cleanup_incomplete(prefix)

    def close(self) -> None:
        self._closed = True
        with self._admin_lock:
            admin, self._s3_admin = self._s3_admin, None
        if admin is not None:
            admin.close()
