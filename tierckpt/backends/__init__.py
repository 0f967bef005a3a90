"""Storage backends: the contract in :mod:`tierckpt.backends.base`, drivers beside it."""

from __future__ import annotations

from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend

__all__ = ["Backend", "LocalBackend", "MemoryBackend", "ObjectWriter", "S3Backend", "validate_name"]


def __getattr__(name: str) -> object:
    # boto3 takes a moment to import: load the S3 driver only when it is asked for
    if name == "S3Backend":
        from tierckpt.backends.s3 import S3Backend

        return S3Backend
    raise AttributeError(name)
