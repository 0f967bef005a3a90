"""Several pieces of memory that one ranged GET fills in order (the scatter read of
:meth:`ObjectStoreBackend.read_into_pieces`)."""

from __future__ import annotations

import builtins

__all__ = ["_Spread"]


class _Spread:
    """Several pieces that one ranged GET fills in order: ``_fetch`` sees one view of their
    joined length and assigns the body to it whole (``spread[:] = body``)."""

    def __init__(self, views: builtins.list[memoryview]) -> None:
        self._views = views
        self._n = sum(len(v) for v in views)

    def __len__(self) -> int:
        return self._n

    def __setitem__(self, key: slice, data: memoryview) -> None:
        body = memoryview(data).cast("B")
        pos = 0
        for v in self._views:
            v[:] = body[pos : pos + len(v)]
            pos += len(v)
