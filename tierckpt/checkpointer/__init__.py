"""Checkpointer: save / load / wait / close — what users touch.

:class:`Checkpointer` (``_checkpointer``) is the facade: the public API. Its save machinery
is its base class in ``_saving`` (start a save, the pipeline's callbacks, the optimizer step's
wait); it hands loads to ``_loading`` (list the tiers, agree on a checkpoint, read the first
readable copy), keeps what ``guard()`` named in ``_guarded`` (which tensors ``save()`` copies
at once) and pins and protected steps in ``_retention``.
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
