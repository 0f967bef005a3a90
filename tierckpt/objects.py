"""Non-tensor state without pickle: a small tagged-JSON schema.

Every value is encoded to JSON that a loader can read back without executing anything:

=================  ==========================================================
Python value        JSON
=================  ==========================================================
None, bool, str     themselves
int                 a JSON number when it fits in 64 bits, else ``{"$int": "..."}``
float               a JSON number when finite, else ``{"$float": "nan"|"inf"|"-inf"}``
list                a JSON array
tuple               ``{"$tuple": [...]}``
dict                ``{"$dict": [[key, value], ...]}`` (any supported key type, order kept)
OrderedDict         ``{"$odict": [[key, value], ...]}``
bytes               ``{"$bytes": "<base64>"}``
torch.Size          ``{"$size": [ints]}``
torch.dtype         ``{"$dtype": "float32"}``
torch.device        ``{"$device": "cuda:0"}``
torch.Tensor        ``{"$tensor": n}`` — the n-th entry of the shard index's tensor table
=================  ==========================================================

Any other object is refused at save time with :class:`~tierckpt.errors.UnsupportedObject`
naming its key path and type. Decoding checks every tag, bounds the depth and the number of
nodes, and refuses anything else with :class:`~tierckpt.errors.FormatError`.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from tierckpt._types import JSON
from tierckpt.errors import FormatError, UnsupportedObject

__all__ = ["DTYPES", "KeyPath", "decode_tree", "dtype_from_name", "dtype_name", "encode_tree"]

MAX_DEPTH = 200
MAX_NODES = 10_000_000
_INT64 = 2**63

#: every dtype this torch build knows, by its short name ("float32", "bfloat16", ...)
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES:
        raise FormatError(f"unknown dtype {name!r} (this torch knows {len(DTYPES)} dtypes)")
    return DTYPES[name]


def _path_str(path: tuple[object, ...]) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


class KeyPath:
    """A key path formatted only when shown (an error message): a save walks every tensor's
    path, and formatting each one eagerly cost more than the rest of the walk."""

    __slots__ = ("_parts",)

    def __init__(self, parts: tuple[object, ...]) -> None:
        self._parts = parts

    def __str__(self) -> str:
        return _path_str(self._parts)

    __format__ = object.__format__

    def __repr__(self) -> str:
        return f"KeyPath({self})"


def encode_tree(obj: object, on_tensor: Callable[[torch.Tensor, KeyPath], int]) -> JSON:
    """Encode ``obj``; each tensor is handed to ``on_tensor(t, path)`` for its table index."""

    def enc(x: Any, path: tuple[object, ...], depth: int) -> JSON:
        if depth > MAX_DEPTH:
            raise UnsupportedObject(f"state nested deeper than {MAX_DEPTH} at {_path_str(path)}")
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return x if -_INT64 <= x < _INT64 else {"$int": str(x)}
        if t is float:
            if math.isfinite(x):
                return x
            return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(x, torch.Tensor):
            return {"$tensor": on_tensor(x, KeyPath(path))}
        if t is list:
            return [enc(v, (*path, i), depth + 1) for i, v in enumerate(x)]
        if t is tuple:
            return {"$tuple": [enc(v, (*path, i), depth + 1) for i, v in enumerate(x)]}
        if t is dict or t is OrderedDict:
            items = [
                [enc(k, (*path, f"<key {k!r}>"), depth + 1), enc(v, (*path, k), depth + 1)]
                for k, v in x.items()
            ]
            return {"$odict" if t is OrderedDict else "$dict": items}
        if t is bytes:
            return {"$bytes": base64.b64encode(x).decode("ascii")}
        if t is torch.Size:
            return {"$size": [int(v) for v in x]}
        if t is torch.dtype:
            return {"$dtype": dtype_name(x)}
        if t is torch.device:
            return {"$device": str(x)}
        raise UnsupportedObject(
            f"cannot store {t.__module__}.{t.__qualname__} at {_path_str(path)}: tierckpt stores "
            "tensors, dict, OrderedDict, list, tuple, str, int, float, bool, None, bytes, "
            "torch.Size, torch.dtype and torch.device without pickle; convert this value "
            "(e.g. with .state_dict(), .tolist() or str()) before saving"
        )

    return enc(obj, (), 0)


def decode_tree(data: JSON, tensors: list[torch.Tensor] | Callable[[int], Any]) -> Any:
    """Inverse of :func:`encode_tree`; ``tensors`` maps a tensor index to its value."""
    count = 0

    def tensor(i: object) -> Any:
        if type(i) is not int or i < 0:
            raise FormatError(f"bad tensor reference {i!r}")
        if callable(tensors):
            return tensors(i)
        if i >= len(tensors):
            raise FormatError(f"tensor reference {i} out of range ({len(tensors)} tensors)")
        return tensors[i]

    def pairs(v: JSON, depth: int) -> list[tuple[Any, Any]]:
        if not isinstance(v, list):
            raise FormatError("dict items must be a list of [key, value] pairs")
        out = []
        for p in v:
            if not isinstance(p, list) or len(p) != 2:
                raise FormatError("dict items must be [key, value] pairs")
            k = dec(p[0], depth + 1)
            try:
                hash(k)
            except TypeError:
                raise FormatError(f"unhashable dict key of type {type(k).__name__}") from None
            out.append((k, dec(p[1], depth + 1)))
        return out

    def dec(x: JSON, depth: int) -> Any:
        nonlocal count
        count += 1
        if count > MAX_NODES or depth > MAX_DEPTH:
            raise FormatError(f"object tree too large or deeper than {MAX_DEPTH}")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, list):
            return [dec(v, depth + 1) for v in x]
        if not isinstance(x, dict) or len(x) != 1:
            raise FormatError(f"malformed object node {str(x)[:80]!r}")
        ((tag, v),) = x.items()
        if tag == "$tensor":
            return tensor(v)
        if tag == "$tuple":
            if not isinstance(v, list):
                raise FormatError("$tuple needs a list")
            return tuple(dec(e, depth + 1) for e in v)
        if tag == "$dict":
            return dict(pairs(v, depth))
        if tag == "$odict":
            return OrderedDict(pairs(v, depth))
        if tag == "$int":
            if not isinstance(v, str) or len(v) > 10_000:
                raise FormatError("$int needs a decimal string")
            try:
                return int(v)
            except ValueError:
                raise FormatError(f"bad $int {v[:40]!r}") from None
        if tag == "$float":
            if v not in ("nan", "inf", "-inf"):
                raise FormatError(f"bad $float {v!r}")
            return float(v)
        if tag == "$bytes":
            if not isinstance(v, str):
                raise FormatError("$bytes needs a base64 string")
            try:
                return base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise FormatError("bad base64 in $bytes") from None
        if tag == "$size":
            if not isinstance(v, list) or not all(type(e) is int and e >= 0 for e in v):
                raise FormatError("$size needs a list of non-negative ints")
            return torch.Size(v)
        if tag == "$dtype":
            return dtype_from_name(v)
        if tag == "$device":
            if not isinstance(v, str) or len(v) > 64:
                raise FormatError("bad $device")
            try:
                return torch.device(v)
            except RuntimeError:
                raise FormatError(f"bad $device {v!r}") from None
        raise FormatError(f"unknown tag {tag!r} in object tree")

    return dec(data, 0)
