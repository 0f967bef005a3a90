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
quantized tensor    ``{"$qtensor": [n, "qint8", qscheme, ...parameters]}`` (below)
=================  ==========================================================

A quantized tensor is stored as its integer representation (entry ``n``, a uint8 / int8 / int32
view of the same storage, captured lazily like any tensor) and its quantization parameters:
``per_tensor_affine`` adds ``scale, zero_point``; ``per_channel_affine`` and
``per_channel_affine_float_qparams`` add the table entries of the per-channel scales and zero
points and the axis. Loading rebuilds the quantized tensor with torch's own constructors.

The limits are shared with the reader (:mod:`tierckpt.limits`): encoding counts nodes and depth
exactly as decoding does and refuses, at save time with
:class:`~tierckpt.errors.UnsupportedObject` naming the key path, anything a reader would refuse
(too many nodes, too deep, an int of more digits than a reader converts, a negative
``torch.Size``, an index larger than a reader accepts) or that would not come back as it was.
Decoding checks every tag, bounds the depth and the number of nodes, and refuses anything else
with :class:`~tierckpt.errors.FormatError`.

The user's ``save(..., metadata=...)`` is plain JSON in the manifest; :func:`encode_metadata`
refuses at save time what JSON would not give back as it was (non-str keys, tuples, NaN, other
types) and what is larger than a reader accepts.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections import OrderedDict
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any

import torch

from tierckpt import limits
from tierckpt._types import JSON
from tierckpt.errors import FormatError, UnsupportedObject

__all__ = [
    "DTYPES",
    "MAX_DEPTH",
    "MAX_NODES",
    "KeyPath",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "encode_metadata",
    "encode_tree",
    "tree_side_table",
]

#: kept for importers; the limits themselves live in :mod:`tierckpt.limits`
MAX_DEPTH = limits.MAX_DEPTH
MAX_NODES = limits.MAX_NODES
_INT64 = 2**63

#: every dtype this torch build knows, by its short name ("float32", "bfloat16", ...)
DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}

#: quantized dtypes stored through their integer representation (sub-byte ones are packed two
#: or four to a byte, so their shape does not describe their storage: refused)
_QUANTIZED_INT: dict[torch.dtype, torch.dtype] = {
    torch.quint8: torch.uint8,
    torch.qint8: torch.int8,
    torch.qint32: torch.int32,
}
_QSCHEMES: dict[str, torch.qscheme] = {
    "per_tensor_affine": torch.per_tensor_affine,
    "per_channel_affine": torch.per_channel_affine,
    "per_channel_affine_float_qparams": torch.per_channel_affine_float_qparams,
}
#: index bytes one tensor can take besides its tree node: its tensor record (about 40 bytes
#: per dimension), its storage record and a share of the chunk table
_TENSOR_INDEX_BYTES = 256
_DIM_INDEX_BYTES = 40
#: index bytes of a node besides its strings (a number is at most 24 characters, a tag such as
#: {"$dtype":"float8_e4m3fnuz"} 29, a [key, value] pair's brackets are shared by two nodes)
_NODE_INDEX_BYTES = 40
#: index bytes that are not the tree or the tensor table (header, codecs, chunks)
_INDEX_HEADROOM = 1 << 20
_STORED_TYPES = (
    "tensors, dict, OrderedDict, list, tuple, str, int, float, bool, None, bytes, "
    "torch.Size, torch.dtype and torch.device"
)


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


def _int_text(x: int, where: str) -> str:
    """``str(x)`` for an int a reader converts back (at most MAX_INT_DIGITS digits)."""
    digits = limits.MAX_INT_DIGITS
    # at most 3.33 bits per digit: far bigger ints are refused without converting them
    if x.bit_length() <= digits * 4:
        try:
            text = str(x)
        except ValueError:  # this interpreter converts fewer digits (sys.set_int_max_str_digits)
            text = ""
        if text and len(text) - (x < 0) <= digits:
            return text
    raise UnsupportedObject(
        f"int at {where} has more than {digits} decimal digits, more than a reader converts; "
        "store it as bytes (x.to_bytes(...)) or as a str"
    )


def encode_tree(obj: object, on_tensor: Callable[[torch.Tensor, KeyPath], int]) -> JSON:
    """Encode ``obj``; each tensor is handed to ``on_tensor(t, path)`` for its table index.

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
        if t is dict or t is OrderedDict:
            meta = None
            if t is OrderedDict:
                ordinal, odicts = odicts, odicts + 1
                meta = _odict_metadata(x, path)
            items = [
                [enc(k, (*path, f"<key {k!r}>"), depth + 1), enc(v, (*path, k), depth + 1)]
                for k, v in x.items()
            ]
            if meta is not None:
                pending.append((ordinal, meta, (*path, "<_metadata>")))
            return {"$odict" if t is OrderedDict else "$dict": items}
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
        raise UnsupportedObject(
            f"cannot store {t.__module__}.{t.__qualname__} at {_path_str(path)}: tierckpt stores "
            f"{_STORED_TYPES} without pickle; convert this value (e.g. with .state_dict(), "
            ".tolist() or str()) before saving"
        )

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


def encode_metadata(metadata: object) -> dict[str, JSON]:
    """Check ``save(..., metadata=...)`` and return a copy of it (frozen at ``save()``).

    Metadata is stored as plain JSON in the manifest, so it must come back from JSON as it
    was: a dict with str keys whose values are None, bool, int, finite float, str, list or
    such dicts, within the tree's limits, at most MAX_METADATA_BYTES as compact JSON.
    Anything else raises :class:`UnsupportedObject` naming its key path.
    """
    if metadata is None:
        return {}
    max_nodes, max_depth = limits.MAX_NODES, limits.MAX_DEPTH
    nodes = 0

    def copy(x: Any, path: tuple[object, ...], depth: int) -> JSON:
        nonlocal nodes
        nodes += 1
        where = "metadata" + _path_str(path).removeprefix("<root>")
        if nodes > max_nodes or depth > max_depth:
            raise UnsupportedObject(
                f"{where}: metadata holds more than {max_nodes:,} values or nests deeper "
                f"than {max_depth}"
            )
        t = type(x)
        if x is None or t is bool or t is str:
            return x
        if t is int:
            return int(_int_text(x, where))
        if t is float:
            if not math.isfinite(x):
                raise UnsupportedObject(f"{where}: {x} cannot be stored in JSON metadata")
            return x
        if t is list:
            return [copy(v, (*path, i), depth + 1) for i, v in enumerate(x)]
        if t is dict:
            out = {}
            for k, v in x.items():
                if type(k) is not str:
                    raise UnsupportedObject(
                        f"{where}: metadata key {k!r} is a {type(k).__name__}; JSON keys are "
                        "str (it would come back as a str): convert the key"
                    )
                out[k] = copy(v, (*path, k), depth + 1)
            return out
        hint = " (it would come back as a list: pass a list)" if t is tuple else ""
        raise UnsupportedObject(
            f"{where}: cannot store {t.__module__}.{t.__qualname__} in metadata{hint}; metadata "
            "is plain JSON (dict with str keys, list, str, int, float, bool, None): convert it "
            "(e.g. str() or .isoformat()) or put it in the state"
        )

    if type(metadata) is not dict:
        raise UnsupportedObject(
            f"metadata must be a dict with str keys, not {type(metadata).__qualname__}"
        )
    out = copy(metadata, (), 0)
    n = len(json.dumps(out, separators=(",", ":"), allow_nan=False))
    if n > limits.MAX_METADATA_BYTES:
        raise UnsupportedObject(
            f"metadata is {n:,} bytes of JSON, more than {limits.MAX_METADATA_BYTES:,}: it is "
            "copied into every manifest and read by every listing; put large values in the "
            "state"
        )
    assert isinstance(out, dict)
    return out


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
        raise FormatError(f"unknown tag {tag!r} in object tree")

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
