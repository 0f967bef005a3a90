"""Saying that a store throttles (S3's ``503 SlowDown``, GCS's and Azure's ``429`` / ``503``).

Throttled requests are retried with backoff and mostly succeed, so nothing fails: saves and
loads only slow down (a field test: a third of the requests throttled, each commit 0.2 s ->
20 s, and not one log line about it). Both drivers tell :func:`throttled` of each throttling
answer they see; it logs one WARNING per store location and :data:`THROTTLE_NOTICE_S`, naming
the knobs that reduce the request rate, and counts the answers between two notices."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["THROTTLE_NOTICE_S", "throttled"]

log = logging.getLogger("tierckpt")

#: at most one notice per location this often (seconds) while the store goes on throttling
THROTTLE_NOTICE_S = 300.0

_lock = threading.Lock()
#: per location: when its last notice was logged (``time.monotonic()``)
_noticed: dict[str, float] = {}
#: per location: throttling answers since its last notice
_since: dict[str, int] = {}


def throttled(url: str, answer: str) -> None:
    """A request to the store at ``url`` (``s3://bucket/prefix``) was answered ``answer``
    (``"503 SlowDown"``): it is retried, or fails after its last attempt."""
    now = time.monotonic()
    with _lock:
        n = _since[url] = _since.get(url, 0) + 1
        last = _noticed.get(url)
        if last is not None and now - last < THROTTLE_NOTICE_S:
            return
        _noticed[url] = now
        _since[url] = 0
    over = "so far" if last is None else f"in the last {now - last:.0f} s"
    log.warning(
        "%s: the store is throttling requests (%s; %d such answer(s) %s): they are retried "
        "with backoff, so saves and loads there slow down. If this lasts, send fewer requests "
        "at once: lower the tier's max_concurrency (parts in flight), raise its part_size "
        "(fewer parts), give each job its own prefix, or save to this tier less often (every=)",
        url,
        answer,
        n,
        over,
    )
