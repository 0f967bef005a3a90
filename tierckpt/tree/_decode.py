"""Decode tagged JSON back into objects, every tag checked, depth and node count bounded."""

from __future__ import annotations

import base64
import binascii
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from tierckpt import limits
from tierckpt._types import JSON
from tierckpt.errors import FormatError
from tierckpt.tree._common import (
    _INT64,
    _QSCHEMES,
    _QUANTIZED_INT,
    DTYPES,
    dtype_from_name,
    dtype_name,
)
from tierckpt.tree._numpy import decode_ndarray, decode_scalar


def decode_tree(
    data: JSON,
    tensors: list[torch.Tensor] | Callable[[int], Any],
    *,
    items: int | None = None,
    odict_metadata: JSON = None,
) -> Any:
    """Inverse of :func:`encode_tree`; ``tensors`` maps a tensor index to its value.

    ``odict_metadata``: the index's side table, ``[[ordinal, _metadata], ...]``: the
    ``_metadata`` of the ordinal-th OrderedDict (in the order they are met). ``items``: the
    JSON items (values and keys) the index declares for the tree and its side table; they must
    hold exactly that many (the index's memory budget was computed from it).
    """
    max_nodes, max_depth = limits.MAX_NODES, limits.MAX_DEPTH
    count = 0
    seen = 0  # JSON items, counted as jsonbound.scan counts them
    odicts: list[Any] = []

    def tensor(i: object) -> Any:
        if type(i) is not int or i < 0:
            raise FormatError(f"bad tensor reference {i!r}")
        if callable(tensors):
            return tensors(i)
        if i >= len(tensors):
            raise FormatError(f"tensor reference {i} out of range ({len(tensors)} tensors)")
        return tensors[i]

    def pairs(v: JSON, depth: int) -> list[tuple[Any, Any]]:
        nonlocal seen
        if not isinstance(v, list):
            raise FormatError("dict items must be a list of [key, value] pairs")
        out = []
        for p in v:
            if not isinstance(p, list) or len(p) != 2:
                raise FormatError("dict items must be [key, value] pairs")
            seen += 1
            k = dec(p[0], depth + 1)
            try:
                hash(k)
            except TypeError:
                raise FormatError(f"unhashable dict key of type {type(k).__name__}") from None
            out.append((k, dec(p[1], depth + 1)))
        return out

    def more_nodes(n: int) -> None:
        nonlocal count
        count += n
        if count > max_nodes:
            raise FormatError(f"object tree too large (more than {max_nodes:,} values)")

    def dec(x: JSON, depth: int) -> Any:
        nonlocal count, seen
        count += 1
        seen += 1
        if count > max_nodes or depth > max_depth:
            raise FormatError(f"object tree too large or deeper than {max_depth}")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return x
        if isinstance(x, list):
            seen += not x
            return [dec(v, depth + 1) for v in x]
        if not isinstance(x, dict) or len(x) != 1:
            raise FormatError(f"malformed object node {str(x)[:80]!r}")
        ((tag, v),) = x.items()
        seen += 2 + (v == [])  # the tag and its value (an empty list counts one more)
        if tag == "$tensor":
            return tensor(v)
        if tag == "$tuple":
            if not isinstance(v, list):
                raise FormatError("$tuple needs a list")
            return tuple(dec(e, depth + 1) for e in v)
        if tag == "$dict":
            return dict(pairs(v, depth))
        if tag == "$odict":
            odicts.append(None)  # its ordinal is taken before its children's
            at = len(odicts) - 1
            odicts[at] = OrderedDict(pairs(v, depth))
            return odicts[at]
        if tag == "$int":
            if not isinstance(v, str) or len(v) > limits.MAX_INT_DIGITS + 1:
                raise FormatError(
                    f"bad $int: needs a decimal string of at most {limits.MAX_INT_DIGITS} digits"
                )
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
            seen += len(v)
            more_nodes(len(v))
            return torch.Size(v)
        if tag == "$dtype":
            return dtype_from_name(v)
        if tag == "$device":
            if not isinstance(v, str) or len(v) > limits.MAX_DEVICE_CHARS:
                raise FormatError("bad $device")
            try:
                return torch.device(v)
            except RuntimeError:
                raise FormatError(f"bad $device {v!r}") from None
        if tag == "$qtensor":
            if not isinstance(v, list) or len(v) not in (5, 6):
                raise FormatError("$qtensor needs [tensor, dtype, qscheme, parameters...]")
            seen += len(v)
            more_nodes(len(v))
            return _dequantized_ref(v, tensor, callable(tensors))
        if tag == "$ndarray" or tag == "$npscalar":
            if not isinstance(v, list) or len(v) != 2:
                raise FormatError(
                    f"{tag} needs " + ("[tensor, dtype]" if tag == "$ndarray" else "[dtype, bytes]")
                )
            seen += 2
            more_nodes(2)
            if tag == "$npscalar":
                return decode_scalar(v)
            return decode_ndarray(v, tensor, callable(tensors))
        raise FormatError(
            f"unknown tag {str(tag)[:40]!r} in object tree (written by a newer tierckpt? "
            "upgrade tierckpt to read it)"
        )

    out = dec(data, 0)
    if odict_metadata is not None:
        if not isinstance(odict_metadata, list):
            raise FormatError("odict_metadata must be a list of [ordinal, _metadata]")
        seen += 1 + (not odict_metadata)
        last = -1
        for entry in odict_metadata:
            if not isinstance(entry, list) or len(entry) != 2:
                raise FormatError("odict_metadata entries must be [ordinal, _metadata]")
            k = entry[0]
            if type(k) is not int or not last < k < len(odicts):
                raise FormatError(f"odict_metadata: bad ordinal {k!r} ({len(odicts)} OrderedDicts)")
            seen += 2
            odicts[k]._metadata = dec(entry[1], 1)
            last = k
    if items is not None and seen != items:
        raise FormatError(f"object tree holds {seen:,} JSON items, the index declares {items:,}")
    return out


def _dequantized_ref(v: list[Any], tensor: Callable[[object], Any], placeholders: bool) -> Any:
    """Rebuild a quantized tensor from a ``$qtensor`` payload (validated: it is untrusted)."""
    ints = tensor(v[0])
    name, scheme = v[1], v[2]
    qdtype = DTYPES.get(name) if isinstance(name, str) else None
    if qdtype not in _QUANTIZED_INT or not isinstance(scheme, str) or scheme not in _QSCHEMES:
        raise FormatError(f"$qtensor: bad quantized dtype {name!r} or qscheme {scheme!r}")
    per_tensor = scheme == "per_tensor_affine"
    if len(v) != (5 if per_tensor else 6):
        raise FormatError(f"$qtensor: {scheme} takes {3 if per_tensor else 4} fields, not {len(v)}")
    if per_tensor:
        scale, zero_point = v[3], v[4]
        if type(scale) is not float or not math.isfinite(scale):
            raise FormatError(f"$qtensor: bad scale {scale!r}")
        if type(zero_point) is not int or not -_INT64 <= zero_point < _INT64:
            raise FormatError(f"$qtensor: bad zero point {zero_point!r}")
    else:
        scales, zero_points, axis = tensor(v[3]), tensor(v[4]), v[5]
    if placeholders:
        return ints
    if not isinstance(ints, torch.Tensor) or ints.dtype != _QUANTIZED_INT[qdtype]:
        raise FormatError(
            f"$qtensor: the integer representation of a {name} tensor is not "
            f"{dtype_name(_QUANTIZED_INT[qdtype])}"
        )
    try:
        if per_tensor:
            return torch._make_per_tensor_quantized_tensor(ints, float(scale), zero_point)
        if (
            type(axis) is not int
            or not 0 <= axis < ints.dim()
            or not all(
                isinstance(p, torch.Tensor) and p.dim() == 1 and p.numel() == ints.shape[axis]
                for p in (scales, zero_points)
            )
        ):
            raise FormatError(f"$qtensor: per-channel parameters do not fit axis {axis!r}")
        return torch._make_per_channel_quantized_tensor(ints, scales, zero_points, axis)
    except (RuntimeError, TypeError, ValueError) as exc:
        if isinstance(exc, FormatError):
            raise
        raise FormatError(f"$qtensor: cannot rebuild the quantized tensor ({exc})") from None
