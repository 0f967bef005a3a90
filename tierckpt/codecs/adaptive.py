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

A checkpoint is worth its restore, so the restore has a veto (:meth:`AdaptiveCodec._decide`).
Loads from the tier report what they measured (:meth:`AdaptiveCodec.observe_read`): a load of
raw chunks gives the link's read rate, a load of compressed chunks the rate it delivered. A kind
of chunk is stored raw, whatever the save would gain, when

* the link reads faster than the decoders decode (``decode_bps * parallel < read link``, the
  decode rate measured with the encode rate on the same sample; until a load measured the read
  link, the write link stands in for it), or
* loads of compressed chunks from this tier delivered fewer bytes per second than loads of raw
  chunks did.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from tierckpt._types import JSON, BytesLike
from tierckpt.codecs.auto import CodecProfile, choose_codec, measure_codec, restore_pays
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
        #: stored bytes/s of loads of raw chunks from this tier (the link's read rate)
        self._read_link_bps: float | None = None
        #: raw bytes/s delivered by loads of compressed chunks from this tier
        self._read_compressed_bps: float | None = None
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
            self._link_bps = _ema(self._link_bps, bps)
            self._decide()

    def observe_read(
        self, stored_bytes: int, raw_bytes: int, seconds: float, *, compressed: bool
    ) -> None:
        """Feed back one load from this tier (the restore's veto, see the module docstring):
        ``seconds`` to read, verify and decode ``stored_bytes`` into ``raw_bytes``."""
        if raw_bytes < (1 << 20) or seconds <= 0:
            return
        with self._lock:
            if compressed:
                self._read_compressed_bps = _ema(self._read_compressed_bps, raw_bytes / seconds)
            else:
                self._read_link_bps = _ema(self._read_link_bps, stored_bytes / seconds)
            self._decide()

    def _decide(self) -> None:
        read_link = self._read_link_bps or self._link_bps
        if read_link is None:
            return
        for kind, prof in self._profiles.items():
            compress, reason = True, "no save measured yet"
            if self._link_bps is not None:
                choice = choose_codec([prof], self._link_bps, parallel=self.parallel)
                compress, reason = not choice.codec.is_passthrough, choice.reason
            if compress and not restore_pays(prof, read_link, parallel=self.parallel):
                compress = False
                reason = (
                    f"the link reads {read_link / 1e9:.2f} GB/s, faster than "
                    f"{self.parallel} decoders at {prof.decode_bps / 1e9:.2f} GB/s each: a "
                    "compressed restore would be slower than a raw one"
                )
            slow, fast = self._read_compressed_bps, self._read_link_bps
            if compress and slow is not None and fast is not None and slow < fast:
                compress = False
                reason = (
                    f"compressed loads delivered {slow / 1e9:.2f} GB/s, raw loads "
                    f"{fast / 1e9:.2f} GB/s"
                )
            if self._compress.get(kind, self.remote) != compress:
                log.info(
                    "auto codec: %s chunks now %s (%s)",
                    kind,
                    "compressed" if compress else "raw",
                    reason,
                )
            self._compress[kind] = compress

    def describe(self) -> dict[str, Any]:
        """What the policy knows and chose (for logs, stats and tests)."""
        with self._lock:
            return {
                "link_bps": self._link_bps,
                "read_link_bps": self._read_link_bps,
                "read_compressed_bps": self._read_compressed_bps,
                "compress": dict(self._compress),
                "profiles": {
                    k: {"encode_bps": p.encode_bps, "decode_bps": p.decode_bps, "ratio": p.ratio}
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


def _ema(old: float | None, new: float) -> float:
    """The moving average of a rate: the newest measurement weighs :data:`EMA`."""
    return new if old is None else EMA * new + (1 - EMA) * old
