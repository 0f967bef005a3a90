"""Helper threads that copy part of each host chunk alongside the capture thread.

One thread copying host memory reaches a fraction of the memory bandwidth two reach (and on
a shared host gets one thread's share of the cores): torch's own copy, which DCP's stager
uses, splits a large copy over its intra-op threads. So while training waits for a capture,
its host chunks are split in byte ranges copied at once by the capture thread and
``threads - 1`` helpers.

That holds while training computes too (a lazy capture): copying with the capture thread
alone, to leave training the other cores, made every-step training slower here (2 cores,
torch on both: 1.13-1.20x of no checkpointing against 1.05-1.07x split, interleaved in one
process). Torch's intra-op threads meet at a barrier after each operator, so one background
thread slowing one of them stalls all of them; the same copy spread over every core is over
in a fraction of the time and stalls them for less.

The helpers belong to the pipeline, not to one save: they are started on the first split
copy and reused by every later one (a checkpoint every step does not start threads every
step), and each exits after :data:`IDLE_S` without work, or when the capture thread closes
the team at the writer's close.

Part of :class:`~tierckpt.pipeline.Pipeline`."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from types import TracebackType

__all__ = ["IDLE_S", "MAX_COPY_THREADS", "CopyTeam", "copy_threads"]

#: at most this many threads copy one chunk (the capture thread included)
MAX_COPY_THREADS = 4

#: a helper with no copy for this long exits (the next split copy starts it again)
IDLE_S = 5.0

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
    """The calling thread plus up to ``threads - 1`` helper threads, reused across runs."""

    def __init__(self, threads: int, idle_s: float | None = None) -> None:
        self.threads = max(1, threads)
        self.idle_s = IDLE_S if idle_s is None else idle_s
        self._q: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _helpers and every put, so idle exits see them
        self._helpers: list[threading.Thread] = []
        self._closed = False
        #: helper threads started so far, for tests and diagnostics
        self.started = 0

    @property
    def live(self) -> int:
        """Helper threads alive now."""
        with self._lock:
            return len(self._helpers)

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            try:
                task = self._q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if not self._q.empty():
                        continue  # a task was put before this helper could leave: take it
                    self._helpers.remove(me)
                    return
            if task is None:
                with self._lock:
                    self._helpers.remove(me)
                return
            fn, fut = task
            try:
                fn()
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def _submit(self, parts: Sequence[Callable[[], None]]) -> list[Future[None]]:
        """Queue ``parts`` for the helpers, starting helpers up to one per part."""
        futures: list[Future[None]] = []
        with self._lock:
            if self._closed:
                raise RuntimeError("the copy team is closed")
            want = min(len(parts), self.threads - 1)
            while len(self._helpers) < want:
                th = threading.Thread(target=self._work, name="tierckpt-copy", daemon=True)
                self._helpers.append(th)
                self.started += 1
                th.start()
            for fn in parts:
                fut: Future[None] = Future()
                self._q.put((fn, fut))
                futures.append(fut)
        return futures

    def run(self, parts: Sequence[Callable[[], None]]) -> None:
        """Run every part: the first on this thread, the others on the helpers; return when
        all are done, raising the first error (after every part has finished, so no helper
        still writes into the slot when the caller releases it)."""
        if self.threads == 1 or len(parts) <= 1:
            for fn in parts:
                fn()
            return
        futures = self._submit(parts[1:])
        error: BaseException | None = None
        try:
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
        """Stop the helpers (each finishes the copy it is doing first); idempotent."""
        with self._lock:
            self._closed = True
            helpers = list(self._helpers)
            for _ in helpers:
                self._q.put(None)
        for th in helpers:
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
