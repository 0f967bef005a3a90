"""Old name of :mod:`tierckpt.stats` (per-checkpoint, per-tier figures and commit callbacks).

Kept so that code and docs that ``import tierckpt.observe`` keep working; new code imports
:mod:`tierckpt.stats`.
"""

from __future__ import annotations

from tierckpt import stats as _new
from tierckpt.stats import *  # noqa: F403  (the same names, one list: stats.__all__)

__all__ = list(_new.__all__)
