"""Helper threads that copy part of each host chunk alongside the capture thread.

One thread copying host memory reaches a fraction of the memory bandwidth two reach (and on
a shared host gets one thread's share of the cores): torch's own copy, which DCP's stager
uses, splits a large copy over its intra-op threads. So while one save is captured, its
host chunks are split in byte ranges copied at once by the capture thread and
``threads - 1`` helpers. The helpers live for one capture (a thread start per save), so
nothing outlives the save or needs shutting down with the writer.

Part of :class:`~tierckpt.pipeline.Pipeline`."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import TracebackType

__all__ = ["MAX_COPY_THREADS", "CopyTeam", "copy_threads"]

#: at most this many threads copy one chunk (the capture thread included)
MAX_COPY_THREADS = 4

_Task = tuple[Callable[[], None], "Future[None]"] | None


def copy_threads() -> int:
    """Threads for copying host chunks: the cores this process may run on, at most
    :data:`MAX_COPY_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_COPY_THREADS))


class CopyTeam:
    """The capture thread plus ``threads - 1`` helper threads, for one save's capture."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._q: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._helpers = [
            threading.Thread(target=self._work, name="tierckpt-copy", daemon=True)
            for _ in range(self.threads - 1)
        ]
        for th in self._helpers:
            th.start()

    def _work(self) -> None:
        while True:
            task = self._q.get()
            if task is None:
                return
            fn, fut = task
            try:
                fn()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def run(self, parts: Sequence[Callable[[], None]]) -> None:
        """Run every part: the first on this thread, the others on the helpers; return when
        all are done, raising the first error (after every part has finished, so no helper
        still writes into the slot when the caller releases it)."""
        if not self._helpers:
            for fn in parts:
                fn()
            return
        futures: list[Future[None]] = []
        for fn in parts[1:]:
            fut: Future[None] = Future()
            self._q.put((fn, fut))
            futures.append(fut)
        error: BaseException | None = None
        try:
            if parts:
                parts[0]()
        except BaseException as exc:
            error = exc
        for fut in futures:
            failed = fut.exception()  # waits for it
            if failed is not None and error is None:
                error = failed
        if error is not None:
            raise error

    def close(self) -> None:
        for _ in self._helpers:
            self._q.put(None)
        for th in self._helpers:
            th.join()

    def __enter__(self) -> CopyTeam:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
