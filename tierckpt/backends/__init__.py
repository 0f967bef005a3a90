"""Storage backends: the contract in :mod:`tierckpt.backends.base`, drivers beside it."""

from __future__ import annotations

from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend

__all__ = ["Backend", "LocalBackend", "MemoryBackend", "ObjectWriter", "validate_name"]
