"""What ``auto``'s link probe reads, and what its reading decides.

After a compressed load the probe reads a slice of the shard again, raw, to measure what a raw
restore would get. It reads as a raw load reads (8 MiB segments at the file's multiples, as many
in flight as the load's fetch threads, into fresh memory), at most a quarter of what the load
read, and not at all where that quarter is under ``PROBE_MIN``: the probe of old read a small
load's whole shard a second time (``tierckpt demo``'s node-lost restore counted 12.3 MiB read
from S3 for a 6.2 MiB shard), and read a large one as two or four long ranges, which measured a
slower link than raw loads got, so ``auto`` kept compressing where raw restored faster.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.checkpointer._auto_feedback import PROBE_FRACTION, probe_after_load, probe_bytes
from tierckpt.codecs import PlanesCodec
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.codecs.auto import CodecProfile
from tierckpt.restore import read_manifest
from tierckpt.restore._index import TAIL_READ_BYTES
from tierckpt.testing.s3servers import S3Server

MiB = 1 << 20


def _count_reads(backend: Any) -> dict[str, int]:
    """Bytes ``backend`` reads from here on, per object, through any of its read methods (the
    demo's ``ReadCounter``, plus the tail read an object store's index read goes through)."""
    seen: dict[str, int] = {}

    def add(obj: str, n: int) -> None:
        seen[obj] = seen.get(obj, 0) + n

    read, read_into, pieces, get = (
        backend.read,
        backend.read_into,
        backend.read_into_pieces,
        backend.get,
    )
    tail = backend.read_tail

    def c_read(obj: str, offset: int, length: int) -> Any:
        data = read(obj, offset, length)
        add(obj, len(data))
        return data

    def c_read_into(obj: str, offset: int, out: Any) -> None:
        add(obj, memoryview(out).nbytes)
        read_into(obj, offset, out)

    def c_pieces(obj: str, offset: int, outs: Any) -> None:
        add(obj, sum(memoryview(o).nbytes for o in outs))
        pieces(obj, offset, outs)

    def c_get(obj: str) -> Any:
        data = get(obj)
        add(obj, len(data))
        return data

    def c_tail(obj: str, length: int) -> Any:
        size, data = tail(obj, length)
        add(obj, len(data))
        return size, data

    backend.read, backend.read_into = c_read, c_read_into
    backend.read_into_pieces, backend.get, backend.read_tail = c_pieces, c_get, c_tail
    return seen


def test_a_small_restore_through_auto_reads_its_shard_once(
    s3_server: S3Server, s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compressed load of a few MiB, with no raw rate known (a fresh state folder: the probe
    would be due), reads no more bytes from S3 than its shard file holds."""
    monkeypatch.setenv("TIERCKPT_AUTO_STATE_DIR", str(tmp_path / "auto-state"))
    bucket = s3_bucket(s3_server)
    url = f"s3://{bucket}/run"
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(2 * MiB, generator=g).to(torch.bfloat16).float(), "step": 3}
    with Checkpointer([S3Tier(url, endpoint_url=s3_server.endpoint_url, codec="planes")]) as ck:
        ck.save(state, step=1).result()
    tier = S3Tier(url, endpoint_url=s3_server.endpoint_url, codec="auto", name="s3")
    plain = tier.make_backend()
    try:
        shard = read_manifest(plain, 1, "s3").shard_for(0)
    finally:
        plain.close()
    with Checkpointer([tier]) as ck:
        seen = _count_reads(ck.backend("s3"))
        assert_same(ck.load(), state)
        policy = ck._tiers[0].codec
        assert isinstance(policy, AdaptiveCodec)
        known = policy.describe()
    got = seen.get(shard.file, 0)
    # the index's tail read (TAIL_READ_BYTES) may overlap the chunks' bytes: nothing more
    most = shard.size + TAIL_READ_BYTES
    assert 0 < got <= most, f"read {got} bytes of a {shard.size}-byte shard: {seen}"
    assert known["read_compressed_bps"] is not None, "the load was not compressed: no probe due"
    assert known["read_link_bps"] is None  # no probe ran


class Throttled(LocalBackend):
    """A local folder read like an object store: each ranged read is one connection of
    ``RATE`` bytes/s (a sleep), so the rate a reader measures grows with its reads in flight;
    every read is recorded (offset, length) with the most in flight at once."""

    RATE = 5e6

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.reads: list[tuple[int, int]] = []
        self.now = self.most = 0
        self._lock = threading.Lock()

    @property
    def is_remote(self) -> bool:
        return True

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        with self._lock:
            self.reads.append((offset, len(out)))
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(len(out) / self.RATE)
            super().read_into(name, offset, out)
        finally:
            with self._lock:
                self.now -= 1


def _after_compressed_load(
    tmp_path: Path, stored: int, compressed_bps: float, file_size: int
) -> Any:
    """A policy that measured a compressed load of ``stored`` bytes delivering
    ``compressed_bps`` (and no raw rate yet), its tier over a throttled 'remote' backend
    holding a shard file of ``file_size`` bytes (the probe reads its start) and the load, as
    ``probe_after_load`` gets them."""
    backend = Throttled(str(tmp_path))
    backend.put_atomic("shard.tck", bytes(file_size))
    policy = AdaptiveCodec(remote=True, parallel=2)
    policy._profiles["float4"] = CodecProfile(PlanesCodec(threads=1), 1e12, 1e12, 0.8)
    policy.observe(100 * MiB, 1.0)  # a save's link: compressing pays on paper
    raw = int(stored / 0.8)
    policy.observe_read(stored, raw, raw / compressed_bps, compressed=True)
    assert policy.link_probe_due()
    tier = SimpleNamespace(backend=backend, codec=policy, name="s3")
    ref = SimpleNamespace(file="shard.tck", size=file_size)
    loaded = SimpleNamespace(
        compressed=True,
        stored_bytes=stored,
        raw_bytes=raw,
        read_seconds=raw / compressed_bps,
        manifest=SimpleNamespace(shard_for=lambda rank: ref),
    )
    return tier, loaded


def test_the_probe_reads_segments_in_flight_as_a_raw_load_and_a_quarter_at_most(
    tmp_path: Path,
) -> None:
    stored = 160 * MiB
    tier, loaded = _after_compressed_load(tmp_path, stored, 1e9, 48 * MiB)
    with ThreadPoolExecutor(2) as pool:  # the load's reader threads: 4 fetch threads
        probe_after_load(tier, loaded, 0, pool)  # type: ignore[arg-type]
    reads = sorted(tier.backend.reads)
    nbytes = probe_bytes(stored, 48 * MiB)
    assert nbytes == stored // PROBE_FRACTION == 40 * MiB
    assert reads == [(o, min(8 * MiB, nbytes - o)) for o in range(0, nbytes, 8 * MiB)]
    assert tier.backend.most == 4  # as many at once as a raw load's fetch threads
    assert tier.codec.describe()["read_link_bps"] is not None


def test_the_probe_chooses_raw_where_raw_loads_would_beat_the_compressed_one(
    tmp_path: Path,
) -> None:
    """Each read is a 5 MB/s connection: a raw load (4 fetch threads) gets ~20 MB/s; the
    compressed load delivered 14 MB/s. The probe must see the ~20 (and choose raw), not the
    ~10 that long reads on the two reader threads measure (the probe of old: two of 8 MiB).
    The sleeps dominate: the probe chooses compressed only if it loses 0.7 s to overhead."""
    tier, loaded = _after_compressed_load(tmp_path, 128 * MiB, 14e6, 40 * MiB)
    policy = tier.codec
    assert policy.describe()["compress"] == {"float4": True}
    with ThreadPoolExecutor(2) as pool:
        probe_after_load(tier, loaded, 0, pool)  # type: ignore[arg-type]
    seen = policy.describe()
    assert seen["read_link_bps"] is not None
    assert seen["read_link_bps"] > seen["read_compressed_bps"], seen
    assert seen["compress"] == {"float4": False}


def test_a_probe_too_short_for_every_fetch_thread_reads_halved_segments(tmp_path: Path) -> None:
    """A load of 128 MiB keeps 8 fetch threads busy with 8 MiB segments; its 32 MiB probe
    would keep only 4 so: it reads 4 MiB segments (at the file's multiples of 4 MiB, so each
    stays inside one 8 MiB part), 8 at once."""
    tier, loaded = _after_compressed_load(tmp_path, 128 * MiB, 1e9, 40 * MiB)
    with ThreadPoolExecutor(4) as pool:  # 4 reader threads: 8 fetch threads
        probe_after_load(tier, loaded, 0, pool)  # type: ignore[arg-type]
    assert sorted(tier.backend.reads) == [(o, 4 * MiB) for o in range(0, 32 * MiB, 4 * MiB)]
    assert tier.backend.most == 8
