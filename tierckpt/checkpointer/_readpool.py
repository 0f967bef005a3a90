"""The load's reader threads, started while the load's first collectives run.

A :class:`~concurrent.futures.ThreadPoolExecutor` starts a thread at a ``submit`` that finds
none idle, and ``Thread.start`` waits until the new thread runs. A load submits its first
reads (node RAM: one checksum per chunk) right after the ranks agreed on a step, so each
submit waited for a thread to be scheduled: on a busy host (four ranks restarting on two
cores) starting four threads cost 25-35 ms of a 0.1 s restore from node RAM. Here the pool's
threads are started by a starter thread of their own as soon as a load begins, while the
calling thread goes on with the listing and the ranks' agreement, so the reads find their
threads waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from tierckpt.restore._fetch import warm

__all__ = ["ReadPool", "warm"]


class ReadPool:
    """A checkpointer's reader threads: made (and warmed) at its first load, ended at
    ``close()``, and after each load that runs once it is closed (a report after training:
    nobody would end them then). Never under a load: a ``close()`` from another thread
    while one reads ends them once the loads in :meth:`in_use` are over (it failed them
    with "cannot schedule new futures after shutdown")."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._users = 0
        self._end_when_idle = False

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """A load: the threads end only after it (see :meth:`release`)."""
        with self._lock:
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                ending = self._users == 0 and self._end_when_idle
                pool = self._pool if ending else None
                if ending:
                    self._pool, self._end_when_idle = None, False
            if pool is not None:
                pool.shutdown()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tierckpt-read")
                warm(self._pool, self.threads)
            return self._pool

    def release(self) -> None:
        """End the threads: now, or when the last load in use ends."""
        with self._lock:
            if self._users:
                self._end_when_idle = True
                return
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown()
