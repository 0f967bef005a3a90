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

import _thread
import threading
from concurrent.futures import ThreadPoolExecutor

__all__ = ["warm"]


def warm(pool: ThreadPoolExecutor, threads: int) -> None:
    """Start up to ``threads`` of ``pool``'s threads in the background; returns at once.

    Each started thread holds a placeholder task until all are started (a thread that
    finished its task early would be reused by the next submit instead of a new one being
    started); the placeholders then end and the threads wait idle for the load's reads. A
    pool shut down meanwhile is left alone."""
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
