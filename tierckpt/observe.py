"""Old name of :mod:`tierckpt.stats` (per-checkpoint, per-tier figures and commit callbacks).

Kept so that code and docs that ``import tierckpt.observe`` keep working; new code imports
:mod:`tierckpt.stats`.
"""

from __future__ import annotations

from tierckpt.stats import CommitCallback, CommitStats, StatsRecorder

__all__ = ["CommitCallback", "CommitStats", "StatsRecorder"]
