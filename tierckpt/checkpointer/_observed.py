"""What a :class:`~tierckpt.Checkpointer` tells of its saves: the commit history and the
callbacks on each outcome (see :mod:`tierckpt.stats`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tierckpt.handle import TierResult
from tierckpt.stats import CheckpointEvent, CommitStats, StatsRecorder

__all__ = ["Observed"]


class Observed:
    """The stats and callback methods, over ``self._stats``."""

    _stats: StatsRecorder

    def stats(self, *, failures: bool = False) -> list[CommitStats]:
        """One :class:`CommitStats` per checkpoint per tier committed so far, oldest first.

        Step, tier, raw and stored bytes, seconds from ``save()`` to the commit, GB/s,
        compression ratio and the seconds training was blocked by that save. The history is
        bounded (``stats_history``, default the last 1000 commits). ``failures=True`` also
        lists each copy that failed, was skipped or given up, and each skipped save
        (``outcome``, ``error``; zero bytes), in the order they happened.
        """
        return self._stats.stats(failures=failures)

    def add_event_callback(
        self, fn: Callable[[CheckpointEvent], Any]
    ) -> Callable[[CheckpointEvent], Any]:
        """Call ``fn(event)`` for every outcome of every save on every tier (commits,
        failures, skips, deadline give-ups; see :class:`~tierckpt.stats.CheckpointEvent`)."""
        return self._stats.add_event_callback(fn)

    def remove_event_callback(self, fn: Callable[[CheckpointEvent], Any]) -> None:
        self._stats.remove_event_callback(fn)

    def add_callback(self, fn: Callable[[TierResult], Any]) -> Callable[[TierResult], Any]:
        """Call ``fn(result)`` on every commit on every tier (see :mod:`tierckpt.stats`)."""
        return self._stats.add_callback(fn)

    def remove_callback(self, fn: Callable[[TierResult], Any]) -> None:
        self._stats.remove_callback(fn)
