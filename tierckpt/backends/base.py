"""The storage backend contract.

A *backend* is a plain storage driver: memory, a local filesystem, an S3 bucket. It knows
nothing about checkpoints, tiers or threads; ``pipeline/`` owns concurrency and calls
backends from several threads at once, so **every method must be thread-safe**.

Names
    Object names are relative, ``/``-separated paths. Each component matches
    ``[A-Za-z0-9._-]+`` and is neither ``.`` nor ``..``; no leading ``/``, no empty
    components. :func:`validate_name` enforces this for every call, so a name read from a
    hostile manifest can never escape the backend's root.

Writing a large object (a shard file)
    ``open_writer(name)`` returns a :class:`ObjectWriter`. Writes arrive with explicit
    offsets and **in increasing, contiguous order** (``offset == writer.size``); a backend
    with ``supports_random_write`` also accepts holes. Nothing is visible under ``name``
    until ``commit()`` returns; after that the object is durable to the degree the backend's
    ``is_durable`` says. ``abort()`` discards everything (temporary files, multipart parts)
    and is safe to call at any time, twice, or after a failed commit.

Small atomic objects (manifests, per-rank records)
    ``put_atomic(name, data)`` makes ``data`` visible under ``name`` all at once or not at
    all. With ``overwrite=False`` it raises ``FileExistsError`` when ``name`` exists (a
    conditional create where the backend ``supports_conditional_put``, best effort
    otherwise).

Reading
    ``read(name, offset, length)`` returns exactly ``length`` bytes or raises;
    ``read_into`` fills a caller's buffer (zero-copy where possible). A missing object
    raises :class:`~tierckpt.errors.CheckpointNotFound` (a ``FileNotFoundError``).

The calls a backend receives, in order (``pipeline/``, ``restore.py``, ``retention.py``)
    Saving one checkpoint on a tier (the tier's writer thread, one job at a time; several
    tiers' threads and the pipeline's commit threads call other methods concurrently):

    0. At a writer's first save: ``put_atomic(lease, overwrite=False)`` then ``get(lease)``
       (the writer lease, :mod:`tierckpt.lease`); renewed later with ``overwrite=True``.
    1. ``exists(manifest)``: the step must not be committed already (never overwritten).
    2. ``open_writer(shard)`` once per rank's shard file; then ``writer.write(offset, chunk)``
       for every chunk, in increasing offsets, then the index and the footer.
    3. ``writer.commit()``: the shard is durable; or ``writer.abort()`` on any failure (also
       after a failed ``commit``, and after a ``write`` that returned only once the pipeline
       had given the copy up at its ``save_deadline``), which must leave nothing behind under
       ``shard``.
    4. Multi-rank only: ``put_atomic(record)`` per rank; rank 0 ``list``/``get``s the records.
    5. ``put_atomic(manifest)`` with ``overwrite=False``: the commit point, always last.
    6. Retention (after a commit; on a local tier also after a failed save): ``list(prefix)``,
       then ``delete(manifest)`` before ``delete`` of its data, ``incomplete``/
       ``cleanup_incomplete`` for leftovers of killed writers.

    Loading: ``list("manifests/")``, ``get(manifest)``, ``size(shard)``, then many concurrent
    ``read``/``read_into`` of the footer, the index and the chunks (from a reader pool).
    ``close()`` comes last, once, after every other call has returned.
"""

from __future__ import annotations

import builtins
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence

from tierckpt._types import BytesLike as Buffer
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError

__all__ = [
    "Backend",
    "ObjectWriter",
    "Range",
    "RemoteBackend",
    "most_telling_error",
    "read_in_ranges",
    "read_new",
    "validate_name",
]

_COMPONENT = re.compile(r"^[A-Za-z0-9._-]+$")
MAX_NAME_LENGTH = 512
#: names of the objects an object-store backend writes to probe the store (conditional puts,
#: an endpoint that is not a store); every driver hides them from ``list``
PROBE_PREFIX = ".tierckpt-probe-"


def validate_name(name: str) -> str:
    """Return ``name`` if it is a safe relative object name, else raise ``FormatError``."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
        raise FormatError(f"invalid object name {name!r}: empty, not a string or too long")
    for part in name.split("/"):
        if part in ("", ".", "..") or not _COMPONENT.match(part):
            raise FormatError(
                f"invalid object name {name!r}: components must match [A-Za-z0-9._-]+ "
                "and may not be '.' or '..' (no absolute paths, no traversal)"
            )
    return name


class ObjectWriter(ABC):
    """Streams one large object into a backend; see the module docstring."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.size = 0

    @abstractmethod
    def write(self, offset: int, data: Buffer) -> None:
        """Write ``data`` at ``offset`` (``offset == self.size`` unless random writes)."""

    @abstractmethod
    def commit(self) -> None:
        """Make the object durable and visible under its name."""

    @abstractmethod
    def abort(self) -> None:
        """Discard the object and anything staged for it. Idempotent, never raises."""

    def size_hint(self, data_bytes: int, host_budget: int | None = None) -> None:
        """Before the first write: the object is a shard file of ``data_bytes`` tensor bytes
        (before encoding; the file adds its index, alignment and the codec's worst case), on
        a host whose memory budget is ``host_budget`` bytes. Writers that upload in parts
        size them from it (S3: within 10,000 parts, :mod:`tierckpt.backends.sizing`);
        others ignore it."""

    def _check_sequential(self, offset: int) -> None:
        if offset != self.size:
            raise BackendError(
                f"{self.name}: non-sequential write at offset {offset}, expected {self.size}"
            )


class Backend(ABC):
    """A storage driver. See the module docstring for the contract."""

    #: a short human label used in logs and errors, e.g. ``"local:/nvme/run1"``
    url: str = ""

    # -- capabilities (ask these, never isinstance) ---------------------------------
    @property
    def supports_ranged_read(self) -> bool:
        return True

    @property
    def supports_random_write(self) -> bool:
        return False

    @property
    def supports_conditional_put(self) -> bool:
        return False

    @property
    def is_durable(self) -> bool:
        """True when committed objects survive the death of this process."""
        return False

    @property
    def is_remote(self) -> bool:
        """True when bytes cross a network link (compression usually pays)."""
        return False

    @property
    def is_node_local(self) -> bool:
        """True when only processes on this machine can read it (node RAM): in a multi-rank
        job each node has its own copy, as with a private tier."""
        return False

    def local_path(self, name: str) -> str | None:
        """The path on this machine's file system of object ``name`` (None: not a folder):
        where a writer keeps its lock file (tierckpt.liveness)."""
        return None

    # -- writing -------------------------------------------------------------------
    @abstractmethod
    def open_writer(self, name: str) -> ObjectWriter: ...

    @abstractmethod
    def put_atomic(self, name: str, data: Buffer, *, overwrite: bool = False) -> None: ...

    # -- reading -------------------------------------------------------------------
    @abstractmethod
    def read(self, name: str, offset: int, length: int) -> Buffer: ...

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        data = memoryview(self.read(name, offset, len(out))).cast("B")
        if len(data) != len(out):
            raise FormatError(f"{self.url}/{name}: short read at {offset}")
        out[:] = data

    def read_into_pieces(self, name: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order from the contiguous bytes at ``offset`` (a scatter read:
        a chunk lands straight in the storages of the tensors it spans). The default calls
        ``read_into`` once per piece; a backend with a cheaper scatter read overrides it."""
        for out in outs:
            self.read_into(name, offset, out)
            offset += len(out)

    def get(self, name: str) -> bytes:
        """The whole object (for small objects: manifests, records)."""
        return bytes(self.read(name, 0, self.size(name)))

    def get_bounded(self, name: str, limit: int) -> tuple[int, bytes | None]:
        """``(size, whole object)`` of a small object (manifests), the bytes ``None`` (never
        read) where the object is larger than ``limit``: storage may be hostile. A backend
        that can (obstore: the GET's headers give the size before its body) does it in one
        request instead of a HEAD and a GET."""
        size = self.size(name)
        return size, None if size > limit else bytes(self.get(name))

    def read_tail(self, name: str, length: int) -> tuple[int, Buffer]:
        """``(size, last min(length, size) bytes)`` of an object: a shard file's footer and
        index in one read where the store can (S3's suffix range: one GET, no HEAD)."""
        size = self.size(name)
        n = max(0, min(length, size))
        return size, self.read(name, size - n, n)

    @abstractmethod
    def size(self, name: str) -> int: ...

    def modified(self, name: str) -> float | None:
        """When the store last wrote object ``name``, in seconds since the epoch by the
        *store's* clock (a file's mtime, an object's ``Last-Modified``); None where the store
        keeps no such time. Two of these compare without any machine's clock: how writer
        leases are judged when clocks disagree (tierckpt.lease). ``CheckpointNotFound`` when
        ``name`` does not exist."""
        self.size(name)  # raises CheckpointNotFound
        return None

    def exists(self, name: str) -> bool:
        try:
            self.size(name)
        except CheckpointNotFound:
            return False
        return True

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Names of committed objects starting with ``prefix``, sorted."""

    def list_after(self, prefix: str, start_after: str = "") -> builtins.list[str]:
        """``list(prefix)`` without the names up to ``start_after`` (sorted). A backend that
        can (S3: ListObjectsV2 ``StartAfter``) skips them on the server, so that a poll of a
        growing folder reads only what is new (the multi-rank commit's LIST-only wait)."""
        return [n for n in self.list(prefix) if n > start_after]

    def list_first(self, prefix: str, limit: int) -> builtins.list[str]:
        """At most ``limit`` of the names under ``prefix`` (sorted): a store that can stops
        listing there (a hint's look around a prefix that may hold a dataset's objects)."""
        return self.list(prefix)[:limit]

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete ``name``; a missing object is not an error."""

    def incomplete(self, prefix: str = "") -> builtins.list[str]:
        """Names under ``prefix`` that a writer started and never committed or aborted
        (temporary files, open multipart uploads): leftovers of a killed process, or writes
        in progress. Sorted; a name may also exist committed."""
        return []

    def remove_dead_incomplete(self, name: str) -> int:
        """Remove the unfinished writes of ``name`` whose writer is provably gone (killed),
        while other writers may be active; returns how many are left because a writer may
        still be at work. A store that cannot tell removes nothing and returns 0: what it
        leaves is then found by :meth:`cleanup_incomplete` once nothing writes there."""
        return 0

    def cleanup_incomplete(self, prefix: str = "") -> int:
        """Discard leftovers of writers that never committed (a killed process).

        Returns how many leftovers were removed. Only call it when no writer of this
        prefix is active.
        """
        return 0

    def close(self) -> None:
        """Release connections and handles."""


# -- the ranged-read loop of the object-store backends (boto3 S3, obstore) -----------------
#: one piece of a ranged read: the absolute offset in the object and the caller's memory
Range = tuple[int, memoryview]


class RemoteBackend(Backend):
    """A durable object store across a network link (S3 through boto3 or obstore, GCS, Azure):
    whether its create-only puts are honoured is probed once, on first use, by
    :meth:`_probe_conditional_put`, unless the subclass set ``_conditional`` already."""

    _conditional: bool | None = None
    _probe_lock: threading.Lock

    @property
    def supports_conditional_put(self) -> bool:
        """Whether the server honours create-only puts (probed once, on first use)."""
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

    @abstractmethod
    def _probe_conditional_put(self) -> bool:
        """Try a create-only put on a scratch key: whether the server refused the second."""


def read_in_ranges(
    backend: Backend,
    name: str,
    offset: int,
    out: memoryview,
    *,
    range_size: int,
    batch: int,
    fetch: Callable[[builtins.list[Range]], None],
) -> None:
    """Fill ``out`` with the bytes of ``name`` from ``offset`` as ranged GETs.

    The loop every object-store backend shares: the request is checked (a negative offset is a
    :class:`~tierckpt.errors.FormatError`; an empty read still checks that the object exists
    and that ``offset`` is not past its end, as a file would), ``out`` is split into pieces of
    ``range_size`` bytes, and ``fetch`` gets them ``batch`` at a time as ``(offset, piece)``
    pairs, filling each piece or raising. How a batch is fetched (a thread pool, one Rust call)
    and retried is the backend's own.
    """
    if offset < 0:
        raise FormatError(f"{backend.url}/{name}: negative offset {offset}")
    if out.format != "B" or out.ndim != 1:
        out = out.cast("B")
    length = len(out)
    if length == 0:
        size = backend.size(name)
        if offset > size:
            raise FormatError(f"{backend.url}/{name}: offset {offset} past its end ({size})")
        return
    if range_size < 1 or batch < 1:
        raise ValueError(f"range_size={range_size} and batch={batch} must be at least 1")
    pieces = [(offset + s, out[s : s + range_size]) for s in range(0, length, range_size)]
    for i in range(0, len(pieces), batch):
        fetch(pieces[i : i + batch])


def read_new(backend: Backend, name: str, offset: int, length: int) -> bytearray:
    """``read`` through ``read_into``: ``length`` bytes at ``offset`` in a new buffer."""
    if length < 0:
        raise FormatError(f"{backend.url}/{name}: negative read length {length}")
    buf = bytearray(length)
    backend.read_into(name, offset, memoryview(buf))
    return buf


def most_telling_error(errors: Iterable[BaseException]) -> BaseException:
    """Of the errors of a read's concurrent pieces, the one that says most: a missing object,
    then a read past the end, then the first (a transport error)."""
    errors = builtins.list(errors)
    for kind in (CheckpointNotFound, FormatError):
        for e in errors:
            if isinstance(e, kind):
                return e
    return errors[0]
