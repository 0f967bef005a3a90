"""The nvcomp codec's chunk framing (see :mod:`tierckpt.codecs.nvcomp`): the header, where each
piece sits, and its validation before any byte is decoded."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from tierckpt.errors import CorruptChunk

if TYPE_CHECKING:
    pass


#: algorithm names; the position is the id written into each chunk: never reorder, only append
ALGORITHMS: tuple[str, ...] = (
    "zstd",
    "deflate",
    "lz4",
    "gdeflate",
    "ans",
    "bitcomp",
    "cascaded",
    "snappy",
)
_MAGIC = b"TCNV"
_VERSION = 1
_HEADER = struct.Struct("<4sBBBBQII")
_ALIGN = 16
_MAX_PIECE = 1 << 24  # nvCOMP's largest chunk for zstd/lz4/ans; deflate needs <= 64 KiB
_U8 = npt.NDArray[np.uint8]


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class _Layout:
    """Where each piece sits in the raw chunk and in the stored chunk (from the header)."""

    def __init__(self, raw_len: int, itemsize: int, piece_bytes: int) -> None:
        self.raw_len = raw_len
        self.itemsize = itemsize
        self.n_elems = raw_len // itemsize if itemsize > 1 else raw_len
        self.tail = raw_len - self.n_elems * itemsize if itemsize > 1 else 0
        self.n_planes = itemsize if itemsize > 1 else 1
        self.per_plane = -(-self.n_elems // piece_bytes) if self.n_elems else 0
        self.piece_bytes = piece_bytes
        self.n_pieces = self.per_plane * self.n_planes
        #: stride between planes in a plane-major device buffer (keeps every piece aligned)
        self.plane_stride = _align(self.n_elems)

    def piece(self, i: int) -> tuple[int, int, int]:
        """(plane, offset within the plane, raw length) of piece ``i``."""
        plane, j = divmod(i, self.per_plane)
        start = j * self.piece_bytes
        return plane, start, min(self.piece_bytes, self.n_elems - start)

    def header_len(self) -> int:
        return _align(_HEADER.size + 4 * self.n_pieces)


def encode_header(
    layout: _Layout, algorithm: str, itemsize: int, piece_bytes: int, stored: list[int]
) -> bytes:
    """The chunk's header: magic, version, algorithm, itemsize, sizes, each piece's stored size."""
    head = bytearray(layout.header_len())
    _HEADER.pack_into(
        head,
        0,
        _MAGIC,
        _VERSION,
        ALGORITHMS.index(algorithm),
        itemsize,
        0,
        layout.raw_len,
        piece_bytes,
        layout.n_pieces,
    )
    head[_HEADER.size : _HEADER.size + 4 * layout.n_pieces] = np.asarray(stored, "<u4").tobytes()
    return bytes(head)


def parse_frame(
    src: _U8, raw_len: int, total: int | None, *, algorithm: str, itemsize: int
) -> tuple[_Layout, list[int], list[int]]:
    """Validate the framing against ``raw_len``; (layout, piece starts, stored sizes).

    ``src`` holds at least the header; ``total`` is the stored chunk's length (default
    ``src.size``), so a chunk that lives on the GPU is checked from its header alone.
    """
    total = src.size if total is None else total
    if min(src.size, total) < _HEADER.size:
        raise CorruptChunk(f"nvcomp chunk of {total} bytes is shorter than its header")
    magic, version, algo, declared_itemsize, reserved, declared, piece_bytes, n_pieces = (
        _HEADER.unpack_from(src.data, 0)
    )
    if magic != _MAGIC:
        raise CorruptChunk(f"not an nvcomp chunk (magic {bytes(magic)!r})")
    if version != _VERSION or reserved != 0:
        raise CorruptChunk(f"nvcomp chunk version {version}/{reserved} is not supported")
    if algo >= len(ALGORITHMS) or ALGORITHMS[algo] != algorithm:
        raise CorruptChunk(f"nvcomp chunk algorithm id {algo} is not {algorithm!r}")
    if declared_itemsize != itemsize:
        raise CorruptChunk(f"nvcomp chunk itemsize {declared_itemsize}, codec expects {itemsize}")
    if declared != raw_len:
        raise CorruptChunk(f"nvcomp chunk declares {declared} bytes, expected {raw_len}")
    if not _ALIGN <= piece_bytes <= _MAX_PIECE or piece_bytes % _ALIGN:
        raise CorruptChunk(f"nvcomp chunk declares a piece size of {piece_bytes}")
    layout = _Layout(raw_len, itemsize, piece_bytes)
    if n_pieces != layout.n_pieces:
        raise CorruptChunk(f"nvcomp chunk has {n_pieces} pieces, expected {layout.n_pieces}")
    head_len = layout.header_len()
    if min(src.size, total) < head_len:
        raise CorruptChunk(f"nvcomp chunk of {total} bytes is truncated")
    stored: list[int] = np.frombuffer(src, "<u4", n_pieces, _HEADER.size).tolist()
    starts: list[int] = []
    pos = head_len
    for size in stored:
        if size == 0:
            raise CorruptChunk("nvcomp chunk holds an empty piece")
        pos = _align(pos)
        starts.append(pos)
        pos += size
    if pos + layout.tail != total:
        raise CorruptChunk(
            f"nvcomp chunk holds {total} bytes, its header accounts for {pos + layout.tail}"
        )
    return layout, starts, stored


def assemble(head: bytes, pieces: list[bytes], tail: _U8) -> memoryview:
    """Header, then each piece at an aligned offset, then the raw tail."""
    stored = [len(p) for p in pieces]
    total = len(head)
    for n in stored:
        total = _align(total) + n
    out = np.zeros(total + tail.size, np.uint8)
    out[: len(head)] = np.frombuffer(head, np.uint8)
    pos = len(head)
    for p in pieces:
        pos = _align(pos)
        out[pos : pos + len(p)] = np.frombuffer(p, np.uint8)
        pos += len(p)
    out[pos:] = tail
    return out.data
