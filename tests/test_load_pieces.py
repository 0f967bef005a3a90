"""Raw chunks from an object store land straight in their storages: fetched in segments on
the fetch pool (no chunk-sized buffer, small tensors' runs through a small one), checked
against the chunk's checksum before the load returns; fresh storages are faulted in bulk."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import tierckpt.restore._chunks as chunks_mod
import tierckpt.restore._prefault as prefault_mod
import tierckpt.restore._scatter as scatter_mod
from tierckpt import Checkpointer, CorruptCheckpoint, CorruptChunk, LocalTier, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.format import shard_name
from tierckpt.restore import read_index, read_manifest, read_shard

CHUNK = 1 << 20
PIECE = 128 << 10


def mixed_state() -> dict[str, Any]:
    """Large tensors (straight into their storages) among runs of small ones (buffered), views
    sharing storages, two dtypes, an empty tensor; most chunks span several storages."""
    gen = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {}
    for i in range(40):
        n = 300_000 if i % 7 == 0 else 50 + 97 * i  # 1.2 MB fp32 among small ones
        state[f"t{i}"] = torch.randn(n, generator=gen).to(
            torch.bfloat16 if i % 3 == 1 else torch.float32
        )
    base = torch.randn(300, 200, generator=gen)
    state.update(base=base, rows=base[5:9], tr=base.t(), empty=torch.empty(0, 3))
    return state


class RemoteFiles(LocalBackend):
    """Local files served as a remote store without a cheap scatter read would be:
    ``is_remote``, one ranged read per piece, each read recorded (offset, length)."""

    read_into_pieces = Backend.read_into_pieces  # one read_into per piece

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[int, int]] = []

    @property
    def is_remote(self) -> bool:
        return True

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        if name.endswith(".tck"):
            self.reads.append((offset, len(out)))
        super().read_into(name, offset, out)


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", PIECE)


def _save(root: Path, state: Any) -> None:
    with Checkpointer([LocalTier(root, codec="raw", keep_last=None)], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()


@pytest.fixture
def saved(tmp_path: Path) -> dict[str, Any]:
    """:func:`mixed_state`, saved raw as step 1 to a local tier at ``tmp_path`` (chunks of
    ``CHUNK``)."""
    state = mixed_state()
    _save(tmp_path, state)
    return state


def _read(backend: Any) -> Any:
    manifest = read_manifest(backend, 1, "t")
    with ThreadPoolExecutor(2) as pool:
        return read_shard(backend, "t", manifest, 0, pool)


def test_remote_raw_chunks_land_in_their_storages_without_a_chunk_buffer(
    tmp_path: Path, saved: dict[str, Any], small_segments: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved
    backend = RemoteFiles(tmp_path)
    sizes: list[int] = []
    real_empty = torch.empty

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        t = real_empty(*args, **kw)
        if t.dtype == torch.uint8:
            sizes.append(t.numel())
        return t

    monkeypatch.setattr(chunks_mod.torch, "empty", spy)
    import tierckpt.restore._layout as layout_mod

    monkeypatch.setattr(layout_mod.torch, "empty", spy)
    loaded = _read(backend)
    monkeypatch.undo()
    manifest = read_manifest(backend, 1, "t")
    index, _blob, _footer = read_index(backend, manifest.shard_for(0), "t")
    data_end = max(c.file_offset + c.stored_size for c in index["chunks"])
    # the data reads (not the read of the tail: footer, index)
    backend.reads = [(o, n) for o, n in backend.reads if o + n <= data_end]
    assert_same(loaded.state, state)
    spans = {v.untyped_storage().nbytes() for v in state.values()}
    scratch = [n for n in sizes if n not in spans]
    # a store whose scatter read costs a request per piece: the chunk goes through one
    # buffer per reader thread (never more than a chunk), one part-sized read per segment
    assert scratch and max(scratch) <= CHUNK, scratch
    assert len(scratch) <= 2, f"more than one buffer per reader thread: {scratch}"
    assert max(n for _o, n in backend.reads) <= PIECE
    # one read per part-sized block of the file a chunk touches (cut at the file's multiples
    # of the segment size), never across two blocks
    assert all(o // PIECE == (o + n - 1) // PIECE for o, n in backend.reads)
    blocks = [
        (c.file_offset + c.stored_size - 1) // PIECE - c.file_offset // PIECE + 1
        for c in index["chunks"]
    ]
    assert len(backend.reads) == sum(blocks)
    # every stored byte is read exactly once
    reads = sorted(backend.reads)
    assert all(a + n <= b for (a, n), (b, _m) in itertools.pairwise(reads))
    assert sum(n for _o, n in reads) == loaded.stored_bytes


class SpreadFiles(LocalBackend):
    """A remote store with a cheap scatter read (as obstore's: part-sized GETs spread over
    the pieces), served from local files."""

    @property
    def is_remote(self) -> bool:
        return True


def test_remote_raw_chunks_with_a_cheap_scatter_read_need_no_buffer(
    tmp_path: Path, saved: dict[str, Any], small_segments: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved
    sizes: list[int] = []
    real_empty = torch.empty

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        t = real_empty(*args, **kw)
        if t.dtype == torch.uint8:
            sizes.append(t.numel())
        return t

    import tierckpt.restore._layout as layout_mod

    monkeypatch.setattr(layout_mod.torch, "empty", spy)
    monkeypatch.setattr(chunks_mod.torch, "empty", spy)
    loaded = _read(SpreadFiles(tmp_path))
    monkeypatch.undo()
    assert_same(loaded.state, state)
    spans = {v.untyped_storage().nbytes() for v in state.values()}
    assert [n for n in sizes if n not in spans] == [], "a buffer was allocated"


def test_remote_raw_corrupt_chunk_is_named_and_fails_the_load(
    tmp_path: Path, saved: dict[str, Any], small_segments: None
) -> None:
    f = tmp_path / shard_name(1, 0)
    data = bytearray(f.read_bytes())
    data[CHUNK + 4_321] ^= 0x10  # inside chunk 1
    f.write_bytes(data)
    with pytest.raises(CorruptChunk, match=r"chunk 1 .*checksum") as ei:
        _read(RemoteFiles(tmp_path))
    assert ei.value.chunk == 1


def test_s3_raw_load_into_is_exact_and_a_corrupt_object_leaves_the_target_untouched(
    seaweedfs_server: Any, s3_bucket: Any, small_segments: None
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    state = mixed_state()
    url = f"s3://{bucket}/run"
    endpoint = seaweedfs_server.endpoint_url
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
    target = {k: torch.zeros_like(v) for k, v in state.items() if k.startswith("t")}
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.load(into=target, strict=False)
    for k, v in target.items():
        assert torch.equal(v, state[k]), k
    # corrupt one byte of chunk 2 in the stored object: the load fails, the target keeps
    # every value it had
    admin = seaweedfs_server.admin
    key = next(
        o["Key"]
        for o in admin.list_objects_v2(Bucket=bucket, Prefix="run/")["Contents"]
        if o["Key"].endswith(".tck")
    )
    body = bytearray(admin.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[2 * CHUNK + 999] ^= 0x01
    admin.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    before = {k: v.clone() for k, v in target.items()}
    for v in target.values():
        v.add_(1)  # values the load must not touch
    expect = {k: v + 1 for k, v in before.items()}
    tier = S3Tier(url, endpoint_url=endpoint, codec="raw")
    with Checkpointer([tier]) as ck, pytest.raises(CorruptCheckpoint, match=r"chunk 2 .*checksum"):
        ck.load(into=target, strict=False)
    for k, v in target.items():
        assert torch.equal(v, expect[k]), k


def test_segments_split_pieces_at_the_step_and_keep_file_order() -> None:
    buf = bytearray(range(256)) * 4
    views = [memoryview(buf)[0:300], memoryview(buf)[300:310], memoryview(buf)[310:1024]]
    segs = scatter_mod.segments(views, 1000, 256)
    # cut at the file's multiples of the step, not the chunk's
    assert [off for off, _v in segs] == [1000, 1024, 1280, 1536, 1792]
    assert [sum(len(v) for v in vs) for _o, vs in segs] == [24, 256, 256, 256, 232]
    assert b"".join(bytes(v) for _o, vs in segs for v in vs) == bytes(buf)


def test_fresh_storages_are_faulted_in_bulk_before_the_read(
    tmp_path: Path, saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved
    calls: list[tuple[int, int, int]] = []

    def fake_madvise(addr: int, n: int, advice: int) -> int:
        calls.append((addr, n, advice))
        return 0

    monkeypatch.setattr(prefault_mod, "_madvise", fake_madvise)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        loaded = ck.load()
    assert_same(loaded, state)
    assert calls, "no storage range was populated"
    assert all(a % 4096 == 0 and n % 4096 == 0 and adv == 23 for a, n, adv in calls)
    # the ranges lie inside the loaded storages
    spans = [
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in loaded.values()
    ]
    for a, n, _adv in calls:
        assert any(p <= a and a + n <= p + m for p, m in spans), (a, n)


def test_a_refused_prefault_is_skipped_for_good_and_the_load_goes_on(
    tmp_path: Path, saved: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = saved
    calls: list[int] = []

    def refusing(addr: int, n: int, advice: int) -> int:
        calls.append(n)
        return -1  # EINVAL: a kernel without MADV_POPULATE_WRITE

    monkeypatch.setattr(prefault_mod, "_madvise", refusing)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert_same(ck.load(), state)
    assert len(calls) == 1
    assert prefault_mod._madvise is None


def test_obstore_scatter_read_spreads_part_sized_gets_over_the_pieces(
    seaweedfs_server: Any, s3_bucket: Any
) -> None:
    """One ranged GET per part, not per piece: many small pieces cost a few requests, and
    every byte lands in its piece."""
    bucket = s3_bucket(seaweedfs_server)
    b = ObjectStoreBackend(
        f"s3://{bucket}/x", endpoint_url=seaweedfs_server.endpoint_url, part_size=5 << 20
    )
    try:
        data = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8).numpy().tobytes()
        b.put_atomic("obj", data)
        sizes = [1, 7, 4096, 3 << 20, 100, 5 << 20, 33, 2 << 20, 1]
        bufs = [bytearray(n) for n in sizes]
        gets: list[int] = []
        real = b._fetch

        def counting(key: str, pieces: Any) -> None:
            gets.append(len(pieces))
            real(key, pieces)

        b._fetch = counting  # type: ignore[method-assign]
        b.read_into_pieces("obj", 1234, [memoryview(x) for x in bufs])
        total = sum(sizes)
        assert b"".join(bufs) == data[1234 : 1234 + total]
        assert sum(gets) == -(-total // (5 << 20))  # ceil: one GET per part
        with pytest.raises(Exception, match="past its end|negative"):
            b.read_into_pieces("obj", len(data) - 10, [memoryview(bytearray(8))] * 2)
    finally:
        b.close()
