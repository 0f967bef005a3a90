"""The :class:`ObjectStoreBackend` on obstore: capabilities, writes, conditional creates,
ranged reads, listing, leftovers (see :mod:`tierckpt.backends.objstore`)."""

from __future__ import annotations

import builtins
import logging
import secrets
import threading
import time
from collections.abc import Sequence
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
    body_lost,
    short,
    statuses,
    translate,
)
from tierckpt.backends.objstore._store import StoreSettings, make_store, parse_url
from tierckpt.backends.objstore._writer import _Writer
from tierckpt.backends.sizing import AUTO_CONCURRENCY, AUTO_PART_SIZE
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact

if TYPE_CHECKING:
    from tierckpt.backends.s3 import S3Backend

log = logging.getLogger("tierckpt.backends.objstore")  # one logger for the whole backend

MiB = 2**20
#: S3's (and GCS's XML API's) smallest part but the last
MIN_PART_SIZE = 5 * MiB
#: names of the objects used to probe conditional-put support; hidden from ``list``
PROBE_PREFIX = ".tierckpt-probe-"
#: a request that keeps moving bytes is cut off only after this long
REQUEST_TIMEOUT_S = 600.0


class ObjectStoreBackend(RemoteBackend):
    """Objects under ``s3://``, ``gs://`` or ``az://bucket/prefix``; see the module docstring.

    ``part_size`` is the multipart part size and the size of one concurrent ranged GET;
    ``max_concurrency`` bounds the parts in flight per writer and the ranges in flight per read.
    Unset (8 MiB, 8), each upload chooses its own from the shard's size and the host budget
    (:mod:`tierckpt.backends.sizing`); set, they stay, the part size raised only as far as the
    shard needs to fit S3's 10,000 parts.
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
        part_size: int | None = None,
        max_concurrency: int | None = None,
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
        self._conditional = conditional_put if self.scheme == "s3" else True
        self._probe_lock = threading.Lock()
        self._s3_admin: S3Backend | None = None
        self._admin_lock = threading.Lock()
        self._closed = False
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
            )
            store = make_store(settings, dict(config or {}))
        self._store: Any = store

    def __repr__(self) -> str:
        return f"ObjectStoreBackend({self.url!r}, part_size={self.part_size})"

    # -- plumbing --------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        if self._closed:
            raise BackendError(f"{self.url}: backend is closed")
        return self._root + validate_name(name)

    def _where(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    def _translate(self, exc: BaseException, what: str, where: str) -> BaseException:
        """The error family's exception for an obstore error; no credentials in it."""
        return translate(exc, what, where, scheme=self.scheme, bucket=self.bucket, url=self.url)

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One idempotent call, translated; a response cut off after its headers is asked
        again (object_store retries failed requests, not bodies lost mid-read)."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return fn(self._store, *args, **kwargs)
            except Exception as exc:
                if attempt < self.max_attempts and body_lost(exc):
                    log.debug("%s: %s lost its response (%s); again", self.url, what, short(exc))
                    backoff(attempt)
                    continue
                raise self._translate(exc, what, self._where(key)) from exc
        raise AssertionError("unreachable")  # pragma: no cover

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
            lost = 0  # creates whose answer was lost: each may have landed
            for _ in range(3 + self.max_attempts):
                try:
                    obstore.put(self._store, key, body, mode="create", use_multipart=False)
                    return
                except Exception as exc:
                    kind = type(exc).__name__
                    if kind in EXISTS_KINDS:
                        if lost and self._holds(key, body):
                            return  # our own earlier attempt landed
                        raise FileExistsError(f"{self._where(key)} already exists") from None
                    if lost + 1 < self.max_attempts and body_lost(exc):
                        lost += 1
                        backoff(lost)
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
        try:
            for attempt in (1, 2):
                try:
                    obstore.put(self._store, key, b"", mode="create", use_multipart=False)
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
            except Exception as exc:
                log.warning("%s: could not delete probe object %s: %s", self.url, key, short(exc))

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
            batch=self.max_concurrency,
            fetch=lambda pieces: self._fetch(key, pieces),
        )

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
        for i in range(0, len(ranges), self.max_concurrency):
            self._fetch(key, ranges[i : i + self.max_concurrency])

    def _fetch(self, key: str, pieces: builtins.list[Range]) -> None:
        """Fetch ranges concurrently (one Rust call, GIL released) and copy each into its
        piece; a failed batch is fetched again, up to ``max_attempts`` times."""
        import obstore

        where = self._where(key)
        starts = [start for start, _ in pieces]
        lengths = [len(view) for _, view in pieces]
        for attempt in range(1, self.max_attempts + 1):
            try:
                if len(pieces) == 1:
                    got = [obstore.get_range(self._store, key, start=starts[0], length=lengths[0])]
                else:
                    got = obstore.get_ranges(
                        self._store, key, starts=starts, lengths=lengths, coalesce=0
                    )
            except Exception as exc:
                err = self._translate(exc, "read", where)
                if (
                    isinstance(err, (CheckpointNotFound, FormatError))
                    or attempt == self.max_attempts
                ):
                    raise err from exc
                if attempt == 1:
                    self._check_end(obstore, key, starts[-1] + lengths[-1], err)
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
                view[:] = memoryview(part)
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
        return bytes(self._call("get", key, lambda store: obstore.get(store, key).bytes()))

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
        listing = self._call(
            "list",
            full,
            lambda store: [
                m for b in obstore.list(store, folder or None, chunk_size=1000) for m in b
            ],
        )
        for meta in listing:
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
        with self._admin_lock:
            admin, self._s3_admin = self._s3_admin, None
        if admin is not None:
            admin.close()


class _Spread:
    """Several pieces that one ranged GET fills in order: ``_fetch`` sees one view of their
    joined length and assigns the body to it whole (``spread[:] = body``)."""

    def __init__(self, views: builtins.list[memoryview]) -> None:
        self._views = views
        self._n = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._n

    def __setitem__(self, key: slice, data: memoryview) -> None:
        body = memoryview(data).cast("B")
        pos = 0
        for v in self._views:
            v[:] = body[pos : pos + len(v)]
            pos += len(v)
