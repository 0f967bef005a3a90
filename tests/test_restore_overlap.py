"""Fetch and decode overlap on load, and the auto policy's restore veto.

A compressed chunk whose codec decodes progressively (planes) is fetched in pieces while the
reader thread decodes the prefix that arrived: proven with a gate (the fetch of the chunk's
last piece waits until a segment has been decoded), not with timings. Loads are bit-exact for
every codec, locally and from S3; a corrupt or failing piece names the chunk; and the auto
policy stores raw chunks where the link reads faster than the decoders decode, or where
compressed loads were measured slower than raw ones.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, zoo_state

import tierckpt.codecs.planes as planes_mod
import tierckpt.restore._fetch as fetch_mod
from tierckpt import Checkpointer, CorruptChunk, LocalTier, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.codecs import PlanesCodec, RawCodec, ZstdCodec
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.codecs.auto import CodecProfile, restore_pays, restore_seconds
from tierckpt.errors import BackendError
from tierckpt.format import shard_name
from tierckpt.restore import read_index, read_manifest, read_shard

CHUNK = 1 << 20
PIECE = 64 << 10


def float_state() -> dict[str, Any]:
    """Compressible floats (randn: the exponent plane shrinks), a few chunks' worth."""
    gen = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(3 * CHUNK // 4, generator=gen),  # 3 MiB of float32: 3 chunks
        "b": torch.randn(1000, generator=gen).to(torch.bfloat16),
        "step": 5,
    }


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of 64 KiB and planes segments of 64 KiB, so a 1 MiB chunk has many of each."""
    monkeypatch.setattr(fetch_mod, "PIECE_BYTES", PIECE)
    monkeypatch.setattr(planes_mod, "_SEGMENT_BYTES", 64 << 10)


class GatedBackend(LocalBackend):
    """A local tier whose reads of a chunk's last bytes wait until a segment was decoded."""

    def __init__(self, root: Path, decoded: threading.Event, ends: set[int]) -> None:
        super().__init__(root)
        self.decoded = decoded
        self.ends = ends  # file offsets where compressed chunks end
        self.waited_in_vain = 0
        self.gated_reads = 0

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if offset + len(out) in self.ends:
            self.gated_reads += 1
            if not self.decoded.wait(20):  # generous: only a failure waits this long
                self.waited_in_vain += 1
        super().read_into(name, offset, out)


def _save(root: Path, state: Any, codec: Any) -> None:
    with Checkpointer([LocalTier(root, codec=codec, keep_last=None)], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()


def _read(backend: Backend, threads: int = 2) -> Any:
    manifest = read_manifest(backend, 1, "t")
    with ThreadPoolExecutor(threads) as pool:
        return read_shard(backend, "t", manifest, 0, pool)


def test_decode_starts_before_the_chunks_last_byte_arrives(
    tmp_path: Path, small_pieces: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = float_state()
    _save(tmp_path, state, PlanesCodec(threads=1))
    index = read_index(
        LocalBackend(tmp_path), read_manifest(LocalBackend(tmp_path), 1, "t").shard_for(0), "t"
    )[0]
    codecs = index["codecs"]
    planes_chunks = [
        c
        for c in index["chunks"]
        if codecs[c.codec]["id"] == "planes" and c.stored_size > 4 * PIECE
    ]
    assert len(planes_chunks) >= 2
    decoded = threading.Event()
    merge = planes_mod._merge

    def merge_and_tell(*args: Any) -> None:
        merge(*args)
        decoded.set()  # a segment of some chunk is in its storage

    monkeypatch.setattr(planes_mod, "_merge", merge_and_tell)
    backend = GatedBackend(
        tmp_path, decoded, {c.file_offset + c.stored_size for c in planes_chunks}
    )
    loaded = _read(backend)
    assert backend.gated_reads == len(planes_chunks)
    # every chunk's last piece was fetched only after a segment had been decoded: the whole
    # chunk read first would have waited for a decode that cannot start
    assert backend.waited_in_vain == 0
    assert_same(loaded.state, state)
    assert loaded.compressed


@pytest.mark.parametrize(
    "codec",
    [RawCodec(), ZstdCodec(), PlanesCodec(threads=1), PlanesCodec(threads=2), "auto"],
    ids=["raw", "zstd", "planes1", "planes2", "auto"],
)
def test_bit_exact_across_codecs_local(tmp_path: Path, small_pieces: None, codec: Any) -> None:
    state = {**zoo_state(), **float_state()}
    _save(tmp_path, state, codec)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=CHUNK) as ck:
        assert_same(ck.load(), state)


@pytest.mark.parametrize("codec", ["planes", "zstd", "raw"])
def test_bit_exact_from_s3(
    seaweedfs_server: Any, s3_bucket: Any, small_pieces: None, codec: str
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    state = {**zoo_state(), **float_state()}
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=seaweedfs_server.endpoint_url, codec=codec)
    with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=seaweedfs_server.endpoint_url, codec=codec)
    with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
        assert_same(ck.load(), state)
        target = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v)
            for k, v in state.items()
            if k in ("w", "b", "step")
        }
        ck.load(into=target, strict=False)
        assert_same(target["w"], state["w"])


def _planes_chunk(root: Path) -> Any:
    backend = LocalBackend(root)
    index = read_index(backend, read_manifest(backend, 1, "t").shard_for(0), "t")[0]
    return next(c for c in index["chunks"] if index["codecs"][c.codec]["id"] == "planes")


@pytest.mark.parametrize("where", ["header", "last piece"])
def test_a_corrupt_piece_names_the_chunk(tmp_path: Path, small_pieces: None, where: str) -> None:
    _save(tmp_path, float_state(), PlanesCodec(threads=1))
    rec = _planes_chunk(tmp_path)
    pos = rec.file_offset + (5 if where == "header" else rec.stored_size - 3)
    path = tmp_path / shard_name(1, 0)
    data = bytearray(path.read_bytes())
    data[pos] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptChunk, match="does not match its checksum") as info:
        _read(LocalBackend(tmp_path))
    assert info.value.chunk is not None and "chunk" in str(info.value)


class FailingBackend(LocalBackend):
    """Fails the read of one piece; counts reads still running when the load returned."""

    def __init__(self, root: Path, fail_at: int) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.running = 0
        self.lock = threading.Lock()

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        with self.lock:
            self.running += 1
        try:
            if offset == self.fail_at:
                raise BackendError(f"{self.url}/{name}: injected failure at {offset}")
            super().read_into(name, offset, out)
        finally:
            with self.lock:
                self.running -= 1


def test_a_failing_piece_fails_the_load_and_leaves_no_fetch_running(
    tmp_path: Path, small_pieces: None
) -> None:
    _save(tmp_path, float_state(), PlanesCodec(threads=1))
    rec = _planes_chunk(tmp_path)
    backend = FailingBackend(tmp_path, rec.file_offset + 2 * PIECE)
    with pytest.raises(BackendError, match="injected failure"):
        _read(backend)
    assert backend.running == 0  # nothing writes into a buffer after the load gave up


# -- the auto policy's restore veto ----------------------------------------------------------
def _profile(decode_bps: float, ratio: float = 0.7, encode_bps: float = 1e9) -> CodecProfile:
    return CodecProfile(PlanesCodec(threads=1), encode_bps, decode_bps, ratio)


def test_restore_pays_exactly_when_the_decoders_outrun_the_link() -> None:
    prof = _profile(decode_bps=400e6)
    assert restore_pays(prof, 300e6, parallel=1)  # link slower than one decoder
    assert not restore_pays(prof, 500e6, parallel=1)  # link faster than one decoder
    assert restore_pays(prof, 500e6, parallel=2)  # ... but not than two
    assert restore_seconds(1 << 30, 1e9) == (1 << 30) / 1e9
    # link-bound: a compressed restore moves fewer bytes
    assert restore_seconds(1 << 30, 100e6, prof, parallel=4) == pytest.approx(
        (1 << 30) * 0.7 / 100e6
    )


def _auto_with(decode_bps: float) -> AdaptiveCodec:
    codec = AdaptiveCodec(remote=True, parallel=1)
    codec._profiles["float4"] = _profile(decode_bps=decode_bps, encode_bps=10e9)
    return codec


def test_auto_keeps_compressing_while_the_restore_gains() -> None:
    codec = _auto_with(decode_bps=2e9)
    codec.observe(100 << 20, 1.0)  # a 100 MiB/s link: compressing saves time both ways
    assert not codec.for_dtype("float32").is_passthrough
    codec.observe_read(100 << 20, 100 << 20, 1.0, compressed=False)
    assert not codec.for_dtype("float32").is_passthrough


def test_auto_goes_raw_when_the_link_reads_faster_than_the_decoder() -> None:
    codec = _auto_with(decode_bps=200e6)
    codec.observe(100 << 20, 1.0)  # the save alone would compress (encoder at 10 GB/s)
    assert not codec.for_dtype("float32").is_passthrough
    codec.observe_read(1 << 30, 1 << 30, 1.0, compressed=False)  # reads at 1 GiB/s
    assert codec.for_dtype("float32").is_passthrough
    assert codec.describe()["read_link_bps"] == pytest.approx(1 << 30)


def test_auto_goes_raw_when_compressed_loads_were_slower_than_raw_ones() -> None:
    codec = _auto_with(decode_bps=10e9)
    codec.observe(100 << 20, 1.0)
    codec.observe_read(100 << 20, 100 << 20, 1.0, compressed=False)  # 100 MiB/s raw
    codec.observe_read(50 << 20, 100 << 20, 2.0, compressed=True)  # 50 MiB/s compressed
    assert codec.for_dtype("float32").is_passthrough


def test_a_load_tells_the_tiers_auto_policy_what_it_measured(tmp_path: Path) -> None:
    state = float_state()
    codec = AdaptiveCodec(remote=True, parallel=1)
    with Checkpointer([LocalTier(tmp_path, codec=codec, keep_last=None)], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
        assert codec.describe()["read_compressed_bps"] is None
        assert_same(ck.load(), state)
        seen = codec.describe()
    assert seen["read_compressed_bps"] is not None or seen["read_link_bps"] is not None
