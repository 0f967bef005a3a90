"""Encode an object tree to tagged JSON at save time, tensors handed to the tensor table."""

from __future__ import annotations

import base64
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import math
import os
from collections import OrderedDict
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

import numpy as np
import torch

from tierckpt import limits
from tierckpt._types import JSON
from tierckpt.errors import UnsupportedObject
from tierckpt.tree._common import (
    _DIM_INDEX_BYTES,
    _INDEX_HEADROOM,
    _INT64,
    _NODE_INDEX_BYTES,
    _QSCHEMES,
    _QUANTIZED_INT,
    _STORED_TYPES,
    _TENSOR_INDEX_BYTES,
    KeyPath,
    _int_text,
    _path_str,
    dtype_name,
)
from tierckpt.tree._numpy import encode_ndarray, encode_scalar


def encode_tree(
    obj: object,
    on_tensor: Callable[[torch.Tensor, KeyPath], int],
    *,
    copies: list[int] | None = None,
) -> JSON:
    """Encode ``obj``; each tensor is handed to ``on_tensor(t, path)`` for its table index.

    A NumPy array is handed over as a tensor too: a copy of it taken here, whose table index
    is appended to ``copies`` (a snapshot already: nothing else need copy it).

    Refuses with :class:`UnsupportedObject` naming the key path whatever
    :func:`decode_tree` would refuse or not give back as it was.
    """
    max_nodes, max_depth = limits.MAX_NODES, limits.MAX_DEPTH
    nodes = 0
    size = 0  # index bytes beyond _NODE_INDEX_BYTES per node: strings, bytes, tensor records
    odicts = 0  # OrderedDicts so far, in the order decode_tree meets them
    side: list[JSON] = []  # [ordinal, _metadata] of the OrderedDicts that carry one
    pending: list[tuple[int, object, tuple[object, ...]]] = []  # encoded after the tree
    in_side = False

    def refuse_nodes(path: tuple[object, ...]) -> UnsupportedObject:
        return UnsupportedObject(
            f"state holds more than {max_nodes:,} values (containers, keys, scalars and "
            f"tensors; reached at {_path_str(path)}), more than a reader accepts; store large "
            "sequences of numbers as tensors (torch.tensor(values))"
        )

    def enc(x: Any, path: tuple[object, ...], depth: int) -> JSON:
        nonlocal nodes, size, odicts
        nodes += 1
        if nodes > max_nodes:
            raise refuse_nodes(path)
        if depth > max_depth:
            raise UnsupportedObject(f"state nested deeper than {max_depth} at {_path_str(path)}")
        t = type(x)
        if t is dict or t is OrderedDict:
            return enc_dict(x, t, path, depth)
        if x is None or t is bool:
            return x
        if t is str:
            size += len(encode_basestring_ascii(x))
            return x
        if t is int:
            if -_INT64 <= x < _INT64:
                return x
            text = _int_text(x, _path_str(path))
            size += len(text)
            return {"$int": text}
        if t is float:
            if math.isfinite(x):
                return x
            return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
        if isinstance(x, torch.Tensor):
            if in_side:
                raise UnsupportedObject(f"a tensor in the _metadata at {_path_str(path)}")
            size += _TENSOR_INDEX_BYTES + _DIM_INDEX_BYTES * x.dim()
            if x.is_quantized:
                payload = _quantized(x, path, on_tensor)
                nodes += len(payload)  # each parameter is a node, as decode_tree counts them
                if nodes > max_nodes:
                    raise refuse_nodes(path)
                size += 2 * _TENSOR_INDEX_BYTES
                return {"$qtensor": payload}
            return {"$tensor": on_tensor(x, KeyPath(path))}
        if t is list:
            return [enc(v, (*path, i), depth + 1) for i, v in enumerate(x)]
        if t is tuple:
            return {"$tuple": [enc(v, (*path, i), depth + 1) for i, v in enumerate(x)]}
        if t is bytes:
            size += 4 * ((len(x) + 2) // 3)
            return {"$bytes": base64.b64encode(x).decode("ascii")}
        if t is torch.Size:
            dims = [int(v) for v in x]
            if any(v < 0 for v in dims):
                raise UnsupportedObject(
                    f"torch.Size {tuple(dims)} at {_path_str(path)} has a negative size; "
                    "a reader accepts only sizes >= 0 (store it as a tuple)"
                )
            nodes += len(dims)  # each size is a node, as decode_tree counts them
            if nodes > max_nodes:
                raise refuse_nodes(path)
            return {"$size": dims}
        if t is torch.dtype:
            return {"$dtype": dtype_name(x)}
        if t is torch.device:
            text = str(x)
            size += len(text)
            return {"$device": text}
        if isinstance(x, np.ndarray):
            if in_side:
                raise UnsupportedObject(f"a NumPy array in the _metadata at {_path_str(path)}")
            copy, name = encode_ndarray(x, path)
            nodes += 2  # the record's two fields, as decode_tree counts them
            if nodes > max_nodes:
                raise refuse_nodes(path)
            size += _TENSOR_INDEX_BYTES + _DIM_INDEX_BYTES * copy.dim() + len(name)
            n = on_tensor(copy, KeyPath(path))
            if copies is not None:
                copies.append(n)
            return {"$ndarray": [n, name]}
        if isinstance(x, np.generic):
            payload = encode_scalar(x, path)
            nodes += 2
            if nodes > max_nodes:
                raise refuse_nodes(path)
            size += sum(len(str(p)) for p in payload)
            return {"$npscalar": payload}
        raise UnsupportedObject(
            f"cannot store {t.__module__}.{t.__qualname__} at {_path_str(path)}: tierckpt stores "
            f"{_STORED_TYPES} without pickle; convert this value ({_convert_hint(x)}) before "
            "saving"
        )

    def enc_dict(x: Any, t: type, path: tuple[object, ...], depth: int) -> JSON:
        nonlocal nodes, size, odicts
        meta = None
        if t is OrderedDict:
            ordinal, odicts = odicts, odicts + 1
            meta = _odict_metadata(x, path)
        items: list[JSON] = []
        inner = depth + 1
        # a str key within the limits is encoded inline (the common case: every key of a
        # state_dict); anything else, or a key at a limit, goes through enc, which refuses
        # with the key's path as it always did
        fast_keys = inner <= max_depth
        for k, v in x.items():
            if fast_keys and type(k) is str and nodes < max_nodes:
                nodes += 1
                size += len(encode_basestring_ascii(k))
                key: JSON = k
            else:
                key = enc(k, (*path, _KeyOf(k)), inner)
            items.append([key, enc(v, (*path, k), inner)])
        if meta is not None:
            pending.append((ordinal, meta, (*path, "<_metadata>")))
        return {"$odict" if t is OrderedDict else "$dict": items}

    def side_value(meta: object, path: tuple[object, ...]) -> JSON:
        # decoded as a side table of its own, at depth 1: encoded the same way
        nonlocal in_side, size
        in_side, outer = True, in_side
        try:
            return enc(meta, path, 1)
        finally:
            in_side = outer

    tree = enc(obj, (), 0)
    # after the tree, in order, as decode_tree reads them (a _metadata may add more)
    for ordinal, meta, path in pending:
        side.append([ordinal, side_value(meta, path)])
    if side:
        tree = _WithSideTable.wrap(tree, side)
    size += _NODE_INDEX_BYTES * nodes  # an upper bound of the index's size
    if size > limits.MAX_INDEX_BYTES - _INDEX_HEADROOM:
        raise UnsupportedObject(
            f"state needs an index of up to {size:,} bytes (strings, bytes and {nodes:,} "
            f"values), more than the {limits.MAX_INDEX_BYTES:,} a reader accepts; store large "
            "bytes or sequences as tensors (torch.frombuffer(...), torch.tensor(...))"
        )
    return tree


class _KeyOf:
    """The key-path part that stands for a dict key itself (shown as ``['<key 'k'>']``),
    formatted only if a message shows it: a save walks every key of the state."""

    __slots__ = ("key",)

    def __init__(self, key: object) -> None:
        self.key = key

    def __repr__(self) -> str:
        return repr(f"<key {self.key!r}>")


def _odict_metadata(x: OrderedDict[Any, Any], path: tuple[object, ...]) -> object | None:
    """The ``_metadata`` of an OrderedDict (``state_dict()`` puts the module versions there;
    ``load_state_dict`` of quantized modules needs them), or None. Other attributes would be
    lost: refused."""
    extra = vars(x)
    if not extra:
        return None
    other = sorted(k for k in extra if k != "_metadata")
    if other:
        raise UnsupportedObject(
            f"OrderedDict at {_path_str(path)} has attributes {other}; tierckpt keeps only "
            "state_dict()'s _metadata: move them into the dict"
        )
    meta: object = extra["_metadata"]
    return meta


class _WithSideTable:
    """An encoded tree that carries its side table (``[ordinal, _metadata]`` of OrderedDicts)
    to the index writer, which stores it as the index field ``odict_metadata``: a field old
    readers ignore (they load the dicts without ``_metadata``), unlike a new tag."""

    @staticmethod
    def wrap(tree: JSON, side: list[JSON]) -> JSON:
        # a tree with an OrderedDict in it is a JSON object or array
        out: Any = _TreeDict(tree) if isinstance(tree, dict) else _TreeList(tree)
        out.odict_metadata = side
        return out


class _TreeDict(dict):  # type: ignore[type-arg]
    odict_metadata: list[JSON]


class _TreeList(list):  # type: ignore[type-arg]
    odict_metadata: list[JSON]


def tree_side_table(tree: JSON) -> list[JSON] | None:
    """The ``odict_metadata`` side table an encoded tree carries (None: none)."""
    side = getattr(tree, "odict_metadata", None)
    return side if isinstance(side, list) else None


def _quantized(
    x: torch.Tensor, path: tuple[object, ...], on_tensor: Callable[[torch.Tensor, KeyPath], int]
) -> list[JSON]:
    """The ``$qtensor`` payload: the integer representation goes to the tensor table as a view
    of the same storage (captured lazily, no copy), the parameters into the tree."""
    int_dtype = _QUANTIZED_INT.get(x.dtype)
    if int_dtype is None:
        raise UnsupportedObject(
            f"quantized tensor at {_path_str(path)} is {dtype_name(x.dtype)}, packed below one "
            "byte per value; store x.int_repr() and its parameters, or x.dequantize()"
        )
    scheme = str(x.qscheme()).removeprefix("torch.")
    if scheme not in _QSCHEMES:
        raise UnsupportedObject(
            f"quantized tensor at {_path_str(path)} uses {scheme}; tierckpt stores "
            f"{', '.join(_QSCHEMES)}"
        )
    ints = torch.empty(0, dtype=int_dtype, device=x.device)
    ints.set_(x.untyped_storage(), x.storage_offset(), x.size(), x.stride())
    payload: list[JSON] = [on_tensor(ints, KeyPath(path)), dtype_name(x.dtype), scheme]
    if scheme == "per_tensor_affine":
        scale, zero_point = float(x.q_scale()), int(x.q_zero_point())
        if not math.isfinite(scale):
            raise UnsupportedObject(f"quantized tensor at {_path_str(path)} has scale {scale}")
        return [*payload, scale, zero_point]
    scales = on_tensor(x.q_per_channel_scales(), KeyPath((*path, "<scales>")))
    zero_points = on_tensor(x.q_per_channel_zero_points(), KeyPath((*path, "<zero_points>")))
    return [*payload, scales, zero_points, int(x.q_per_channel_axis())]


def _convert_hint(x: Any) -> str:
    """How to turn ``x`` into something stored, for the kinds of value users save."""
    if isinstance(x, torch.Generator):
        return "a torch.Generator's state: x.get_state(), restored with x.set_state(...)"
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return "a dataclass: dataclasses.asdict(x), rebuilt with its class(**d)"
    if isinstance(x, tuple) and hasattr(x, "_asdict"):
        return "a namedtuple: x._asdict(), rebuilt with its class(**d)"
    for kinds, hint in _KIND_HINTS:
        if isinstance(x, kinds):
            return hint
    if hasattr(x, "__dict__") and type(x).__name__ == "Namespace":
        return "an argparse Namespace: vars(x), rebuilt with argparse.Namespace(**d)"
    return "e.g. with .state_dict(), .tolist() or str()"


#: how to store values of the kinds training scripts keep in their state, where a generic
#: "convert it" leaves the user to guess
_KIND_HINTS: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (enum.Enum, "an Enum member: x.value (or x.name), rebuilt with its class(value)"),
    ((set, frozenset), "a set: sorted(x) (or list(x)), rebuilt with set(...)"),
    (collections.defaultdict, "a defaultdict: dict(x) (its default factory is not stored)"),
    (os.PathLike, "a path: str(x), rebuilt with pathlib.Path(s)"),
    (
        (datetime.datetime, datetime.date, datetime.time),
        "a date or time: x.isoformat(), rebuilt with its class.fromisoformat(s)",
    ),
    (datetime.timedelta, "a timedelta: x.total_seconds(), rebuilt with timedelta(seconds=s)"),
    (complex, "a complex number: [x.real, x.imag] (or a complex tensor)"),
    (
        (fractions.Fraction, decimal.Decimal),
        "a Fraction or Decimal: str(x), rebuilt with its class(s)",
    ),
)
