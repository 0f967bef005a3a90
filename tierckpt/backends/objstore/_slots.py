"""A counting limit taken several at a time: the ranged GETs in flight across every read of
one backend (the rank's share of its node's connections)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Slots:
    """``total`` slots; :meth:`taken` holds ``n`` of them at once (all or none, so two readers
    each holding part of what they need never wait on each other)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"Slots needs at least 1 slot, got {total}")
        self.total = total
        self._free = total
        self._cond = threading.Condition()

    @contextmanager
    def taken(self, n: int) -> Iterator[None]:
        """Hold ``n`` slots (at most :attr:`total`) while the block runs."""
        n = max(1, min(n, self.total))
        with self._cond:
            self._cond.wait_for(lambda: self._free >= n)
            self._free -= n
        try:
            yield
        finally:
            with self._cond:
                self._free += n
                self._cond.notify_all()

    @property
    def free(self) -> int:
        """Slots free now."""
        with self._cond:
            return self._free
