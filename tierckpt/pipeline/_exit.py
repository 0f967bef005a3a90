"""Interpreter exit: saves still in flight when the main thread is done get ``exit_timeout_s``
to finish; what is unfinished then is abandoned (never committed, partial files removed by the
writers' ``abort()``) and the threads are stopped before the interpreter tears down. Idle
pipelines left open give their leases back.

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

from tierckpt import config
from tierckpt.pipeline._base import _PipelineBase
from tierckpt.pipeline._leases import RELEASE_WAIT_S
from tierckpt.pipeline._values import _EXIT_ABORT_GRACE_S, DEFAULT_EXIT_TIMEOUT_S, SaveJob

log = logging.getLogger("tierckpt")


class _ExitMixin(_PipelineBase):
    def _drain_at_exit(self, started: float) -> None:
        """Finish in-flight saves by ``started + exit timeout``, else abandon them; then stop
        the threads (bounded). Called once, by :func:`_drain_at_exit`, on the main thread."""
        timeout = exit_timeout_s(self.exit_timeout_s)
        deadline = started + timeout
        jobs = self.in_flight()
        unfinished: list[SaveJob] = []
        try:
            for job in jobs:
                for t in job.handle.tiers:
                    left = max(0.0, deadline - time.monotonic())
                    if not job.handle._tier_events[t].wait(left):
                        unfinished.append(job)
                        break
        except BaseException:  # Ctrl-C while waiting: abandon now
            unfinished = [j for j in jobs if not j.handle.done()]
        if not unfinished:
            if jobs:
                log.warning(
                    "at exit: finished %d in-flight save(s) (step %s)",
                    len(jobs),
                    ", ".join(str(j.step) for j in jobs),
                )
            self.close()
            return
        with self._lock:  # from here no tier copy starts its commit
            self._abandoned = True
            committing = set(self._committing)
        for job in unfinished:
            open_tiers = [t for t in job.handle.tiers if not job.handle.done(t)]
            racing = [t for t in open_tiers if (job.step, t) in committing]
            dropped = [t for t in open_tiers if t not in racing]
            if dropped:
                log.warning(
                    "at exit: abandoned step %d on tier(s) %s after %.0f s "
                    "(TIERCKPT_EXIT_TIMEOUT_S): not committed there; older checkpoints are "
                    "untouched",
                    job.step,
                    ", ".join(dropped),
                    timeout,
                )
            if racing:
                log.warning(
                    "at exit: step %d was committing on tier(s) %s; a commit is atomic, so it "
                    "is there whole or not at all",
                    job.step,
                    ", ".join(racing),
                )
        self._pool.shutdown(wait=False, cancel_futures=True)  # queued encodes are not needed
        with self._lock:
            self._closed = True
        _live.discard(self)
        self._capture_q.put(None)
        # let the writers abort (temporary files, multipart uploads) and the threads end, so
        # none is frozen by the interpreter's teardown in the middle of a tensor copy
        grace_end = time.monotonic() + _EXIT_ABORT_GRACE_S
        for th in self._threads:
            th.join(max(0.0, grace_end - time.monotonic()))
        stuck = [th.name for th in self._threads if th.is_alive()]
        if stuck:
            log.warning("at exit: thread(s) %s still in a storage call; exiting anyway", stuck)
        else:  # nothing of this writer can publish any more: the location is free for the next
            try:
                self._leases.release_all(RELEASE_WAIT_S)
            except Exception as exc:
                log.warning("at exit: could not give the writer leases back: %s", exc)

    # -- deadlines and follower bounds -------------------------------------------------


def exit_timeout_s(configured: float | None = None) -> float:
    """Seconds in-flight saves get at interpreter exit: ``configured``, else
    ``TIERCKPT_EXIT_TIMEOUT_S``, else :data:`DEFAULT_EXIT_TIMEOUT_S` (0: abandon at once)."""
    try:
        return config.exit_timeout_s(configured)
    except ValueError as exc:  # read at interpreter exit too: never raise there
        log.warning("%s; using %.0f", exc, DEFAULT_EXIT_TIMEOUT_S)
        return DEFAULT_EXIT_TIMEOUT_S


#: pipelines not yet closed, drained at interpreter exit (weakly: a dropped one is gone)
_live: weakref.WeakSet[_ExitMixin] = weakref.WeakSet()
_exit_hook_lock = threading.Lock()
_exit_hook_installed = False


def _forget_in_child() -> None:
    """After fork, in the child: the live pipelines are the parent's, copies without their
    threads; the child's exit (a DataLoader worker's, which runs threading's exit hooks)
    must neither drain them nor give their leases back."""
    _live.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _track(pipeline: _ExitMixin) -> None:
    """Remember a live pipeline; install the exit handler on first use."""
    _live.add(pipeline)
    _install_exit_hook()


def _install_exit_hook() -> None:
    global _exit_hook_installed
    with _exit_hook_lock:
        if _exit_hook_installed:
            return
        _exit_hook_installed = True
    # threading's exit hooks run when the main thread is done, before concurrent.futures
    # shuts its executors down (it registered earlier, and these run last-registered first):
    # the encode pool and S3's part uploads still work while saves finish. ``atexit`` would
    # run only after that, too late.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(_drain_at_exit)
        else:  # pragma: no cover - every supported Python has it
            atexit.register(_drain_at_exit)
    except RuntimeError:  # the interpreter is already shutting down
        pass


#: what else exit waits for before the drain: callables giving threads that may still submit
#: saves to a live pipeline (``tierckpt.dcp``'s: DCP's ``async_save`` threads, whose save
#: reaches the pipeline only in ``write_data``); see :func:`wait_at_exit_for`
_EXIT_WAITS: list[Callable[[], list[threading.Thread]]] = []


def wait_at_exit_for(threads: Callable[[], list[threading.Thread]]) -> None:
    """Have interpreter exit wait for the threads ``threads()`` names (bounded by the exit
    timeout, before the drain): a save they are about to submit must find its pipeline open,
    not closed by the drain as idle (or, for a first save, one that concurrent.futures' exit
    no longer lets schedule work). ``threads()`` names only threads that may save through
    this library (it is asked at every exit)."""
    if threads not in _EXIT_WAITS:
        _EXIT_WAITS.append(threads)
    _install_exit_hook()


def _wait_for_submitters(started: float, pipelines: list[_ExitMixin]) -> None:
    """Wait until the threads of :data:`_EXIT_WAITS` end, at most the longest exit timeout
    (of ``pipelines``, or the default one) from ``started``."""
    me = threading.current_thread()
    threads = [th for get in _EXIT_WAITS for th in get() if th is not me and th.is_alive()]
    if not threads:
        return
    timeout = max((exit_timeout_s(p.exit_timeout_s) for p in pipelines), default=exit_timeout_s())
    log.warning(
        "interpreter exit with %d save thread(s) still running (%s): waiting up to %.0f s "
        "for them (TIERCKPT_EXIT_TIMEOUT_S); wait for a dcp.async_save's future before "
        "exiting to wait for it yourself",
        len(threads),
        ", ".join(th.name for th in threads),
        timeout,
    )
    for th in threads:
        th.join(max(0.0, started + timeout - time.monotonic()))
    late = [th.name for th in threads if th.is_alive()]
    if late:
        log.warning("at exit: save thread(s) %s still running after %.0f s", late, timeout)


def _drain_at_exit() -> None:
    """Interpreter exit: finish or abandon every live pipeline's in-flight saves (bounded).

    Never raises and never changes the exit status: that stays the script's own.
    """
    try:
        started = time.monotonic()
        _wait_for_submitters(started, [p for p in list(_live) if not p._closed])
        pipelines = [p for p in list(_live) if not p._closed]
        busy = [(p, p.in_flight()) for p in pipelines]
        steps = sorted({j.step for _p, jobs in busy for j in jobs})
        if steps:
            longest = max(exit_timeout_s(p.exit_timeout_s) for p, jobs in busy if jobs)
            log.warning(
                "interpreter exit with %d save(s) in flight (step %s): waiting up to %.0f s "
                "for them (TIERCKPT_EXIT_TIMEOUT_S); call close() or wait() on the "
                "checkpointer before exiting to wait for them yourself",
                len(steps),
                ", ".join(map(str, steps)),
                longest,
            )
        for p in pipelines:
            p._drain_at_exit(started)
    except BaseException as exc:  # never let the exit hook change how the script ends
        try:
            log.warning("at exit: draining in-flight saves failed: %s", exc)
        except BaseException:
            pass


#: how long exit waits for that (a store that cannot be reached must not hold the exit)
EXIT_RELEASE_SECONDS = 10.0


@atexit.register
def _release_idle_leases() -> None:
    # the live pipelines the exit drain left idle and open: a process that ends without
    # close() would otherwise hold its leases until their ttl runs out on other machines
    idle = [p for p in list(_live) if not p._closed and not p.in_flight()]
    if not idle:
        return

    def release() -> None:
        for p in idle:
            try:
                p._leases.release_all()
            except Exception:  # never fail the interpreter's exit
                pass

    th = threading.Thread(target=release, name="tierckpt-exit", daemon=True)
    th.start()
    th.join(EXIT_RELEASE_SECONDS)
