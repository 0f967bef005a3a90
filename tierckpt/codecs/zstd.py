"""zstd on the CPU (the ``zstandard`` package; it releases the GIL while it works)."""

from __future__ import annotations

import threading

import zstandard

from tierckpt._types import BytesLike
from tierckpt.codecs.base import Codec, register_codec
from tierckpt.errors import CorruptChunk

__all__ = ["ZstdCodec"]


class ZstdCodec(Codec):
    """zstd frames with the content size in the header; ``threads`` > 1 uses zstd's workers."""

    codec_id = "zstd"

    def __init__(self, level: int = 1, threads: int = 1) -> None:
        if not isinstance(level, int) or not -131072 <= level <= 22:
            raise ValueError(f"zstd level must be an int in [-131072, 22], got {level!r}")
        if not isinstance(threads, int) or threads < 0:
            raise ValueError(f"zstd threads must be an int >= 0, got {threads!r}")
        self.level = level
        self.threads = threads
        self._local = threading.local()

    def get_config(self) -> dict[str, object]:
        return {"id": self.codec_id, "level": self.level, "threads": self.threads}

    def _compressor(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = zstandard.ZstdCompressor(
                level=self.level,
                threads=self.threads if self.threads > 1 else 0,
                write_content_size=True,
            )
            self._local.c = c
        return c

    def encode(self, data: BytesLike) -> BytesLike:
        return self._compressor().compress(data)

    def decode(self, data: BytesLike, out: memoryview) -> None:
        decode_zstd_into(data, out)


def _probe_allow_extra_data() -> bool:
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"x")
    try:
        zstandard.ZstdDecompressor().decompress(frame, allow_extra_data=False)
    except TypeError:  # pragma: no cover - zstandard < 0.25 has no such argument
        return False
    return True


#: True when zstandard can refuse bytes after the frame (a truncated or padded chunk)
STRICT_FRAMES = _probe_allow_extra_data()
_STRICT: dict[str, bool] = {"allow_extra_data": False} if STRICT_FRAMES else {}


def decode_zstd_into(data: BytesLike, out: memoryview) -> None:
    """Decode one or more zstd frames into ``out``; exact size or ``CorruptChunk``."""
    expected = len(out)
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"not a zstd frame: {exc}") from exc
    if params.content_size not in (expected, zstandard.CONTENTSIZE_UNKNOWN):
        raise CorruptChunk(f"zstd frame declares {params.content_size} bytes, expected {expected}")
    try:
        # max_output_size bounds the allocation even if the header lies
        result = (
            zstandard.ZstdDecompressor().decompress(data, max_output_size=expected, **_STRICT)
            if expected
            else b""
        )
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"zstd decode failed: {exc}") from exc
    if len(result) != expected:
        raise CorruptChunk(f"zstd chunk decoded to {len(result)} bytes, expected {expected}")
    out[:] = result


register_codec(ZstdCodec)
