"""Checkpointer: save / load / wait / close — what users touch.

:class:`Checkpointer` (``_checkpointer``) is the facade and the save half; it hands loads to
``_loading`` (list the tiers, agree on a checkpoint, read the first readable copy) and keeps
what ``guard()`` named in ``_guarded`` (which tensors ``save()`` copies at once).
"""

from __future__ import annotations

from tierckpt.checkpointer._checkpointer import Checkpointer

# importable from here before this module became a package; not public API (`as`: exported)
# isort: off
from tierckpt.checkpointer._checkpointer import (
    DEFAULT_CHUNK_BYTES as DEFAULT_CHUNK_BYTES,
)
from tierckpt.checkpointer._loading import LOAD_ATTEMPTS as LOAD_ATTEMPTS
# isort: on

__all__ = ["Checkpointer"]
