"""Small shared type aliases."""

from __future__ import annotations

from typing import Any, TypeAlias, Union

__all__ = ["JSON", "BytesLike", "JSONValue"]

#: anything that exposes contiguous bytes through the buffer protocol
BytesLike = Union[bytes, bytearray, memoryview]

#: what a JSON document holds (configs, manifests, indexes, metadata): ``null``, booleans,
#: numbers, strings, arrays and objects with string keys, nested to any depth
JSONValue: TypeAlias = Union[bool, int, float, str, list["JSONValue"], dict[str, "JSONValue"], None]

#: a :data:`JSONValue` as the code uses it: typed ``Any`` so that a field read out of a parsed
#: document (``config["level"]``) is usable without a cast at every step. Parsed documents are
#: checked by value where they are read (:mod:`tierckpt.jsonbound`, the format parsers), not by
#: the type checker; annotate a value with :data:`JSONValue` where that precision helps.
JSON: TypeAlias = Any
