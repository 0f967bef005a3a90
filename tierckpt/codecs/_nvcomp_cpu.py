"""The CPU libraries for nvCOMP's standard bitstreams (zstd frames, raw deflate, LZ4 blocks):
what encodes and decodes the nvcomp framing on a machine without a GPU
(:func:`encode_frame`, :func:`decode_frame`)."""

from __future__ import annotations

import threading
import zlib
from typing import Any

import numpy as np
import zstandard

from tierckpt.codecs._byteplanes import _merge, _run_tasks, _split
from tierckpt.codecs._nvcomp_framing import _U8, _Layout, assemble, encode_header, parse_frame
from tierckpt.codecs.zstd import STRICT_FRAMES
from tierckpt.errors import CorruptChunk, UnknownCodec

__all__ = ["decode_frame", "encode_frame"]


# -- the framing, encoded and decoded on the CPU ---------------------------------------------


def encode_frame(src: _U8, algorithm: str, itemsize: int, piece_bytes: int) -> memoryview:
    """``src`` in the nvcomp framing, each piece compressed with the CPU library of
    ``algorithm`` (zstd / deflate / lz4): the bytes a GPU would have stored."""
    layout = _Layout(src.size, itemsize, piece_bytes)
    planes = _host_planes(src, layout)
    compress = _cpu_compressor(algorithm)
    pieces: list[bytes] = [b""] * layout.n_pieces

    def one(i: int) -> None:
        plane, start, n = layout.piece(i)
        pieces[i] = compress(planes[plane][start : start + n])

    _run_tasks(layout.n_pieces, one, 2)
    header = encode_header(layout, algorithm, itemsize, piece_bytes, [len(p) for p in pieces])
    return assemble(header, pieces, src[src.size - layout.tail :])


def decode_frame(src: _U8, dest: _U8, algorithm: str, itemsize: int) -> None:
    """Decode the nvcomp framing ``src`` into ``dest`` (its raw length) with the CPU library
    of ``algorithm``; the framing is validated first (``CorruptChunk``)."""
    layout, starts, stored = parse_frame(
        src, dest.size, None, algorithm=algorithm, itemsize=itemsize
    )
    decompress = _cpu_decompressor(algorithm)
    # several planes: one plane-major copy of the body, then merged into `dest`
    body = dest if layout.n_planes == 1 else np.empty(layout.n_planes * layout.n_elems, np.uint8)

    def one(i: int) -> None:
        plane, start, n = layout.piece(i)
        at = plane * layout.n_elems + start
        decompress(src[starts[i] : starts[i] + stored[i]], body[at : at + n])

    _run_tasks(layout.n_pieces, one, 2)
    if layout.n_planes > 1:
        n = layout.n_elems
        planes = [body[k * n : (k + 1) * n] for k in range(layout.n_planes)]
        _merge(planes, layout.itemsize, dest[: n * layout.itemsize])
    if layout.tail:
        dest[dest.size - layout.tail :] = src[src.size - layout.tail :]


def _host_planes(src: _U8, layout: _Layout) -> list[_U8]:
    if layout.n_planes == 1:
        return [src[: layout.n_elems]]
    planes = [np.empty(layout.n_elems, np.uint8) for _ in range(layout.n_planes)]
    _split(src[: layout.n_elems * layout.itemsize], layout.itemsize, planes)
    return planes


# -- CPU libraries for the standard bitstreams ---------------------------------------------


def _cpu_compressor(algorithm: str) -> Any:
    if algorithm == "zstd":
        local = threading.local()

        def zstd_compress(piece: _U8) -> bytes:
            c = getattr(local, "c", None)
            if c is None:
                c = local.c = zstandard.ZstdCompressor(level=1, write_content_size=True)
            return bytes(c.compress(piece.data))

        return zstd_compress
    if algorithm == "deflate":

        def deflate_compress(piece: _U8) -> bytes:
            c = zlib.compressobj(1, zlib.DEFLATED, -15)
            return c.compress(piece.data) + c.flush()

        return deflate_compress
    if algorithm == "lz4":
        block = _lz4_block()

        def lz4_compress(piece: _U8) -> bytes:
            return bytes(block.compress(piece, store_size=False))

        return lz4_compress
    raise UnknownCodec(f"nvcomp {algorithm!r} has no CPU compressor")  # pragma: no cover


def _lz4_block() -> Any:
    try:
        import lz4.block
    except ImportError as exc:
        raise UnknownCodec(
            f"decoding nvcomp lz4 chunks on the CPU needs the package 'lz4': pip install lz4 "
            f"({exc})"
        ) from exc
    return lz4.block


def _cpu_decompressor(algorithm: str) -> Any:
    if algorithm == "zstd":
        return _unzstd_into
    if algorithm == "deflate":
        return _inflate_into
    block = _lz4_block()

    def lz4_into(piece: _U8, dest: _U8) -> None:
        try:
            result = block.decompress(piece, uncompressed_size=dest.size)
        except Exception as exc:  # lz4.block raises LZ4BlockError, a bare Exception
            raise CorruptChunk(f"lz4 piece failed to decode: {exc}") from exc
        if len(result) != dest.size:
            raise CorruptChunk(f"lz4 piece decoded to {len(result)} bytes, expected {dest.size}")
        dest[:] = np.frombuffer(result, np.uint8)

    return lz4_into


def _unzstd_into(piece: _U8, dest: _U8) -> None:
    try:
        params = zstandard.get_frame_parameters(piece.data)
        if params.content_size not in (dest.size, zstandard.CONTENTSIZE_UNKNOWN):
            raise CorruptChunk(
                f"zstd piece declares {params.content_size} bytes, expected {dest.size}"
            )
        if STRICT_FRAMES:
            result = zstandard.ZstdDecompressor().decompress(
                piece.data, max_output_size=dest.size, allow_extra_data=False
            )
        else:  # pragma: no cover - zstandard < 0.25
            result = zstandard.ZstdDecompressor().decompress(piece.data, max_output_size=dest.size)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"zstd piece failed to decode: {exc}") from exc
    if len(result) != dest.size:
        raise CorruptChunk(f"zstd piece decoded to {len(result)} bytes, expected {dest.size}")
    dest[:] = np.frombuffer(result, np.uint8)


def _inflate_into(piece: _U8, dest: _U8) -> None:
    d = zlib.decompressobj(-15)
    try:
        result = d.decompress(piece.data, dest.size)
    except zlib.error as exc:
        raise CorruptChunk(f"deflate piece failed to decode: {exc}") from exc
    if len(result) != dest.size or not d.eof or d.unconsumed_tail or d.unused_data:
        raise CorruptChunk(f"deflate piece does not decode to exactly {dest.size} bytes")
    dest[:] = np.frombuffer(result, np.uint8)
