"""Old name of :mod:`tierckpt.tree` (the object-tree encoding: non-tensor state as tagged JSON).

Kept so that code and docs that ``import tierckpt.objects`` keep working; new code imports
:mod:`tierckpt.tree`.
"""

from __future__ import annotations

from tierckpt.tree import (
    DTYPES,
    MAX_DEPTH,
    MAX_NODES,
    KeyPath,
    decode_tree,
    dtype_from_name,
    dtype_name,
    encode_metadata,
    encode_tree,
    tree_side_table,
)

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
