"""The ``auto`` policy's link probe: after a compressed load, read a slice of the same shard
file again, raw, as a raw load would, so the policy can compare the two restores.

A tier whose ``auto`` policy compresses never stores raw chunks, so no load of it measures what
a raw restore would take; a model of the two rates (the decoders outrun the link, so compressing
pays) misses what the machine shares, e.g. an object store serving from the decoder's cores.
The probe measures it directly: the first bytes of the shard file, split among the reader
threads, each read with the backend's ``read_into`` into fresh memory (first touch included,
as a raw load's storages are), timed end to end. It runs only when the policy asks
(:meth:`~tierckpt.codecs.adaptive.AdaptiveCodec.link_probe_due`: no raw rate yet, or a stale
one), reads at most an eighth of what the load read (32 MiB at least, 512 MiB at most), and a
failure is logged and ignored: the load it follows has succeeded.

The bytes were just read by the load, so a store with a cache serves them warm: if anything
the probe flatters the raw restore, and a link that is slower than the decoders still shows
compressed loads delivering more (the probe then reads raw bytes, the load fewer of them).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.pipeline import Tier
from tierckpt.restore import LoadedShard

__all__ = ["probe_after_load", "probe_bytes", "read_probe"]

log = logging.getLogger("tierckpt")

PROBE_MIN = 32 << 20
PROBE_MAX = 512 << 20
#: the probe reads at most this fraction of what the load read
PROBE_FRACTION = 8


def probe_bytes(stored_bytes: int, file_size: int) -> int:
    """How many bytes a probe after a load of ``stored_bytes`` reads from a file of
    ``file_size`` bytes."""
    want = min(PROBE_MAX, max(PROBE_MIN, stored_bytes // PROBE_FRACTION))
    return max(0, min(want, stored_bytes, file_size))


def read_probe(tier: Tier, name: str, nbytes: int, pool: ThreadPoolExecutor) -> float:
    """Read ``name``'s first ``nbytes`` from ``tier`` on ``pool``'s threads, one contiguous
    range per thread into fresh memory; returns the wall seconds. Raises what the backend
    raises."""
    workers = getattr(pool, "_max_workers", 2)
    workers = workers if isinstance(workers, int) and workers > 0 else 2
    step = -(-nbytes // workers)
    ranges = [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

    def one(off: int, length: int) -> None:
        out = np.empty(length, np.uint8)
        tier.backend.read_into(name, off, out.data)

    t0 = time.perf_counter()
    futures = [pool.submit(one, off, length) for off, length in ranges]
    for f in futures:
        f.result()
    return time.perf_counter() - t0


def probe_after_load(tier: Tier, loaded: LoadedShard, rank: int, pool: ThreadPoolExecutor) -> None:
    """Probe ``tier``'s raw read rate after ``loaded`` (a compressed load) when the tier's
    ``auto`` policy asks for it, and tell the policy."""
    policy = tier.codec
    if not (loaded.compressed and isinstance(policy, AdaptiveCodec)):
        return
    if not policy.link_probe_due():
        return
    ref = loaded.manifest.shard_for(rank)
    nbytes = probe_bytes(loaded.stored_bytes, ref.size)
    if nbytes <= 0:
        return
    try:
        seconds = read_probe(tier, ref.file, nbytes, pool)
    except Exception as exc:  # the load succeeded; a failed measurement changes nothing
        log.warning("auto codec: link probe of tier %s failed (ignored): %s", tier.name, exc)
        return
    log.info(
        "auto codec: link probe of tier %s read %d bytes raw in %.3f s (%.2f GB/s); the "
        "compressed load delivered %.2f GB/s",
        tier.name,
        nbytes,
        seconds,
        nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
        loaded.raw_bytes / loaded.read_seconds / 1e9 if loaded.read_seconds > 0 else 0.0,
    )
    policy.observe_link_probe(nbytes, seconds)
