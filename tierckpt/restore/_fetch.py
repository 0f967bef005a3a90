"""A chunk's stored bytes fetched in pieces, so that its decode starts before the last byte.

A compressed chunk is not read whole and then decoded: its stored bytes are cut into pieces
(a few MiB each) that a fetch pool reads concurrently, in order, into the chunk's buffer, while
the reader thread decodes whatever prefix has arrived (a codec that decodes progressively, see
:class:`tierckpt.codecs.SupportsProgressiveDecode`, asks for the bytes it needs with
:meth:`StreamedFetch.ready`). Fetch and decode overlap within the chunk and across chunks:
every reader thread does this at once.

The checksum of the stored bytes is computed piece by piece as the prefix grows (on the
decoding thread, which touches those bytes next anyway); the chunk is accepted only when the
whole checksum matches. A decode of unverified bytes writes only into the load's fresh
storages, never into the caller's tensors (``load(into=)`` copies after the whole load
succeeded), and every codec bounds its output by the chunk's raw size, so decoding before
verifying cannot do more harm than a corrupt chunk found afterwards.
"""

from __future__ import annotations

import _thread
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from tierckpt.backends.base import Backend

__all__ = ["PIECE_BYTES", "FetchStarts", "StreamedFetch", "warm"]

#: bytes per ranged read of a streamed chunk: one S3 part (the backends' default part size),
#: small enough that a 64 MiB chunk's first segments decode while the rest downloads
PIECE_BYTES = 8 << 20


def warm(pool: ThreadPoolExecutor, threads: int) -> None:
    """Start up to ``threads`` of ``pool``'s threads in the background; returns at once.

    A :class:`~concurrent.futures.ThreadPoolExecutor` starts a thread at a ``submit`` that
    finds none idle, and ``Thread.start`` waits until the new thread runs: on a busy host a
    few ms per thread, paid by the submit (the load's reader pool while the ranks agree on a
    step; a remote load's fetch pool while its index is read). Each started thread holds a
    placeholder task until all are started (a thread that finished its task early would be
    reused by the next submit instead of a new one being started); the placeholders then end
    and the threads wait idle. A pool shut down meanwhile is left alone."""
    if threads <= 0:
        return
    # not threading.Thread: its start() would make the caller wait for the starter to run
    _thread.start_new_thread(_start_threads, (pool, threads))


def _start_threads(pool: ThreadPoolExecutor, threads: int) -> None:
    release = threading.Event()
    try:
        for _ in range(threads):
            pool.submit(release.wait)
    except RuntimeError:
        pass  # the pool was shut down (the Checkpointer closed): nothing to warm
    finally:
        release.set()


class FetchStarts:
    """Counts the fetches (ranged reads on the fetch pool) that have begun, so that the
    loading thread starts its own Python work (building a few thousand tensors and the tree)
    only once the first ``want`` requests are on their way: on a busy GIL each fetch thread
    would otherwise wait a switch interval (5 ms) per step before its request goes out, and
    the whole load starts that much later. Only an ordering hint: :meth:`wait` also ends when
    every chunk read is done (fewer fetches than ``want``) and after ``timeout`` seconds."""

    def __init__(self, want: int) -> None:
        self._want = max(1, want)
        self._n = 0
        self._lock = threading.Lock()
        self._event = threading.Event()

    def tick(self) -> None:
        """A fetch begins (called on the fetch thread, just before its request)."""
        with self._lock:
            self._n += 1
            if self._n >= self._want:
                self._event.set()

    def wait(self, futures: Sequence[Future[int]], timeout: float = 1.0) -> None:
        """Until ``want`` fetches began, every one of ``futures`` is done, or ``timeout``."""
        left = [len(futures)]
        lock = threading.Lock()

        def done(_f: Future[int]) -> None:
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    self._event.set()

        for f in futures:
            f.add_done_callback(done)
        self._event.wait(timeout)


def _started(on_start: Callable[[], None] | None, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn``, telling ``on_start`` when it begins."""
    if on_start is None:
        return fn

    def run(*args: object) -> None:
        on_start()
        fn(*args)

    return run


class StreamedFetch:
    """Fetch ``into`` (the stored bytes at ``offset`` of ``file``) in pieces on ``pool``.

    ``ready(n)`` blocks until the first ``n`` bytes are in place (re-raising the fetch's
    error); ``finish()`` waits for the rest and returns the checksum of all of it;
    ``close()`` (always, also after an error) cancels what has not started and waits for what
    has, so nothing writes into ``into`` after it returns.
    """

    def __init__(
        self,
        backend: Backend,
        file: str,
        offset: int,
        into: memoryview,
        pool: ThreadPoolExecutor,
        *,
        piece_bytes: int | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._into = into
        n = len(into)
        step = max(1, piece_bytes or PIECE_BYTES)
        # cut at the file's multiples of step (see ``_scatter.segments``: a GET within one
        # uploaded part costs the store one read)
        cuts = [0, *range(step - offset % step, n, step), n]
        self._bounds = [(a, b) for a, b in itertools.pairwise(cuts) if a < b]
        self._hash = xxhash.xxh3_64()
        self._hashed = 0  # pieces folded into the checksum (a prefix of them)
        self._lock = threading.Lock()
        read = _started(on_start, backend.read_into)
        self._futures: list[Future[None]] = [
            pool.submit(read, file, offset + a, into[a:b]) for a, b in self._bounds
        ]

    @property
    def size(self) -> int:
        return len(self._into)

    def ready(self, n: int) -> None:
        """Block until stored bytes ``0..n`` have arrived (and are in the checksum)."""
        with self._lock:  # one thread hashes: the pieces go into the checksum in order
            while self._hashed < len(self._bounds) and self._bounds[self._hashed][0] < n:
                self._futures[self._hashed].result()
                a, b = self._bounds[self._hashed]
                self._hash.update(self._into[a:b])
                self._hashed += 1

    def finish(self) -> str:
        """Wait for every piece; the checksum of the whole stored chunk (hex, as the index)."""
        self.ready(len(self._into))
        return self._hash.hexdigest()

    def close(self) -> None:
        """Stop: cancel the pieces not started, wait for the running ones (errors dropped)."""
        for f in self._futures:
            f.cancel()
        for f in self._futures:
            if not f.cancelled():
                f.exception()
