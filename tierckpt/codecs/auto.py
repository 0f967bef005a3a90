"""Per-tier codec choice: compress only where it makes the tier faster.

Moving ``N`` raw bytes through a tier takes ``N / link`` uncompressed. Compressed, the encoder
and the link run as a pipeline, so it takes ``max(N / (encode * parallel), N * ratio / link)``:
whichever of the two is slower sets the pace. A fast local NVMe link is faster than any CPU
codec, so it gets raw chunks; a slow S3 link is where a 1.5x ratio buys 1.5x. The choice here
is a pure function of measured numbers so it can be unit-tested and logged; :func:`measure_codec`
produces those numbers from a short timed run on a sample of the real data.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from tierckpt._types import BytesLike
from tierckpt.codecs.base import Codec
from tierckpt.codecs.raw import RawCodec

__all__ = [
    "CodecChoice",
    "CodecProfile",
    "choose_codec",
    "measure_codec",
    "profiles_for",
    "restore_pays",
    "restore_seconds",
    "transfer_seconds",
]


@dataclass(frozen=True, slots=True)
class CodecProfile:
    """What one codec costs and saves on a kind of data.

    ``encode_bps`` and ``decode_bps`` are raw bytes per second of one call (with the codec's
    own threads); ``ratio`` is stored bytes / raw bytes (0.67 means a third smaller).
    """

    codec: Codec
    encode_bps: float
    decode_bps: float
    ratio: float

    def __post_init__(self) -> None:
        if not (self.encode_bps > 0 and self.decode_bps > 0 and self.ratio > 0):
            raise ValueError(f"a codec profile needs positive numbers: {self!r}")


@dataclass(frozen=True, slots=True)
class CodecChoice:
    """The chosen codec, with the numbers that chose it (for logs and tests)."""

    codec: Codec
    seconds: float
    raw_seconds: float
    reason: str

    @property
    def speedup(self) -> float:
        return self.raw_seconds / self.seconds


def transfer_seconds(
    nbytes: int,
    link_bps: float,
    profile: CodecProfile | None = None,
    *,
    parallel: int = 1,
) -> float:
    """Seconds to move ``nbytes`` raw bytes through a link of ``link_bps`` bytes/s.

    With a codec the encoder (``parallel`` calls at once) and the link overlap, so the slower
    of the two sets the time. Without one (``profile`` None) the link alone does.
    """
    if link_bps <= 0:
        raise ValueError(f"link throughput must be positive, got {link_bps}")
    if profile is None or profile.codec.is_passthrough:
        return nbytes / link_bps
    encode = nbytes / (profile.encode_bps * max(1, parallel))
    return max(encode, nbytes * profile.ratio / link_bps)


def restore_seconds(
    nbytes: int,
    link_bps: float,
    profile: CodecProfile | None = None,
    *,
    parallel: int = 1,
) -> float:
    """Seconds to restore ``nbytes`` raw bytes over a link reading ``link_bps`` bytes/s: the
    mirror of :func:`transfer_seconds`, with the decoder (``parallel`` reader threads, each
    decoding while the next bytes download) in place of the encoder."""
    if link_bps <= 0:
        raise ValueError(f"link throughput must be positive, got {link_bps}")
    if profile is None or profile.codec.is_passthrough:
        return nbytes / link_bps
    decode = nbytes / (profile.decode_bps * max(1, parallel))
    return max(decode, nbytes * profile.ratio / link_bps)


def restore_pays(profile: CodecProfile, read_link_bps: float, *, parallel: int = 1) -> bool:
    """True when restoring ``profile``'s compressed chunks is not slower than raw ones.

    With decode and download overlapped, the compressed restore takes the longer of the two;
    the raw one takes the download of more bytes. Since the ratio is below 1, compression
    loses exactly when the link reads faster than the decoders decode: ``decode_bps *
    parallel < read_link_bps``.
    """
    nbytes = 1 << 30
    return restore_seconds(nbytes, read_link_bps, profile, parallel=parallel) <= restore_seconds(
        nbytes, read_link_bps
    )


def choose_codec(
    profiles: Iterable[CodecProfile],
    link_bps: float,
    *,
    nbytes: int = 1 << 30,
    parallel: int = 1,
    min_gain: float = 0.05,
    require_cpu_decode: bool = True,
) -> CodecChoice:
    """The codec that moves ``nbytes`` through the link fastest, or raw.

    A codec must beat raw by ``min_gain`` (5% by default) to be chosen: a marginal gain is
    not worth the CPU it takes from training. With ``require_cpu_decode`` (the default) a
    codec whose chunks only a GPU can decode (``cpu_decodable`` False, e.g. nvCOMP ANS) is
    never chosen, so the checkpoint restores on a machine without a GPU.
    """
    raw_seconds = transfer_seconds(nbytes, link_bps)
    best: CodecChoice = CodecChoice(RawCodec(), raw_seconds, raw_seconds, "no codec beats raw")
    skipped: list[str] = []
    for profile in profiles:
        codec = profile.codec
        if require_cpu_decode and not getattr(codec, "cpu_decodable", True):
            skipped.append(codec.codec_id)
            continue
        seconds = transfer_seconds(nbytes, link_bps, profile, parallel=parallel)
        if seconds <= raw_seconds * (1 - min_gain) and seconds < best.seconds:
            bound = "link" if nbytes * profile.ratio / link_bps >= seconds else "encoder"
            best = CodecChoice(
                codec,
                seconds,
                raw_seconds,
                f"{raw_seconds / seconds:.2f}x faster than raw ({bound}-bound, "
                f"ratio {profile.ratio:.3f}, encode {profile.encode_bps / 1e9:.2f} GB/s x "
                f"{max(1, parallel)}, link {link_bps / 1e9:.2f} GB/s)",
            )
    if skipped and best.codec.is_passthrough:
        best = CodecChoice(
            best.codec,
            best.seconds,
            best.raw_seconds,
            f"{best.reason}; skipped GPU-only codecs {sorted(set(skipped))}",
        )
    return best


def measure_codec(
    codec: Codec,
    sample: BytesLike,
    *,
    repeats: int = 3,
) -> CodecProfile:
    """Time ``codec`` on ``sample`` (a few MiB of real chunk data is enough).

    One warm-up call, then the median of ``repeats`` timed encodes and decodes, so a cold
    cache or a first page fault does not decide the tier's codec. Checks the round trip.
    """
    raw = memoryview(sample).cast("B")
    n = len(raw)
    if n == 0:
        raise ValueError("measure_codec needs a non-empty sample")
    out = np.empty(n, np.uint8)
    view = out.data
    encoded = codec.encode(raw)
    codec.decode(encoded, view)
    if out.tobytes() != raw.tobytes():
        raise AssertionError(f"{codec!r} does not round-trip the sample")
    enc_times: list[float] = []
    dec_times: list[float] = []
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        encoded = codec.encode(raw)
        enc_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        codec.decode(encoded, view)
        dec_times.append(time.perf_counter() - start)
    floor = 1e-9  # a timer tick, so a trivial codec on a tiny sample is not infinitely fast
    return CodecProfile(
        codec=codec,
        encode_bps=n / max(statistics.median(enc_times), floor),
        decode_bps=n / max(statistics.median(dec_times), floor),
        ratio=max(len(memoryview(encoded)), 1) / n,
    )


def profiles_for(
    codecs: Sequence[Codec], sample: BytesLike, *, repeats: int = 3
) -> list[CodecProfile]:
    """:func:`measure_codec` for each codec on the same sample."""
    return [measure_codec(c, sample, repeats=repeats) for c in codecs]
