"""The identity codec: stored bytes are the raw bytes."""

from __future__ import annotations

from tierckpt._types import BytesLike
from tierckpt.codecs.base import Codec, register_codec
from tierckpt.errors import CorruptChunk

__all__ = ["RawCodec"]


class RawCodec(Codec):
    codec_id = "raw"

    def encode(self, data: BytesLike) -> BytesLike:
        return data

    def decode(self, data: BytesLike, out: memoryview) -> None:
        src = memoryview(data).cast("B")
        if len(src) != len(out):
            raise CorruptChunk(f"raw chunk holds {len(src)} bytes, expected {len(out)}")
        out[:] = src

    @property
    def is_passthrough(self) -> bool:
        return True


register_codec(RawCodec)
