"""The shard index's bytes, with what repeats from save to save serialized once.

A training loop saves the same tensors laid out the same way at every step: the index's tensor
table, storage table and parameter list are then the same JSON text every time, and so is the
object tree's (but for the values in it that change, such as the step), yet
:func:`tierckpt.format.encode_index` serializes them and scans the tree for its declared counts
at every commit, on the tier's writer thread: about a millisecond of Python per commit for a
few hundred tensors. :class:`IndexText` remembers the last text of each of those members and
the last tree's counts, keyed by the *value* they were made from (compared in full, ``==`` on
lists of ints and strings, which C does in microseconds), so a changed table or tree is never
written with a stale text: the bytes are exactly ``encode_index``'s (a test holds them equal).

Part of :class:`~tierckpt.pipeline.Pipeline`; each tier thread keeps its own.
"""

from __future__ import annotations

from typing import Any

from tierckpt._types import JSON
from tierckpt.format import encode_index
from tierckpt.format._index import _compact, _dims, _list, _side_table, index_counts
from tierckpt.tree import tree_side_table

__all__ = ["IndexText"]

#: the members remembered by value: a layout's tables, made by :mod:`tierckpt.plan` of ints
#: and strings only, so equal values have equal JSON text (no float or bool to pass for an int)
_TABLES = ("tensors", "storages", "parameters")


class IndexText:
    """``encode_index`` for one writer thread, remembering the last text of each table and the
    last tree's counts (one entry each: a changed state replaces them)."""

    def __init__(self) -> None:
        #: member name -> (the value it was made from, its compact JSON text, and for the
        #: tensor table its dimensions' count)
        self._texts: dict[str, tuple[JSON, str, int]] = {}
        #: (tree text, its side table's text or None) -> (tree items, tree string bytes)
        self._tree: tuple[tuple[str, str | None], tuple[int, int]] | None = None
        self.hits = 0  # tables reused, for tests and diagnostics

    def encode(self, index: dict[str, JSON]) -> bytes:
        """The bytes :func:`tierckpt.format.encode_index` gives for ``index``."""
        if "format" not in index or "version" not in index:
            return encode_index(index)  # no header to declare counts in: the plain path
        tree_text = _compact(index.get("tree"), allow_nan=False)
        rest = {k: v for k, v in index.items() if k not in ("format", "version", "counts")}
        carried = tree_side_table(index.get("tree"))
        if carried is not None:  # as with_counts does: the tree's own side table is stored
            rest["odict_metadata"] = carried
        side = _side_table(index)
        members = {
            "format": _compact(index["format"], allow_nan=False),
            "version": _compact(index["version"], allow_nan=False),
            "counts": _compact(self._counts(index, tree_text, side)),
        }
        for k, v in rest.items():
            members[k] = tree_text if k == "tree" else self._text(k, v)
        return ("{" + ",".join(f"{_compact(k)}:{t}" for k, t in members.items()) + "}").encode(
            "utf-8"
        )

    def _text(self, key: str, value: JSON) -> str:
        return self._table(key, value)[0] if key in _TABLES else _compact(value, allow_nan=False)

    def _table(self, key: str, value: JSON) -> tuple[str, int]:
        """(compact JSON text, dimensions if the tensor table) of a table, remembered."""
        known = self._texts.get(key)
        if known is not None and known[0] == value:
            self.hits += 1
            return known[1], known[2]
        text = _compact(value, allow_nan=False)
        dims = _dims(_list(value)) if key == "tensors" else 0
        self._texts[key] = (value, text, dims)
        return text, dims

    def _counts(self, index: dict[str, Any], tree_text: str, side: JSON) -> dict[str, JSON]:
        """``index_counts(index, tree_text)``, the tree's scan reused when its text (and its
        side table's) is the last one's."""
        side_text = None if side is None else _compact(side)
        key = (tree_text, side_text)
        if self._tree is None or self._tree[0] != key:
            counts = index_counts(index, tree_text)
            tree_items, text = counts["tree"], counts["text"]
            assert type(tree_items) is int and type(text) is int
            self._tree = (key, (tree_items, text))
            return counts
        tree_items, text = self._tree[1]
        tensors = _list(index.get("tensors"))
        return {
            "codecs": len(_list(index.get("codecs"))),
            "chunks": len(_list(index.get("chunks"))),
            "storages": len(_list(index.get("storages"))),
            "tensors": len(tensors),
            "dims": self._table("tensors", index.get("tensors"))[1] if tensors else 0,
            "tree": tree_items,
            "text": text,
        }
