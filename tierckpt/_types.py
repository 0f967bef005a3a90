"""Small shared type aliases."""

from __future__ import annotations

from typing import Any, Union

__all__ = ["BytesLike", "JSON"]

#: anything that exposes contiguous bytes through the buffer protocol
BytesLike = Union[bytes, bytearray, memoryview]
#: a JSON-compatible value (configs, manifests)
JSON = Any
