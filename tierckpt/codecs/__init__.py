"""Codecs: the interface and registry in :mod:`tierckpt.codecs.base`, implementations beside it."""

from __future__ import annotations

from tierckpt.codecs.base import (
    Codec,
    SupportsObserve,
    SupportsObserveRead,
    SupportsProfile,
    SupportsProgressiveDecode,
    codec_from_config,
    codec_ids,
    get_codec,
    register_codec,
    register_lazy_codec,
)
from tierckpt.codecs.planes import PlanesCodec
from tierckpt.codecs.raw import RawCodec
from tierckpt.codecs.zstd import ZstdCodec

register_lazy_codec(
    "nvcomp",
    "tierckpt.codecs.nvcomp:NvcompCodec",
    "nvidia-nvcomp-cu12 (or -cu13, matching torch's CUDA)",
)

__all__ = [
    "Codec",
    "PlanesCodec",
    "RawCodec",
    "SupportsObserve",
    "SupportsObserveRead",
    "SupportsProfile",
    "SupportsProgressiveDecode",
    "ZstdCodec",
    "codec_from_config",
    "codec_ids",
    "get_codec",
    "register_codec",
    "register_lazy_codec",
]
