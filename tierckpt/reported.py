"""Which causes of failure each backend has reported already, so that an operator reads one
cause once: a missing bucket fails the timeline's listing, the lease and the save itself, and
logs a WARNING once, then each failed save's ERROR (the save's own outcome, always logged).

A cause is the store's error code and HTTP status where the error has one (the same missing
bucket, whatever the call and object), else its ``errno`` where it has one (a folder not
writable, whatever the file), else the whole message: a different failure is never taken for
one already reported. Remembered per backend object (each ``Checkpointer`` makes its own) and
per *topic*, until what the topic is about succeeds there: the same cause coming back later
is reported again. Topics: ``""``, saves (forgotten when a save commits there);
:data:`RETENTION`, the retention pass after each commit (forgotten when a pass completes
there: a commit does not clear it, as every pass follows one); :data:`DCP_PRIVATE`, a tier
that DCP saves skip (a lasting condition, named by a word instead of an error: never
forgotten, so said once per tier object — which a ``TierWriter`` hands on to the next).

:class:`Outage` is for one attempt repeated on its own (a lease renewal on a timer, a PeerTier
round's read of node RAM): its first failure is logged, the next ones at DEBUG, and the first
success after them at INFO, saying how long it failed.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

from tierckpt.backends.base import Backend

__all__ = [
    "DCP_PRIVATE",
    "RETENTION",
    "Outage",
    "cause_of",
    "forget_causes",
    "report_once",
    "reported",
]

log = logging.getLogger("tierckpt")

#: the topic of the retention pass's warnings (skipped, failed)
RETENTION = "retention"
#: the topic of "DCP save skips tier ...: it is private to each process"
DCP_PRIVATE = "dcp-private"

_SEEN: weakref.WeakKeyDictionary[Backend, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def cause_of(exc: BaseException | str) -> str:
    """What ``exc`` says is wrong, without where: its type with the store's error code and
    status where it has a code (S3/object-store errors), else with its ``errno`` where it has
    one (a local disk), else its type and message. A str names a condition: itself."""
    if isinstance(exc, str):
        return exc
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return f"{type(exc).__name__}:{code}:{getattr(exc, 'status', '')}"
    num = getattr(exc, "errno", None)
    if isinstance(num, int) and num:
        return f"{type(exc).__name__}:errno {num}"
    return f"{type(exc).__name__}:{exc}"


def reported(backend: Backend, exc: BaseException | str, *, topic: str = "") -> bool:
    """Mark ``exc``'s cause reported on ``backend`` (under ``topic``); whether it was reported
    before. A backend that cannot be remembered (a test double without hash or weak
    reference) never was."""
    cause = (topic, cause_of(exc))
    with _LOCK:
        try:
            seen = _SEEN.get(backend)
            if seen is None:
                seen = _SEEN[backend] = set()
        except TypeError:
            return False
        if cause in seen:
            return True
        seen.add(cause)
        return False


def report_once(
    backend: Backend,
    exc: BaseException | str,
    msg: str,
    *args: object,
    level: int = logging.WARNING,
    topic: str = "",
) -> None:
    """Log ``msg % args`` at ``level`` the first time ``exc``'s cause is met on ``backend``
    under ``topic``, at DEBUG after that (until :func:`forget_causes` of that topic)."""
    repeat = reported(backend, exc, topic=topic)
    log.log(logging.DEBUG if repeat else level, msg, *args, stacklevel=2)


def forget_causes(backend: Backend, *, topic: str = "") -> None:
    """What ``topic`` is about succeeded on ``backend`` (a save committed; a retention pass
    completed): whatever failed there before under it is over."""
    with _LOCK:
        try:
            seen = _SEEN.get(backend)
        except TypeError:
            return
        if seen is not None:
            seen.difference_update([c for c in seen if c[0] == topic])


class Outage:
    """Reports one attempt that is repeated on its own — a lease renewal on a timer, a
    PeerTier round's read of node RAM — and fails at every try while its cause lasts: the
    first failure of each outage at ``level``, the next ones at DEBUG, and the first success
    after them at INFO. Its caller serializes the calls (one thread, or under its lock)."""

    def __init__(self) -> None:
        #: ``time.monotonic()`` of the outage's first failure; None: the last try worked
        self.since: float | None = None
        #: failed tries of the outage in progress
        self.failures = 0

    def failed(self, msg: str, *args: object, level: int = logging.WARNING) -> None:
        """A try failed: log ``msg % args`` at ``level`` if it is the outage's first."""
        first = self.since is None
        if first:
            self.since = time.monotonic()
        self.failures += 1
        log.log(level if first else logging.DEBUG, msg, *args, stacklevel=2)

    def worked(self, msg: str, *args: object) -> None:
        """A try worked: ends the outage, if any, logging ``msg % args`` at INFO with how
        many tries failed over how long."""
        if self.since is None:
            return
        n, took = self.failures, time.monotonic() - self.since
        self.since, self.failures = None, 0
        log.info(msg + " (%d tries failed over %.1f s)", *args, n, took, stacklevel=2)
