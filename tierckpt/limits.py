"""The size limits of the format, in one place: what a writer refuses is what a reader refuses.

``save()`` checks the state against these limits before anything is written
(:class:`~tierckpt.errors.UnsupportedObject` naming the key path), and readers check stored
objects against the same constants (:class:`~tierckpt.errors.FormatError` naming the file), so
a checkpoint that commits can always be read back, and a hostile one cannot make a reader
allocate more than a genuine checkpoint of the sizes it declares would. ``docs/format.md``
lists them.

Readers look these names up on this module at call time, so a test may lower one with
``monkeypatch.setattr(tierckpt.limits, ...)`` to reach a limit cheaply.
"""

from __future__ import annotations

__all__ = [
    "INDEX_BYTES_PER_ITEM",
    "INDEX_ITEMS_BASE",
    "INDEX_ITEMS_PER_CHUNK",
    "INDEX_ITEMS_PER_CODEC",
    "INDEX_ITEMS_PER_DIM",
    "INDEX_ITEMS_PER_STORAGE",
    "INDEX_ITEMS_PER_TENSOR",
    "LEGACY_INDEX_BYTES",
    "LEGACY_INDEX_ITEMS",
    "MANIFEST_ITEMS_BASE",
    "MANIFEST_ITEMS_PER_SHARD",
    "MAX_DEPTH",
    "MAX_DEVICE_CHARS",
    "MAX_DIMS",
    "MAX_INDEX_BYTES",
    "MAX_INDEX_DEPTH",
    "MAX_INT_DIGITS",
    "MAX_MANIFEST_BYTES",
    "MAX_MANIFEST_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_NODES",
    "TREE_ITEMS_PER_NODE",
]

# -- the object tree (tree.py) -----------------------------------------------------------------
#: nesting depth of the object tree (a container inside a container ... of the state)
MAX_DEPTH = 200
#: values in the object tree: every container, key, scalar and tensor reference is one node,
#: and so is each element of a torch.Size or of a quantized tensor's parameters
MAX_NODES = 10_000_000
#: decimal digits of an int (CPython's default limit for int <-> str conversions)
MAX_INT_DIGITS = 4300
#: characters of a torch.device string
MAX_DEVICE_CHARS = 64
#: dimensions of a tensor
MAX_DIMS = 64

# -- stored JSON documents (format.py) ----------------------------------------------------------
#: bytes of a shard file's index
MAX_INDEX_BYTES = 1 << 30
#: bytes of a manifest
MAX_MANIFEST_BYTES = 64 << 20
#: bytes of the user's ``save(..., metadata=...)`` as compact JSON (it lives in every manifest)
MAX_METADATA_BYTES = 256 << 10
#: JSON nesting of an index: three levels per level of the object tree ({"$dict": [[k, v]]})
MAX_INDEX_DEPTH = 3 * MAX_DEPTH + 16
#: JSON nesting of a manifest: the metadata's own depth plus the manifest's
MAX_MANIFEST_DEPTH = MAX_DEPTH + 8

# A JSON "item" is a value or an object key: what a parser turns into one Python object.
# An index may hold at most INDEX_ITEMS_BASE + the per-entry allowances below for the counts it
# declares (``counts`` in the index); each allowance is what a writer emits for one entry.
INDEX_ITEMS_BASE = 256
INDEX_ITEMS_PER_CODEC = 32
INDEX_ITEMS_PER_CHUNK = 7  # [logical_offset, raw, stored, file_offset, codec, checksum]
INDEX_ITEMS_PER_STORAGE = 3  # [offset, nbytes]
# [storage, offset, dtype, [...], [...], device] (+2 if 0-dim), +1 if an nn.Parameter (its entry
# in the index field ``parameters``)
INDEX_ITEMS_PER_TENSOR = 10
INDEX_ITEMS_PER_DIM = 2  # one shape and one stride element
#: JSON items per object-tree node at most ({"$tuple": []} is 4 items for 1 node)
TREE_ITEMS_PER_NODE = 4
#: bytes an index may take per item it may hold, besides the string bytes its object tree
#: declares (numbers, short strings such as dtype names and checksums, separators)
INDEX_BYTES_PER_ITEM = 32
#: an index without declared counts (written by tierckpt 0.1.0 before counts existed): items
#: and bytes
LEGACY_INDEX_ITEMS = 1 << 20
LEGACY_INDEX_BYTES = 64 << 20
#: a manifest: fixed fields, then per shard ({"rank", "file", "size", "index_checksum"} and
#: its codec id), plus its metadata (at most MAX_METADATA_BYTES items: one per byte)
MANIFEST_ITEMS_BASE = 256
MANIFEST_ITEMS_PER_SHARD = 20
