"""What encoding and decoding share: the limits, the dtypes by name, key paths for messages."""

from __future__ import annotations

import torch

from tierckpt import limits
from tierckpt.errors import FormatError, UnsupportedObject

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
    "torch.Size, torch.dtype, torch.device, and NumPy arrays and scalars of numeric or bool "
    "dtypes"
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
