"""The :class:`ObjectStoreBackend` on obstore: capabilities, writes, conditional creates,
ranged reads, listing, leftovers (see :mod:`tierckpt.backends.objstore`)."""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

from tierckpt._types import BytesLike
from tierckpt.backends.base import (
    ObjectWriter,
    Range,
    RemoteBackend,
    read_in_ranges,
    read_new,
    validate_name,
)
from tierckpt.backends.objstore._errors import (
    EXISTS_KINDS,
    backoff,
    guard_panics,
    short,
    statuses,
    transient,
    translate,
)
from tierckpt.backends.objstore._listing import PROBE_PREFIX, listed
from tierckpt.backends.objstore._reads import fetch, get_bounded, read_tail
from tierckpt.backends.objstore._slots import Slots
from tierckpt.backends.objstore._spread import _Spread
from tierckpt.backends.objstore._store import StoreSettings, make_stores, parse_url
from tierckpt.backends.objstore._writer import _Writer
from tierckpt.backends.sizing import AUTO_CONCURRENCY, AUTO_PART_SIZE
from tierckpt.config import s3_read_concurrency
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact

if TYPE_CHECKING:
    from tierckpt.backends.s3 import S3Backend

log = logging.getLogger("tierckpt.backends.objstore")  # one logger for the whole backend

MiB = 2**20
#: S3's (and GCS's XML API's) smallest part but the last
MIN_PART_SIZE = 5 * MiB
#: a request that keeps moving bytes is cut off only after this long
REQUEST_TIMEOUT_S = 600.0


#: every call that reaches obstore: a panic of its client is an error of the family there
_PUBLIC = (
    "open_writer",
    "put_atomic",
    "read",
    "read_into",
    "read_into_pieces",
    "get",
    "get_bounded",
    "read_tail",
    "size",
    "exists",
    "list",
    "list_after",
    "list_first",
    "delete",
    "incomplete",
    "remove_dead_incomplete",
    "cleanup_incomplete",
    "supports_conditional_put",
)


@guard_panics(_PUBLIC)
class ObjectStoreBackend(RemoteBackend):
    """Objects under ``s3://``, ``gs://`` or ``az://bucket/prefix``; see the module docstring.

    ``part_size`` is the multipart part size and the size of one concurrent ranged GET;
    ``max_concurrency`` bounds the parts in flight per writer and the ranges in flight per read.
    Unset (8 MiB, 8), each upload chooses its own from the shard's size and the host budget
    (:mod:`tierckpt.backends.sizing`); set, they stay, the part size raised only as far as the
    shard needs to fit S3's 10,000 parts.
    ``conditional_put`` forces conditional-create support on or off instead of probing (S3).
    ``profile`` names a profile of the AWS config / credentials files (S3; else
    ``AWS_PROFILE`` / the default chain). ``read_concurrency`` bounds the ranged GETs in flight
    across all reads of this backend: by default this rank's share of its node's budget
    (``TIERCKPT_NODE_S3_CONNECTIONS`` // ``LOCAL_WORLD_SIZE``, as the boto3 backend).
    ``store=`` takes a ready obstore store (its own settings apply, retries included).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        max_attempts: int = 4,
        connect_timeout: float = 5,
        read_timeout: float = 15,
        request_timeout: float = REQUEST_TIMEOUT_S,
        conditional_put: bool | None = None,
        config: dict[str, Any] | None = None,
        store: Any = None,
        profile: str | None = None,
        read_concurrency: int | None = None,
    ) -> None:
        try:
            import obstore  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                f"the object-store backend for {redact(url)} needs obstore: pip install obstore"
            ) from exc
        # unset: each upload chooses from its shard's size and the host budget
        # (tierckpt.backends.sizing); the resolved values are the reads' range size and batch
        self.part_size_set, self.max_concurrency_set = part_size, max_concurrency
        part_size = AUTO_PART_SIZE if part_size is None else part_size
        max_concurrency = AUTO_CONCURRENCY if max_concurrency is None else max_concurrency
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
        self._profile = profile
        # ranged GETs in flight across all reads: this rank's share of its node's budget
        self.read_concurrency = s3_read_concurrency(read_concurrency)
        self._read_slots = Slots(self.read_concurrency)
        #: told of each failed attempt of a request retried here (the CLI's wait line)
        self._retry_listener: Callable[[int, int], None] | None = None
        self._conditional = conditional_put if self.scheme == "s3" else True
        self._probe_lock = threading.Lock()
        self._s3_admin: S3Backend | None = None
        self._admin_lock = threading.Lock()
        self._closed = False
        #: an empty listing was seen to come from a store (see _listing.check_endpoint)
        self._answers_as_store = False
        if store is None:
            settings = StoreSettings(
                scheme=self.scheme,
                bucket=self.bucket,
                url=self.url,
                endpoint_url=endpoint_url,
                region=region,
                max_attempts=max_attempts,
                connect_timeout=connect_timeout,
                read_timeout=read_timeout,
                request_timeout=request_timeout,
                profile=profile,
                pool_size=self.read_concurrency,
            )
            self._store, self._once, self._direct = make_stores(settings, dict(config or {}))
        else:
            self._store = self._once = store
            self._direct = None

    def __repr__(self) -> str:
        return f"ObjectStoreBackend({self.url!r}, part_size={self.part_size})"

    # -- plumbing --------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return self._root + validate_name(name)

    def _write_key(self, name: str) -> str:
        """:meth:`_key` of an object to write or delete: refused once the backend is closed
        (its writer let go of the location's lease). Reads and listings go on working, as on
        the other backends (a report of what is committed after ``close()``)."""
        if self._closed:
            raise BackendError(f"{self.url}: backend is closed; open a new one to write")
        return self._key(name)

    def _where(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def _translate(self, exc: BaseException, what: str, where: str) -> BaseException:
        """The error family's exception for an obstore error; no credentials in it."""
        return translate(exc, what, where, scheme=self.scheme, bucket=self.bucket, url=self.url)

    def watch_retries(self, listener: Callable[[int, int], None] | None) -> None:
        """Call ``listener(failed, max_attempts)`` when attempt ``failed`` of a request fails
        and is sent again, and ``listener(0, max_attempts)`` when a request is answered (the
        CLI's wait line shows the attempt; botocore's ``needs-retry`` event for boto3).
        The requests retried here are the single ones (HEAD, GET, LIST, DELETE, small PUTs);
        multipart parts and ranged reads are retried inside object_store, unseen."""
        self._retry_listener = listener

    def _tell(self, failed: int) -> None:
        listener = self._retry_listener
        if listener is not None:
            try:
                listener(failed, self.max_attempts)
            except Exception as exc:  # a listener never fails the request
                log.debug("%s: retry listener failed: %s", self.url, exc)

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One idempotent request, translated: sent on the store without object_store's
        retries and retried here (a failed request, a response cut off after its headers), up
        to ``max_attempts`` with backoff, each failed attempt told to the retry listener."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                out = fn(self._once, *args, **kwargs)
            except Exception as exc:
                if attempt < self.max_attempts and transient(exc):
                    log.debug("%s: %s failed (%s); again", self.url, what, short(exc))
                    self._tell(attempt)
                    backoff(attempt, exc, self.url)
                    continue
                self._tell(0)
                raise self._translate(exc, what, self._where(key)) from exc
            self._tell(0)
            return out
        raise AssertionError("unreachable")  # pragma: no cover

    # -- writing ---------------------------------------------------------------------------
    def open_writer(self, name: str) -> ObjectWriter:
        key = self._write_key(name)
        return _Writer(self, name, key)

    def put_atomic(self, name: str, data: BytesLike, *, overwrite: bool = False) -> None:
        import obstore

        key = self._write_key(name)
        body = bytes(memoryview(data).cast("B"))
        if overwrite:
            self._call("put", key, obstore.put, key, body, use_multipart=False)
            return
        if self.supports_conditional_put:
            # sent without object_store's retries: a create sent again after a failed attempt
            # (which may have landed) and then refused is checked against our own bytes
            lost = 0  # failed attempts: each may have landed
            for _ in range(3 + self.max_attempts):
                try:
                    obstore.put(self._once, key, body, mode="create", use_multipart=False)
                    self._tell(0)
                    return
                except Exception as exc:
                    kind = type(exc).__name__
                    if kind in EXISTS_KINDS:
                        self._tell(0)
                        if lost and self._holds(key, body):
                            return  # our own earlier attempt landed
                        raise FileExistsError(f"{self._where(key)} already exists") from None
                    if lost + 1 < self.max_attempts and transient(exc):
                        lost += 1
                        self._tell(lost)
                        backoff(lost, exc, self.url)
                        continue
                    if "409" in statuses(exc):
                        time.sleep(0.05)  # a concurrent create is in flight; S3 says retry
                        continue
                    if kind == "NotSupportedError" or "501" in statuses(exc):
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

    def _holds(self, key: str, body: bytes) -> bool:
        """Whether ``key`` holds exactly ``body`` (a create retried after its answer was lost
        meets its own first attempt: the same bytes)."""
        import obstore

        try:
            return bool(bytes(self._call("get", key, obstore.get, key).bytes()) == body)
        except Exception:
            return False

    def _probe_conditional_put(self) -> bool:
        import obstore

        key = self._root + PROBE_PREFIX + secrets.token_hex(8)
        created = False  # a put answered: a failed delete would leave an object behind
        try:
            for attempt in (1, 2):
                try:
                    obstore.put(self._store, key, b"", mode="create", use_multipart=False)
                    created = True
                except Exception as exc:
                    kind = type(exc).__name__
                    if attempt == 2 and kind in EXISTS_KINDS:
                        log.debug("%s: server honours conditional puts", self.url)
                        return True
                    codes = statuses(exc)
                    if kind == "NotSupportedError" or "400" in codes or "501" in codes:
                        log.info("%s: server rejects conditional puts (%s)", self.url, kind)
                        return False
                    raise self._translate(exc, "put (conditional probe)", self._where(key)) from exc
            log.info("%s: server ignores If-None-Match; create-only puts are best effort", self.url)
            return False
        finally:
            try:
                obstore.delete(self._store, key)
            except Exception as exc:  # after a failed put (no bucket, no server) only noise
                lvl = logging.WARNING if created else logging.DEBUG
                log.log(lvl, "%s: could not delete probe %s: %s", self.url, key, short(exc))

    # -- reading ---------------------------------------------------------------------------
    def read(self, name: str, offset: int, length: int) -> BytesLike:
        return read_new(self, name, offset, length)

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        key = self._key(name)
        read_in_ranges(
            self,
            name,
            offset,
            out,
            range_size=self.part_size,
            batch=min(self.max_concurrency, self.read_concurrency),
            fetch=lambda pieces: self._fetch_in_share(key, pieces),
        )

    def _fetch_in_share(self, key: str, pieces: builtins.list[Range]) -> None:
        """:meth:`_fetch` once its ranges fit in the rank's share of the node's connections
        (``read_concurrency`` in flight across every read of this backend)."""
        with self._read_slots.taken(len(pieces)):
            self._fetch(key, pieces)

    def read_into_pieces(self, name: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order from the bytes at ``offset`` with ranged GETs of
        ``part_size`` over the whole span, each body copied into the pieces it covers: one
        request per part, not one per piece (a chunk of many small tensors is read straight
        into their storages, with no buffer of its own). Added for the load path
        (``tierckpt.restore._scatter``)."""
        views = [o.cast("B") if o.format != "B" else o for o in outs if len(o)]
        if len(views) <= 1:
            super().read_into_pieces(name, offset, views)
            return
        if offset < 0:
            raise FormatError(f"{self.url}/{name}: negative offset {offset}")
        ranges: builtins.list[Range] = []
        cur: builtins.list[memoryview] = []
        start, filled = offset, 0
        for v in views:
            pos = 0
            while pos < len(v):
                take = min(len(v) - pos, self.part_size - filled)
                cur.append(v[pos : pos + take])
                pos, filled = pos + take, filled + take
                if filled == self.part_size:
                    ranges.append((start, cast(memoryview, _Spread(cur))))
                    start, cur, filled = start + filled, [], 0
        if cur:
            ranges.append((start, cast(memoryview, _Spread(cur))))
        key = self._key(name)
        batch = max(1, min(self.max_concurrency, self.read_concurrency))
        for i in range(0, len(ranges), batch):
            self._fetch_in_share(key, ranges[i : i + batch])

    def _fetch(self, key: str, pieces: builtins.list[Range]) -> None:
        """Fetch ranges concurrently and copy each into its piece; a single range (a load's
        scatter reads) is read straight into its piece (``_reads.fetch``)."""
        fetch(self, key, pieces)

    def get(self, name: str) -> bytes:
        """The whole object in one GET."""
        import obstore

        key = self._key(name)
        return bytes(self._call("get", key, lambda store: obstore.get(store, key).bytes()))

    def get_bounded(self, name: str, limit: int) -> tuple[int, bytes | None]:
        """One GET: its headers give the size, and the body is read only when it is at most
        ``limit`` bytes (a manifest without a HEAD first)."""
        return get_bounded(self, name, limit)

    def read_tail(self, name: str, length: int) -> tuple[int, BytesLike]:
        """One GET of a suffix range: the last ``length`` bytes (the whole object where it
        is shorter) and, from the same answer, the object's size (see ``_reads``)."""
        if self.scheme == "az" or length <= 0:  # Azure Blob takes no suffix ranges
            return super().read_tail(name, length)
        return read_tail(self, name, length)

    def size(self, name: str) -> int:
        import obstore

        key = self._key(name)
        return int(self._call("head", key, obstore.head, key)["size"])

    def modified(self, name: str) -> float | None:
        import obstore

        key = self._key(name)
        return float(self._call("head", key, obstore.head, key)["last_modified"].timestamp())

    def list(self, prefix: str = "") -> builtins.list[str]:
        return self._listed(prefix, "", None)

    def list_after(self, prefix: str, start_after: str = "") -> builtins.list[str]:
        """The names under ``prefix`` past ``start_after``: the store skips every key up to
        it (S3 ``start-after``; object_store's list offset)."""
        return self._listed(prefix, start_after, None)

    def list_first(self, prefix: str, limit: int) -> builtins.list[str]:
        return self._listed(prefix, "", limit)

    def _listed(self, prefix: str, start_after: str, limit: int | None) -> builtins.list[str]:
        return listed(self, prefix, start_after, limit)

    def delete(self, name: str) -> None:
        import obstore

        key = self._write_key(name)
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
                    profile=self._profile,
                )
            return self._s3_admin

    def _abort_uploads_of(self, key: str) -> None:
        """Abort every open multipart upload of ``key`` (S3: one a start whose answer was lost
        may have opened). GCS keeps such an upload until the bucket's lifecycle rule."""
        admin = self._admin()
        if admin is None:
            return
        try:
            admin._abort_other_uploads(key, keep="")
        except Exception as exc:
            log.warning("%s: could not abort open uploads of %s: %s", self.url, key, exc)

    def incomplete(self, prefix: str = "") -> builtins.list[str]:
        admin = self._admin()
        return [] if admin is None else admin.incomplete(prefix)

    def cleanup_incomplete(self, prefix: str = "") -> int:
        admin = self._admin()
        return 0 if admin is None else admin.cleanup_incomplete(prefix)

    def close(self) -> None:
        self._closed = True
        if self._direct is not None:
            self._direct.close()
        with self._admin_lock:
            admin, self._s3_admin = self._s3_admin, None
        if admin is not None:
            admin.close()
