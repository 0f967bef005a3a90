"""``codec="auto"``: compress a tier's chunks only while that makes the tier faster.

Each tier with the auto policy gets its own :class:`AdaptiveCodec`. It is never written into a
checkpoint: for every chunk it hands the pipeline a concrete codec (the float-aware
:class:`~tierckpt.codecs.planes.PlanesCodec` for float chunks, zstd for the rest, or raw), and
the index records that concrete codec. It learns two things as checkpoints go by:

* the codec's encode throughput and ratio on this run's real data, measured once per kind of
  chunk (float element size, or "other") on the first few MiB of a real chunk; and
* the tier's link throughput: stored bytes over the time spent writing and committing them.

With both known it compresses when :func:`~tierckpt.codecs.auto.choose_codec` says the encoder
and the link together move the bytes faster than the link alone (in practice: raw to local
NVMe, compressed to S3). Until the link is measured it starts from the backend's nature:
compressed to remote tiers, raw to local ones.

On a GPU a remote tier's policy compresses on the device instead (:meth:`AdaptiveCodec.on_device`):
nvCOMP zstd before the device-to-host copy, whose RAW pieces the CPU decodes as well, when the
state is on a CUDA device and the nvCOMP package imports. GPU compression is faster than any
object-store link, so there is nothing to measure first.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from tierckpt._types import JSON, BytesLike
from tierckpt.codecs.auto import CodecProfile, choose_codec, measure_codec
from tierckpt.codecs.base import Codec
from tierckpt.codecs.planes import FLOAT_ITEMSIZE, PlanesCodec
from tierckpt.codecs.raw import RawCodec
from tierckpt.errors import UnknownCodec

if TYPE_CHECKING:
    import torch

__all__ = ["AdaptiveCodec", "nvcomp_ready"]

log = logging.getLogger("tierckpt")

SAMPLE_BYTES = 4 << 20
#: weight of the newest measurement in the link's moving average
EMA = 0.5


class AdaptiveCodec(Codec):
    """The auto policy of one tier (not a storable codec: see the module docstring)."""

    codec_id = "auto"

    def __init__(self, *, remote: bool, parallel: int = 2, candidate: Codec | None = None) -> None:
        self.remote = remote
        self.parallel = max(1, parallel)
        self.candidate = candidate or PlanesCodec(threads=1)
        self._raw = RawCodec()
        self._lock = threading.Lock()
        self._profiles: dict[str, CodecProfile] = {}
        self._link_bps: float | None = None
        self._compress: dict[str, bool] = {}
        self._device_codec: Codec | None = None
        self._device_ready: dict[torch.device, bool] = {}

    # identity semantics: two tiers' policies learn separately even with equal configs
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def get_config(self) -> dict[str, JSON]:
        return {"id": self.codec_id, "remote": self.remote}

    def encode(self, data: BytesLike) -> BytesLike:
        raise TypeError("AdaptiveCodec picks a codec per chunk: call for_dtype() first")

    def decode(self, data: BytesLike, out: memoryview) -> None:
        raise TypeError("'auto' is a policy, not a stored codec")

    @staticmethod
    def _kind(dtype_name: str) -> str:
        size = FLOAT_ITEMSIZE.get(dtype_name.removeprefix("torch."))
        return f"float{size}" if size else "other"

    def for_dtype(self, dtype_name: str) -> Codec:
        kind = self._kind(dtype_name)
        with self._lock:
            compress = self._compress.get(kind, self.remote)
        return self.candidate.for_dtype(dtype_name) if compress else self._raw

    def on_device(self, device: torch.device | None) -> Codec | None:
        """The codec this tier's chunks on ``device`` are compressed with there, before the
        device-to-host copy: nvCOMP zstd for a remote tier when ``device`` is a CUDA GPU and
        the nvCOMP package imports; None otherwise (the chunk crosses raw and
        :meth:`for_dtype` chooses on the host, as without a GPU)."""
        if not self.remote or device is None:
            return None
        with self._lock:
            ready = self._device_ready.get(device)
        if ready is None:  # asked once per device: a failed import is not retried per chunk
            ready = nvcomp_ready(device)
            with self._lock:
                self._device_ready[device] = ready
        if not ready:
            return None
        with self._lock:
            if self._device_codec is None:
                from tierckpt.codecs.nvcomp import NvcompCodec

                self._device_codec = NvcompCodec("zstd")
            return self._device_codec

    def profile(self, dtype_name: str, sample: BytesLike) -> None:
        """Measure the candidate on real data, once per kind of chunk (cheap after that)."""
        kind = self._kind(dtype_name)
        with self._lock:
            if kind in self._profiles:
                return
        view = memoryview(sample).cast("B")[:SAMPLE_BYTES]
        if len(view) < 4096:
            return
        prof = measure_codec(self.candidate.for_dtype(dtype_name), view, repeats=1)
        with self._lock:
            self._profiles.setdefault(kind, prof)
            self._decide()

    def observe(self, stored_bytes: int, seconds: float) -> None:
        """Feed back one checkpoint's link figures (bytes written, time writing them)."""
        if stored_bytes < (1 << 20) or seconds <= 0:
            return  # too small to say anything about the link
        bps = stored_bytes / seconds
        with self._lock:
            self._link_bps = (
                bps if self._link_bps is None else EMA * bps + (1 - EMA) * self._link_bps
            )
            self._decide()

    def _decide(self) -> None:
        if self._link_bps is None:
            return
        for kind, prof in self._profiles.items():
            choice = choose_codec([prof], self._link_bps, parallel=self.parallel)
            compress = not choice.codec.is_passthrough
            if self._compress.get(kind, self.remote) != compress:
                log.info(
                    "auto codec: %s chunks now %s (%s)",
                    kind,
                    "compressed" if compress else "raw",
                    choice.reason,
                )
            self._compress[kind] = compress

    def describe(self) -> dict[str, Any]:
        """What the policy knows and chose (for logs, stats and tests)."""
        with self._lock:
            return {
                "link_bps": self._link_bps,
                "compress": dict(self._compress),
                "profiles": {
                    k: {"encode_bps": p.encode_bps, "ratio": p.ratio}
                    for k, p in self._profiles.items()
                },
            }


def nvcomp_ready(device: torch.device) -> bool:
    """Whether chunks on ``device`` can be compressed there: a CUDA device, a GPU present and
    the nvCOMP package importable."""
    from tierckpt import devices  # torch: only where a tier asks about a device

    if device.type != "cuda" or not devices.cuda_available():
        return False
    from tierckpt.codecs import nvcomp

    try:
        nvcomp._nvcomp()
    except UnknownCodec:
        return False
    return True
