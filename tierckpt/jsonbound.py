"""JSON parsed within limits: count a document's items and depth before building any object.

``json.loads`` turns every value into a Python object, and tiny JSON values cost far more as
objects than as text (``[]`` is 2 bytes of JSON and 64 of CPython memory): a 256 MiB index of
empty lists took 7 GB to parse. :func:`scan` counts in one vectorized pass over the bytes, in
fixed-size blocks and without creating a Python object per value, how many *items* (values and
object keys) a document holds and how deep it nests; :func:`loads_within` refuses a document
over its limits before ``json.loads`` sees it, so the memory for parsing is bounded by the
limits the caller derives from what the document is allowed to hold.

The text must be UTF-8 (a quote or bracket byte then never hides inside another character).
The item count is exact for valid JSON: one for the root, plus one for each ``[``, ``{``, ``,``
and ``:`` outside strings (an empty ``[]`` or ``{}`` counts one item more than it holds). Text
that is not JSON gets some count and is then refused by ``json.loads``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from tierckpt._types import BytesLike
from tierckpt.errors import CorruptCheckpoint, FormatError

__all__ = ["JsonShape", "loads_within", "scan"]

_BLOCK = 1 << 20  # bytes per vectorized step: the scan's own memory is a few times this
_QUOTE, _BACKSLASH = 0x22, 0x5C


def _marks(block: np.ndarray[Any, Any]) -> Any:
    """Bytes that matter outside strings: ``[ { , :`` start an item; brackets nest."""
    return (
        (block == 0x5B)
        | (block == 0x7B)
        | (block == 0x2C)
        | (block == 0x3A)
        | (block == 0x5D)
        | (block == 0x7D)
    )


@dataclass(frozen=True, slots=True)
class JsonShape:
    """What :func:`scan` found: ``items`` (values and keys) and the deepest nesting."""

    items: int
    depth: int
    #: bytes inside strings, their quotes included
    text: int = 0
    #: the scan stopped early because a limit was passed; the numbers are lower bounds
    stopped: bool = False


def _clear_escaped(block: np.ndarray[Any, Any], quote: np.ndarray[Any, Any]) -> None:
    """Unmark escaped quotes in ``quote``: those after an odd run of backslashes."""
    backslash = block == _BACKSLASH
    if not backslash.any():
        return
    at = np.flatnonzero(quote)
    others = np.flatnonzero(~backslash)  # every quote is one of these
    i = np.searchsorted(others, at)
    prev = np.where(i > 0, others[np.maximum(i - 1, 0)], -1)
    quote[at[(at - 1 - prev) % 2 == 1]] = False


def _text_bytes(quotes: np.ndarray[Any, Any], size: int, in_string: int) -> int:
    """Bytes inside strings (quotes included) of a block of ``size`` bytes whose unescaped
    quotes are at ``quotes``, starting inside a string if ``in_string``."""
    if not quotes.size:
        return size if in_string else 0
    text = 0
    if in_string:  # the string open at the block's start ends at its first quote
        text, quotes = int(quotes[0]) + 1, quotes[1:]
    opens, closes = quotes[0::2], quotes[1::2]
    text += int((closes - opens[: closes.size]).sum()) + closes.size
    if opens.size > closes.size:  # a string still open at the block's end
        text += size - int(opens[-1])
    return text


def scan(
    data: BytesLike, *, max_items: int | None = None, max_depth: int | None = None
) -> JsonShape:
    """Count the items, the nesting depth and the string bytes of the JSON text ``data``.

    Stops as soon as ``max_items`` or ``max_depth`` is passed (``stopped`` is then True), so
    a hostile document costs the scan a block, not a pass over all of it.
    """
    arr = np.frombuffer(data, dtype=np.uint8)
    n = arr.size
    items = 1 if n else 0
    depth = deepest = text = 0
    in_string = 0
    lo = 0
    while lo < n:
        hi = min(n, lo + _BLOCK)
        # never end a block inside a run of backslashes: the byte after it depends on the run
        while hi < n and arr[hi - 1] == _BACKSLASH:
            hi += 1
        block = arr[lo:hi]
        quote = block == _QUOTE
        marks = _marks(block)
        if quote.any():
            _clear_escaped(block, quote)
            text += _text_bytes(np.flatnonzero(quote), block.size, in_string)
            # work on the bytes that matter only: a byte is inside a string when an odd
            # number of unescaped quotes precede it
            picked = block[marks | quote]
            is_quote = picked == _QUOTE
            parity = np.cumsum(is_quote, dtype=np.int32)
            chars = picked[((parity + in_string) & 1 == 0) & ~is_quote]
            in_string = (int(parity[-1]) + in_string) & 1 if parity.size else in_string
        elif in_string:
            chars = block[:0]
            text += block.size
        else:
            chars = block[marks]
        opens = (chars == 0x5B) | (chars == 0x7B)
        items += int(np.count_nonzero(opens)) + int(
            np.count_nonzero((chars == 0x2C) | (chars == 0x3A))
        )
        if chars.size:
            closes = (chars == 0x5D) | (chars == 0x7D)
            levels = np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int64)
            deepest = max(deepest, depth + int(levels.max()))
            depth += int(levels[-1])
        lo = hi
        if (max_items is not None and items > max_items) or (
            max_depth is not None and deepest > max_depth
        ):
            return JsonShape(items, deepest, text, stopped=lo < n)
    return JsonShape(items, deepest, text)


def loads_within(
    data: BytesLike, *, max_items: int, max_depth: int, where: str, what: str, why: str = ""
) -> Any:
    """``json.loads(data)`` if it holds at most ``max_items`` items nested at most
    ``max_depth`` deep; else :class:`FormatError` naming ``where`` (the file) and ``what``.

    ``why`` says where ``max_items`` comes from (the declared counts), for the message.
    """
    shape = scan(data, max_items=max_items, max_depth=max_depth)
    if shape.depth > max_depth:
        raise FormatError(
            f"{where}: {what} is not valid JSON for tierckpt: nested deeper than {max_depth} "
            "levels (refused before parsing)"
        )
    if shape.items > max_items:
        more = "at least " if shape.stopped else ""
        raise FormatError(
            f"{where}: {what} holds {more}{shape.items} JSON values, more than the {max_items} "
            f"{why or 'allowed'}; refused before parsing (a damaged or hostile file)"
        )
    try:
        # UTF-8 only (what tierckpt writes): in UTF-16 or -32 a quote byte can hide inside
        # another character, and the scan above would count a different document
        return json.loads(str(data, "utf-8"))
    except (ValueError, RecursionError) as exc:
        raise CorruptCheckpoint(f"{where}: {what} is not valid JSON ({exc})") from None
