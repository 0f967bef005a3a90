"""Which causes of failure each backend has reported already, so that an operator reads one
cause once: a missing bucket fails the timeline's listing, the lease and the save itself, and
logs a WARNING once, then each failed save's ERROR (the save's own outcome, always logged).

A cause is the store's error code and HTTP status where the error has one (the same missing
bucket, whatever the call and object), else the whole message: a different failure is never
taken for one already reported. Remembered per backend object (each ``Checkpointer`` makes
its own), until a save commits there: the same cause coming back later is reported again.
"""

from __future__ import annotations

import logging
import threading
import weakref

from tierckpt.backends.base import Backend

__all__ = ["cause_of", "forget_causes", "report_once", "reported"]

log = logging.getLogger("tierckpt")

_SEEN: weakref.WeakKeyDictionary[Backend, set[str]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def cause_of(exc: BaseException) -> str:
    """What ``exc`` says is wrong, without where: its type with the store's error code and
    status where it has a code (S3/object-store errors), else its type and message."""
    code = getattr(exc, "code", None)
    if isinstance(code, str) and code:
        return f"{type(exc).__name__}:{code}:{getattr(exc, 'status', '')}"
    return f"{type(exc).__name__}:{exc}"


def reported(backend: Backend, exc: BaseException) -> bool:
    """Mark ``exc``'s cause reported on ``backend``; whether it was reported before. A backend
    that cannot be remembered (a test double without hash or weak reference) never was."""
    cause = cause_of(exc)
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
    backend: Backend, exc: BaseException, msg: str, *args: object, level: int = logging.WARNING
) -> None:
    """Log ``msg % args`` at ``level`` the first time ``exc``'s cause is met on ``backend``,
    at DEBUG after that (until :func:`forget_causes`)."""
    log.log(logging.DEBUG if reported(backend, exc) else level, msg, *args, stacklevel=2)


def forget_causes(backend: Backend) -> None:
    """A save committed on ``backend``: whatever failed there before is over."""
    with _LOCK:
        try:
            _SEEN.pop(backend, None)
        except TypeError:
            pass
