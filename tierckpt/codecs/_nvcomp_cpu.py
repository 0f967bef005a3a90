"""The CPU libraries for nvCOMP's standard bitstreams (zstd frames, raw deflate, LZ4 blocks):
what encodes and decodes the nvcomp framing on a machine without a GPU."""

from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from tierckpt.codecs.zstd import STRICT_FRAMES
from tierckpt.errors import CorruptChunk, UnknownCodec

if TYPE_CHECKING:
    pass
from tierckpt.codecs._nvcomp_framing import _U8

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
