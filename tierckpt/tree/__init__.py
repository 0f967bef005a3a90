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
numpy.ndarray       ``{"$ndarray": [n, "float32"]}`` — entry n holds a copy taken at save()
NumPy scalar        ``{"$npscalar": ["float64", "<base64 of its little-endian bytes>"]}``
=================  ==========================================================

NumPy values (:mod:`tierckpt.tree._numpy`) are those of a fixed list of dtypes (bool, signed
and unsigned ints of 8 to 64 bits, float16/32/64, complex64/128), in native byte order; the
array's tensor is a CPU tensor of the torch dtype of the same name, and a load gives back a
writable ``np.ndarray`` viewing it. Other dtypes, byte-swapped arrays and ndarray subclasses
are refused at save time naming the key path.

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

Behind this module: ``_common`` (limits, dtypes, key paths), ``_encode`` (save time),
``_metadata`` (the manifest's user metadata), ``_decode`` (load time), ``_numpy`` (NumPy
arrays and scalars).
"""

from __future__ import annotations

from tierckpt.tree._common import (
    DTYPES,
    MAX_DEPTH,
    MAX_NODES,
    KeyPath,
    dtype_from_name,
    dtype_name,
)
from tierckpt.tree._decode import (
    decode_tree,
)
from tierckpt.tree._encode import (
    encode_tree,
    tree_side_table,
)
from tierckpt.tree._metadata import (
    encode_metadata,
)
from tierckpt.tree._numpy import (
    NUMPY_DTYPES,
    numpy_storable,
)

__all__ = [
    "DTYPES",
    "MAX_DEPTH",
    "MAX_NODES",
    "NUMPY_DTYPES",
    "KeyPath",
    "decode_tree",
    "dtype_from_name",
    "dtype_name",
    "encode_metadata",
    "encode_tree",
    "numpy_storable",
    "tree_side_table",
]
