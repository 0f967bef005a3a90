"""Python's cyclic garbage collector paused while a load builds many small objects.

Parsing a shard's index and rebuilding its tensors create a few Python objects per tensor
(the index's JSON lists, the records, the tensors); the collector, triggered every 700
allocations, then runs a few dozen times in a fresh process's load, each pass walking what the
last ones kept, and finds nothing to free: none of these objects forms a cycle (they are freed
by reference counting). :func:`gc_paused` turns the collector off for such a section only.

Why it is safe: a section holds only CPU work on the loading thread, never a wait on storage,
so other threads' cyclic garbage waits at most that long to be collected; allocation counts
go on while paused, so the collector runs at the next allocation after the pause as the
thresholds say. Sections may nest and run on several threads at once: one count, under a
lock, and the last to leave turns the collector back on, only if it was on when the first
came in, and also when the section raised. (A ``gc.disable()`` by another thread while a
section runs is undone when it ends: it cannot be told from the pause's own.)
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["gc_paused"]

_lock = threading.Lock()
_depth = 0  # sections running, on every thread
_resume = False  # whether the last section to leave turns the collector on


@contextmanager
def gc_paused() -> Iterator[None]:
    """Run the ``with`` block with the cyclic garbage collector off (see the module)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
