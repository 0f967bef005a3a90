"""Check and freeze save(..., metadata=...): plain JSON a reader gives back as it was."""

from __future__ import annotations

import json
import math
from typing import Any

from tierckpt import limits
from tierckpt._types import JSON
from tierckpt.errors import UnsupportedObject
from tierckpt.tree._common import (
    _int_text,
    _path_str,
)


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
