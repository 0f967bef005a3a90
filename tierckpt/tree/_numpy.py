"""NumPy arrays and scalars in the object tree: which dtypes, how they are encoded and decoded.

An array (``{"$ndarray": [n, dtype]}``) is a tensor of the checkpoint: entry ``n`` of the tensor
table, a CPU tensor of the torch dtype of the same name, which holds a contiguous copy of the
array taken in ``save()`` itself (training code may change the array in place right after, and
nothing guards it: it is snapshotted like a loose tensor). A scalar (``{"$npscalar": [dtype,
base64]}``) is its little-endian bytes inline. Both come back as the NumPy type they were, bit
for bit. The dtype is one name of a fixed allow-list (:data:`NUMPY_DTYPES`): a reader never
parses a dtype out of a file.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tierckpt._types import JSON
from tierckpt.errors import FormatError, UnsupportedObject
from tierckpt.tree._common import DTYPES, _path_str

#: the NumPy dtypes stored, by name, each with the torch dtype of the same name that holds an
#: array's bytes (torch.from_numpy takes exactly these)
NUMPY_DTYPES: dict[str, tuple[np.dtype[Any], torch.dtype]] = {
    name: (np.dtype(name), DTYPES[name])
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
_LITTLE: dict[str, np.dtype[Any]] = {k: d.newbyteorder("<") for k, (d, _t) in NUMPY_DTYPES.items()}
_STORED = "bool, int8..int64, uint8..uint64, float16/32/64 and complex64/128"

#: what to do with an array of another kind (``dtype.kind``)
_HINTS = {
    "O": "store x.tolist() or convert its objects",
    "U": "store x.tolist() (a list of str)",
    "S": "store x.tolist() (a list of bytes)",
    "V": "store one array per field (x[name] for name in x.dtype.names)",
    "M": "store x.view('int64') and the unit (np.datetime_data(x.dtype))",
    "m": "store x.view('int64') and the unit (np.datetime_data(x.dtype))",
    "f": "store x.astype(np.float64) (rounds) or x.view(np.uint8) and the dtype's str",
    "c": "store x.astype(np.complex128) (rounds) or x.view(np.uint8) and the dtype's str",
}


def _dtype_name(dtype: np.dtype[Any], what: str, path: tuple[object, ...]) -> str:
    """The allow-list name of ``dtype``, or UnsupportedObject saying what to do."""
    name = dtype.name
    if name not in NUMPY_DTYPES or dtype.fields is not None:
        hint = _HINTS.get(dtype.kind, "convert it to one of these")
        if what.startswith("NumPy scalar") and dtype.kind in "OUS":
            hint = "store x.item() (a Python value)"
        raise UnsupportedObject(
            f"{what} at {_path_str(path)} has dtype {dtype.str!r} ({name}); tierckpt stores "
            f"NumPy values of {_STORED} without pickle: {hint}"
        )
    if not dtype.isnative:
        raise UnsupportedObject(
            f"{what} at {_path_str(path)} is byte-swapped ({dtype.str!r}); tierckpt stores "
            "native byte order: store x.astype(x.dtype.newbyteorder('=')) (the same values; "
            "it loads back in native order)"
        )
    return name


def numpy_storable(x: object) -> bool:
    """Whether ``x`` is a NumPy array or scalar that the object tree stores as it is."""
    if type(x) is np.ndarray or (isinstance(x, np.generic) and type(x) is x.dtype.type):
        dtype: np.dtype[Any] = x.dtype  # type: ignore[attr-defined]
        return dtype.name in NUMPY_DTYPES and dtype.fields is None and dtype.isnative
    return False


def encode_ndarray(x: np.ndarray[Any, Any], path: tuple[object, ...]) -> tuple[torch.Tensor, str]:
    """The tensor (a private contiguous copy of ``x``, taken now) and the dtype name of an
    array's ``$ndarray`` record; refuses subclasses and other dtypes."""
    if type(x) is not np.ndarray:
        t = type(x)
        raise UnsupportedObject(
            f"cannot store {t.__module__}.{t.__qualname__} at {_path_str(path)}: tierckpt "
            "stores plain numpy.ndarray; convert it with np.asarray(x) (a masked array loses "
            "its mask: store x.data and x.mask)"
        )
    name = _dtype_name(x.dtype, "NumPy array", path)
    # a copy, always: the array is the caller's to change once save() returns
    return torch.from_numpy(x.copy(order="C")), name


def encode_scalar(x: np.generic, path: tuple[object, ...]) -> list[JSON]:
    """The ``$npscalar`` payload of a NumPy scalar: ``[dtype, base64 little-endian bytes]``."""
    if type(x) is not x.dtype.type:
        t = type(x)
        raise UnsupportedObject(
            f"cannot store {t.__module__}.{t.__qualname__} at {_path_str(path)}, a subclass of "
            f"a NumPy scalar type: convert it to {x.dtype.type.__qualname__}"
        )
    name = _dtype_name(x.dtype, f"NumPy scalar {type(x).__qualname__}", path)
    raw = np.asarray(x).astype(_LITTLE[name]).tobytes()
    return [name, base64.b64encode(raw).decode("ascii")]


def _unknown(tag: str, name: object) -> str:
    return (
        f"{tag}: unknown NumPy dtype {str(name)[:40]!r} (a reader takes {_STORED}; written by "
        "a newer tierckpt? upgrade tierckpt to read it)"
    )


def decode_ndarray(v: list[Any], tensor: Callable[[object], Any], placeholders: bool) -> Any:
    """The array of a ``$ndarray`` record (validated: it is untrusted): a view of the tensor's
    bytes, so nothing is read before they arrive."""
    name = v[1]
    entry = NUMPY_DTYPES.get(name) if type(name) is str else None
    if entry is None:
        raise FormatError(_unknown("$ndarray", name))
    t = tensor(v[0])
    if placeholders:
        return t
    if not isinstance(t, torch.Tensor) or t.dtype != entry[1]:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise FormatError(f"$ndarray: a {name} array's tensor is {got}, not torch.{name}")
    t = t.detach()
    if t.device.type != "cpu":  # a load onto the GPU read it there: arrays live on the host
        t = t.cpu()
    return t.numpy()


def decode_scalar(v: list[Any]) -> Any:
    """The NumPy scalar of a ``$npscalar`` record (validated: it is untrusted)."""
    name, text = v
    dtype = _LITTLE.get(name) if type(name) is str else None
    if dtype is None:
        raise FormatError(_unknown("$npscalar", name))
    if type(text) is not str or len(text) > 32:
        raise FormatError("$npscalar needs the value's bytes as a short base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise FormatError("$npscalar: bad base64") from None
    if len(raw) != dtype.itemsize:
        raise FormatError(f"$npscalar: a {name} takes {dtype.itemsize} bytes, not {len(raw)}")
    if name == "bool" and raw not in (b"\x00", b"\x01"):
        raise FormatError(f"$npscalar: bool byte {raw[0]} is neither 0 nor 1")
    return np.frombuffer(raw, dtype=dtype)[0]
