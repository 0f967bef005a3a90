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
Loads from the tier report what they measured, end to end (:meth:`AdaptiveCodec.observe_read`:
raw bytes delivered per second of the load, index to last decoded byte): a load of raw chunks
gives the raw rate ``R``, a load of compressed chunks the compressed rate ``C``. A tier that
compresses stores no raw chunks to measure ``R`` with, so after a compressed load the loader
reads a slice of the same shard file again, raw, as a raw load reads (a *link probe*,
:meth:`AdaptiveCodec.link_probe_due`, ``checkpointer/_auto_feedback.py``: a quarter of the
load at most, and none after a load of under 128 MiB, whose restore it would barely change).
A kind of chunk is stored raw, whatever the save would gain, when

* both rates are measured and ``C < R``: compressed loads delivered fewer bytes per second
  than raw reads of the same tier (this sees what no model does: an object store that runs on
  the decoder's cores, where decode and download add up instead of overlapping); or, until
  both are,
* the link reads faster than the decoders decode (``decode_bps * parallel < R``, the decode
  rate measured with the encode rate on the same sample; the write link stands in for ``R``
  until a load measured it).

Measurements go stale, so the policy explores now and then: after :data:`EXPLORE_EVERY`
compressed loads the next one probes the link again, and after :data:`EXPLORE_EVERY` raw loads
the measured ``C`` is dropped, so the next checkpoints are stored as the save-side rules say
and the load after them measures ``C`` afresh. A policy's first load measures ``C`` or ``R``
(and probes where it was compressed); :meth:`AdaptiveCodec.read_state` /
:meth:`AdaptiveCodec.recall_state` carry the rest across a restart (the load path keeps it in
a small file per tier and rank under ``TIERCKPT_AUTO_STATE_DIR``), so a restarted job that
loads raw chunks still knows that compressed ones restored slower.
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

__all__ = ["EXPLORE_EVERY", "AdaptiveCodec", "nvcomp_ready"]

log = logging.getLogger("tierckpt")

SAMPLE_BYTES = 4 << 20
#: weight of the newest measurement in the link's moving average
EMA = 0.5
#: loads of one kind (raw or compressed) after which the other kind is measured again
EXPLORE_EVERY = 4
#: loads smaller than this measure nothing (the fixed costs of a load dominate)
MIN_LOAD_BYTES = 1 << 20


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
        #: bytes/s of loads of raw chunks from this tier and of link probes (the raw rate R)
        self._read_link_bps: float | None = None
        #: raw bytes/s delivered by loads of compressed chunks from this tier (the rate C)
        self._read_compressed_bps: float | None = None
        #: compressed loads since R was last measured; raw loads since C was
        self._compressed_loads_since_raw = 0
        self._raw_loads_since_compressed = 0
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
        the nvCOMP package imports, unless loads measured compressed restores slower than raw
        ones; None otherwise (the chunk crosses raw and :meth:`for_dtype` chooses on the host,
        as without a GPU)."""
        if not self.remote or device is None:
            return None
        with self._lock:
            ready = self._device_ready.get(device)
            slow, fast = self._read_compressed_bps, self._read_link_bps
        if slow is not None and fast is not None and slow < fast:
            return None  # the restore's measured veto holds for GPU-compressed chunks too
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
        if raw_bytes < MIN_LOAD_BYTES or seconds <= 0:
            return
        with self._lock:
            if compressed:
                self._read_compressed_bps = _ema(self._read_compressed_bps, raw_bytes / seconds)
                self._compressed_loads_since_raw += 1
                self._raw_loads_since_compressed = 0
            else:
                self._read_link_bps = _ema(self._read_link_bps, stored_bytes / seconds)
                self._compressed_loads_since_raw = 0
                self._raw_loads_since_compressed += 1
                self._explore_compressed()
            self._decide()

    def link_probe_due(self) -> bool:
        """Whether the loader should read a slice of the shard it just loaded compressed again,
        raw (:meth:`observe_link_probe`): no raw rate was measured yet, or
        :data:`EXPLORE_EVERY` compressed loads went by since it was."""
        with self._lock:
            return self._compressed_loads_since_raw > 0 and (
                self._read_link_bps is None or self._compressed_loads_since_raw >= EXPLORE_EVERY
            )

    def observe_link_probe(self, nbytes: int, seconds: float) -> None:
        """Feed back a link probe: ``nbytes`` stored bytes read raw, as a raw load reads them
        (same reader threads, fresh memory), in ``seconds``: the raw rate R."""
        if nbytes < MIN_LOAD_BYTES or seconds <= 0:
            return
        with self._lock:
            bps = nbytes / seconds
            # a probe replaces a stale R rather than averaging with it: it is the newest
            # reading of a link that may have changed since
            self._read_link_bps = bps
            self._compressed_loads_since_raw = 0
            self._decide()

    def read_state(self) -> dict[str, JSON]:
        """What loads taught this policy (the restore rates and the explore counters), for
        :meth:`recall_state` in a later process: a restarted job keeps what its predecessor
        measured (``checkpointer/_auto_feedback.py`` keeps it in a file per tier and rank)."""
        with self._lock:
            return {
                "read_link_bps": self._read_link_bps,
                "read_compressed_bps": self._read_compressed_bps,
                "compressed_loads_since_raw": self._compressed_loads_since_raw,
                "raw_loads_since_compressed": self._raw_loads_since_compressed,
            }

    def recall_state(self, state: object) -> bool:
        """Take what :meth:`read_state` returned in an earlier process, unless this policy has
        measured a load itself (its own numbers are newer). Anything malformed is ignored
        (returns False): a lost or garbled file only means measuring again."""
        if not isinstance(state, dict):
            return False
        rates = [state.get("read_link_bps"), state.get("read_compressed_bps")]
        counts = [state.get("compressed_loads_since_raw"), state.get("raw_loads_since_compressed")]
        if not all(r is None or (isinstance(r, float | int) and 0 < r < 1e15) for r in rates):
            return False
        if not all(isinstance(c, int) and 0 <= c < 1 << 30 for c in counts):
            return False
        with self._lock:
            if self._read_link_bps is not None or self._read_compressed_bps is not None:
                return False
            self._read_link_bps, self._read_compressed_bps = (
                None if r is None else float(r) for r in rates
            )
            self._compressed_loads_since_raw = int(counts[0] or 0)
            self._raw_loads_since_compressed = int(counts[1] or 0)
            self._decide()
        return True

    def _explore_compressed(self) -> None:
        """After :data:`EXPLORE_EVERY` raw loads, forget C (a measured veto would otherwise
        never be re-examined: a tier stored raw produces no compressed loads)."""
        if (
            self._read_compressed_bps is not None
            and self._raw_loads_since_compressed >= EXPLORE_EVERY
        ):
            log.info(
                "auto codec: %d raw loads since the last compressed one; measuring compressed "
                "loads again",
                self._raw_loads_since_compressed,
            )
            self._read_compressed_bps = None
            self._raw_loads_since_compressed = 0

    def _decide(self) -> None:
        read_link = self._read_link_bps or self._link_bps
        if read_link is None:
            return
        slow, fast = self._read_compressed_bps, self._read_link_bps
        for kind, prof in self._profiles.items():
            compress, reason = True, "no save measured yet"
            if self._link_bps is not None:
                choice = choose_codec([prof], self._link_bps, parallel=self.parallel)
                compress, reason = not choice.codec.is_passthrough, choice.reason
            if compress and slow is not None and fast is not None:
                # measured end to end, both ways: this beats any model of the two rates
                if slow < fast:
                    compress = False
                    reason = (
                        f"compressed loads delivered {slow / 1e9:.2f} GB/s, raw reads "
                        f"{fast / 1e9:.2f} GB/s"
                    )
            elif compress and not restore_pays(prof, read_link, parallel=self.parallel):
                compress = False
                reason = (
                    f"the link reads {read_link / 1e9:.2f} GB/s, faster than "
                    f"{self.parallel} decoders at {prof.decode_bps / 1e9:.2f} GB/s each: a "
                    "compressed restore would be slower than a raw one"
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
                "compressed_loads_since_raw": self._compressed_loads_since_raw,
                "raw_loads_since_compressed": self._raw_loads_since_compressed,
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
