"""``close()``: finish (or give up) the saves in flight, stop the threads, give the leases
back — without waiting for a call blocked in a store that does not answer.

A tier thread still inside a storage call that made no progress for ``save_deadline`` seconds,
or since a copy of that tier was given up (an upload, an abort, a lease take or a retention
delete in a store that holds every request), is *left behind*: its copies are given up
already (they never commit), ``close()`` returns, and a daemon thread finishes the rest once
the call returns (bounded by the store's timeouts): it gives that tier's lease back, then the
lock files, closes the host arena and the tier's backend. Until then the location stays this
writer's (a new writer on this machine is refused while this process lives; elsewhere it
waits the ttl), so nothing of this writer can publish after another writer took over.
``close(timeout=)`` bounds the whole wait: what is not committed by then is given up on every
tier, except a copy already inside its (atomic) commit.

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import logging
import threading
import time

from tierckpt.errors import CloseTimeout
from tierckpt.pipeline._base import _PipelineBase
from tierckpt.pipeline._exit import _live
from tierckpt.pipeline._leases import RELEASE_WAIT_S
from tierckpt.pipeline._values import Tier

log = logging.getLogger("tierckpt")

#: after ``close(timeout=)`` ran out: how long a thread that is not stalled still gets to end
#: (an idle tier thread ends at once; one writing to a healthy store aborts within this)
END_GRACE_S = 1.0


class _CloseMixin(_PipelineBase):
    def close(self, timeout: float | None = None, *, close_backends: bool = False) -> None:
        """Wait for the saves in flight (at most ``timeout`` seconds, if given: then give up
        what is unfinished), stop the threads and give the leases back; a tier thread blocked
        in a call to a store that made no progress for ``save_deadline`` is left behind (see
        the module docstring). ``close_backends``: close each tier's backend once its thread
        has ended."""
        check_close_timeout(timeout)
        with self._lock:
            if self._closed:
                return
            self._closed = True
        _live.discard(self)  # type: ignore[arg-type]  # a Pipeline is both mixins
        end = None if timeout is None else time.monotonic() + timeout
        if not self.drain(timeout):
            assert timeout is not None
            self._give_up_unfinished(timeout)
        self._capture_q.put(None)
        # the capture thread first (it hands each tier thread its end), then one per tier
        by_thread = dict(zip(self._threads, [None, *(t.name for t in self.tiers)], strict=True))
        left = [th for th in self._threads if not self._join_unless_stalled(th, by_thread[th], end)]
        names = {by_thread[th] for th in left}
        now = time.monotonic()
        self._wind_down(
            [t for t in self.tiers if t.name not in names],
            RELEASE_WAIT_S if end is None else min(RELEASE_WAIT_S, max(end - now, 1.0)),
            everything=not left,
            close_backends=close_backends,
        )
        if self._prebuilt is not None:
            self._prebuilt.discard()
            self._prebuilt = None
        if not left:
            return
        log.warning(
            "close(): thread(s) %s still in a call to its store; returning without waiting "
            "for it: copies not committed there are given up, and "
            "this writer's lease there is given back when the call returns (bounded by the "
            "store's timeouts; if the process ends first, a new writer on another machine "
            "waits out its ttl of %.0f s)",
            ", ".join(th.name for th in left),
            self._leases.ttl,
        )
        threading.Thread(
            target=self._finish_left_behind,
            args=(left, [t for t in self.tiers if t.name in names], close_backends),
            name="tierckpt-close",
            daemon=True,
        ).start()

    def _wind_down(
        self, tiers: list[Tier], wait: float, *, everything: bool, close_backends: bool
    ) -> None:
        """Give back the leases on ``tiers`` (each waited for at most ``wait``) and, with
        ``close_backends``, close their backends; ``everything``: no thread is left behind,
        so the pools are waited for and the lock files and host arena released too."""
        with self._lock:
            commit_pool = self._commit_pool
        if commit_pool is not None:  # each deferred commit is bounded by its timeout
            commit_pool.shutdown(wait=everything)
        self._pool.shutdown(wait=everything, cancel_futures=not everything)
        self._leases.release_all(wait, tiers={t.name for t in tiers}, locks=everything)
        if close_backends:
            for t in tiers:
                _close_backend(t)
        if everything and self.arena is not None:
            self.arena.close()
            self.arena = None

    def _give_up_unfinished(self, timeout: float) -> None:
        """``close(timeout=)`` ran out: no copy starts its commit from now on, and every
        unfinished copy not yet committing is given up (reported on its handle now)."""
        with self._lock:
            self._abandoned = True
            self._abandon_why = f"given up when close(timeout={timeout:g}) ran out"
            jobs = list(self._in_flight)
        self.give_up(
            [
                (
                    tier,
                    job,
                    CloseTimeout(
                        f"{job.id}: not committed on tier {tier.name!r} within "
                        f"close(timeout={timeout:g} s): its copy is given up (never committed "
                        "there); the checkpoints committed before are untouched"
                    ),
                )
                for job in jobs
                for tier in job.tiers
            ]
        )

    def _join_unless_stalled(
        self, th: threading.Thread, name: str | None, end: float | None
    ) -> bool:
        """Wait for ``th`` to end; False (left behind) once its tier made no progress for
        ``save_deadline`` seconds or had a copy given up since it last made progress, or
        (with a timeout) ``END_GRACE_S`` after ``end``."""
        poll = min(1.0, self.save_deadline / 4)
        grace_end = None if end is None else end + END_GRACE_S
        while th.is_alive():
            now = time.monotonic()
            if grace_end is not None and now >= grace_end:
                return False
            with self._lock:
                since = self._stalled_since.get(name) if name in self._busy else None
                gave_up = self._given_up_at.get(name) if name is not None else None
            if since is not None and (
                now - since >= self.save_deadline or (gave_up is not None and gave_up >= since)
            ):
                return False  # stalled that long, or a copy already given up meanwhile
            step = poll if grace_end is None else min(poll, grace_end - now)
            th.join(max(step, 0.0))
        return True

    def _finish_left_behind(
        self, left: list[threading.Thread], stuck: list[Tier], close_backends: bool
    ) -> None:
        """The daemon thread of a close() that left threads behind: once their calls
        returned, what close() did for the others."""
        try:
            for th in left:
                th.join()
            self._wind_down(stuck, RELEASE_WAIT_S, everything=True, close_backends=close_backends)
            log.info("close(): the thread(s) left behind ended; their leases are given back")
        except Exception as exc:  # a daemon thread: say it, never raise
            log.warning("close(): finishing after the threads left behind failed: %s", exc)


def check_close_timeout(timeout: float | None) -> None:
    """Raise ValueError unless ``timeout`` is None or a number of seconds >= 0."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout >= 0:
        raise ValueError(
            f"close(timeout=) must be None (wait for every tier) or seconds >= 0, got {timeout!r}"
        )


def _close_backend(tier: Tier) -> None:
    try:
        tier.backend.close()
    except Exception as exc:
        log.warning("tier %s: closing its backend failed: %s", tier.name, exc)
