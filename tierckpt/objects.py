"""Old name of :mod:`tierckpt.tree` (the object-tree encoding: non-tensor state as tagged JSON).

Kept so that code and docs that ``import tierckpt.objects`` keep working; new code imports
:mod:`tierckpt.tree`.
"""

from __future__ import annotations

from tierckpt import tree as _new
from tierckpt.tree import *  # noqa: F403  (the same names, one list: tree.__all__)

__all__ = list(_new.__all__)
