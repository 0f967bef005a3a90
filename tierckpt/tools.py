"""Old name of :mod:`tierckpt.offline` (offline operations on stored checkpoints: list,
inspect, verify, copy, collect garbage).

Kept so that code and docs that ``import tierckpt.tools`` keep working; new code imports
:mod:`tierckpt.offline`.
"""

from __future__ import annotations

from tierckpt import offline as _new
from tierckpt.offline import *  # noqa: F403  (the same names, one list: offline.__all__)

__all__ = list(_new.__all__)
