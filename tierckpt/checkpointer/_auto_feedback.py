"""What a load tells a tier's ``auto`` policy (:func:`feed_policy`): the restore's rate, a link
probe where the load was compressed, and the policy's memory of both across restarts.

**The link probe**: after a compressed load, read a slice of the same shard file again, raw,
as a raw load would, so the policy can compare the two restores.

A tier whose ``auto`` policy compresses never stores raw chunks, so no load of it measures what
a raw restore would take; a model of the two rates (the decoders outrun the link, so compressing
pays) misses what the machine shares, e.g. an object store serving from the decoder's cores.
The probe measures it directly, reading as a raw load reads: the first bytes of the shard file
in ranged reads of one segment each (``PIECE_BYTES``, 8 MiB, cut at the file's multiples of
it), as many at once as a raw load has reads in flight (from a remote store: its fetch
threads, twice the reader threads; else the reader threads), each into fresh memory mapped in
bulk just before (as a raw load's storages are), timed end to end. A probe that read otherwise
measured another link: four 4 MiB reads took 0.43-0.86 GB/s on SeaweedFS here where raw loads
delivered ~0.74 GB/s, so ``auto`` kept compressed chunks that restored slower than raw.

It runs only when the policy asks
(:meth:`~tierckpt.codecs.adaptive.AdaptiveCodec.link_probe_due`: no raw rate yet, or a stale
one), reads a quarter of what the load read (256 MiB at most), and not at all where that
quarter is under :data:`PROBE_MIN` (32 MiB, a load of under 128 MiB): a smaller probe measures
the round trips, not the link, and the restore it would tune costs little either way. So a
small restore reads its shard once, never a second time for the probe (``tierckpt demo``'s
node-lost restore of 6.2 MiB read 12.3 MiB from S3 with the probe of old, which read all of a
small load again). Its memory is one segment per thread, given back after each read. A
failure is logged and ignored: the load it follows has succeeded.

The bytes were just read by the load, so a store with a cache serves them warm: if anything
the probe flatters the raw restore, and a link that is slower than the decoders still shows
compressed loads delivering more (the probe then reads raw bytes, the load fewer of them).

**Memory across restarts**: a restarted job's first load measures only one side (raw or
compressed chunks, whichever the last checkpoint holds); without the other it would fall back
on the model, which on a store sharing the decoder's cores says "compress" and so alternates
raw and compressed from restart to restart. So the policy's load-side state
(:meth:`~tierckpt.codecs.adaptive.AdaptiveCodec.read_state`) is kept in a small JSON file per
tier URL and rank under :func:`tierckpt.config.auto_state_dir`, read before the first load a
policy measures and rewritten after each (atomically: a temporary file, then a rename). Losing
or garbling it costs a measurement, never a checkpoint: reading or writing it never fails a
load (logged at debug level).
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tierckpt import config
from tierckpt.codecs import SupportsObserveRead
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.pipeline import Tier
from tierckpt.restore import LoadedShard
from tierckpt.restore._fetch import PIECE_BYTES
from tierckpt.restore._prefault import prefault

__all__ = [
    "feed_policy",
    "probe_after_load",
    "probe_bytes",
    "read_probe",
    "recall",
    "remember",
    "state_path",
]

log = logging.getLogger("tierckpt")

STATE_FORMAT = "tierckpt-auto-state"
STATE_VERSION = 1
MAX_STATE_BYTES = 64 << 10
#: a probe smaller than this is not read (it would time round trips, not the link)
PROBE_MIN = 32 << 20
PROBE_MAX = 256 << 20
#: the probe reads at most this fraction of what the load read
PROBE_FRACTION = 4
#: the shortest read of a probe too short to keep every fetch thread busy in whole segments
MIN_SEGMENT = 1 << 20


def probe_bytes(stored_bytes: int, file_size: int) -> int:
    """How many bytes a probe after a load of ``stored_bytes`` reads from a file of
    ``file_size`` bytes: a quarter of the load (at most :data:`PROBE_MAX`); 0 (no probe)
    where that is under :data:`PROBE_MIN`."""
    want = min(PROBE_MAX, stored_bytes // PROBE_FRACTION)
    if want < PROBE_MIN:
        return 0
    return max(0, min(want, file_size))


def read_probe(tier: Tier, name: str, nbytes: int, pool: ThreadPoolExecutor) -> float:
    """Read ``name``'s first ``nbytes`` from ``tier`` as a raw load reads them (see the module
    docstring): one segment per read (halved down to :data:`MIN_SEGMENT` where there would be
    fewer segments than reads in flight), as many at once as the load's reads in flight, each
    into fresh memory; returns the wall seconds. Raises what the backend raises."""
    workers = getattr(pool, "_max_workers", 2)
    workers = workers if isinstance(workers, int) and workers > 0 else 2
    in_flight = 2 * workers if tier.backend.is_remote else workers
    backend = tier.backend

    def one(off: int, length: int) -> None:
        # fresh pages of its own (never the loaded state's), faulted in bulk as a raw load's
        # storages are; unmapped right after, so the probe holds a segment per thread
        buf = mmap.mmap(-1, length)
        view = memoryview(buf)
        try:
            prefault([(np.frombuffer(view, np.uint8).ctypes.data, length)])
            backend.read_into(name, off, view)
        finally:
            try:
                view.release()
                buf.close()
            except BufferError:  # a view still held somewhere: the collector unmaps it
                pass

    # a raw load of the whole shard keeps every fetch thread busy; a probe too short for that
    # in whole segments reads halved ones (still within one part each: the cuts stay at the
    # file's multiples of a divisor of the part), so it measures as many reads in flight
    step = PIECE_BYTES
    while step > MIN_SEGMENT and nbytes < in_flight * step:
        step //= 2
    segments = [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]
    with ThreadPoolExecutor(in_flight, thread_name_prefix="tierckpt-probe") as fetch:
        t0 = time.perf_counter()
        futures = [fetch.submit(one, off, length) for off, length in segments]
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


def feed_policy(tier: Tier, loaded: LoadedShard, rank: int, pool: ThreadPoolExecutor) -> None:
    """Tell ``tier``'s codec what a load from it measured (where the codec learns from loads):
    recall the policy's state from an earlier process, the load's rate, a link probe where it
    is due, and keep the state for the next process."""
    policy = tier.codec
    if not isinstance(policy, SupportsObserveRead):
        return
    path = state_path(tier.backend.url, rank) if isinstance(policy, AdaptiveCodec) else None
    if path is not None and isinstance(policy, AdaptiveCodec):
        recall(policy, path)
    policy.observe_read(
        loaded.stored_bytes, loaded.raw_bytes, loaded.read_seconds, compressed=loaded.compressed
    )
    probe_after_load(tier, loaded, rank, pool)
    if path is not None and isinstance(policy, AdaptiveCodec):
        remember(policy, path, tier.backend.url, rank)


def state_path(url: str, rank: int) -> str | None:
    """The file keeping the ``auto`` state of the tier at ``url`` for ``rank`` (None: the
    state is not kept, ``TIERCKPT_AUTO_STATE_DIR=off``)."""
    folder = config.auto_state_dir()
    if folder is None:
        return None
    digest = hashlib.sha256(url.encode()).hexdigest()[:24]
    return os.path.join(folder, f"{digest}-rank{rank}.json")


def recall(policy: AdaptiveCodec, path: str) -> bool:
    """Give ``policy`` the state kept in ``path`` (True when it took it)."""
    try:
        with open(path, "rb") as f:
            blob = f.read(MAX_STATE_BYTES + 1)
        if len(blob) > MAX_STATE_BYTES:
            return False
        doc = json.loads(blob)
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        log.debug("auto codec: cannot read its state %s (ignored): %s", path, exc)
        return False
    if not (
        isinstance(doc, dict)
        and doc.get("format") == STATE_FORMAT
        and doc.get("version") == STATE_VERSION
    ):
        return False
    return policy.recall_state(doc.get("state"))


def remember(policy: AdaptiveCodec, path: str, url: str, rank: int) -> None:
    """Keep ``policy``'s load-side state in ``path`` (atomically; failures only logged)."""
    doc = {
        "format": STATE_FORMAT,
        "version": STATE_VERSION,
        "url": url,
        "rank": rank,
        "saved_at": time.time(),
        "state": policy.read_state(),
    }
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".auto-", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.debug("auto codec: cannot keep its state in %s (ignored): %s", path, exc)
