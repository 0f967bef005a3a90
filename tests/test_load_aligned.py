"""A load's ranged GETs are cut at the file's multiples of the segment size (one uploaded
part each), not at the chunk's: an object uploaded in parts is stored part by part, and a GET
that straddles two parts costs the store two reads (SeaweedFS, on the cores the client
shares: measurably more server CPU per load)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from helpers import assert_same

import tierckpt.restore._chunks as chunks_mod
from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.restore import read_index, read_manifest
from tierckpt.restore._fetch import StreamedFetch

#: the segment size in these tests: not a divisor of the chunk size, so chunks start
#: between segment boundaries
PIECE = 640 << 10
CHUNK = 1 << 20


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    out: dict[str, Any] = {}
    for i in range(24):
        n = 200_000 if i % 5 == 0 else 3_000 + 517 * i  # large tensors among small ones
        out[f"t{i}"] = torch.randn(n, generator=g)
    return out


@pytest.mark.s3
def test_s3_raw_load_gets_never_straddle_a_part_boundary(
    seaweedfs_server: Any, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    url, endpoint = f"s3://{bucket}/ck", seaweedfs_server.endpoint_url
    state = _state()
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
    monkeypatch.setattr(chunks_mod, "PIECE_BYTES", PIECE)
    gets: list[tuple[int, int]] = []
    real = ObjectStoreBackend._fetch

    def recording(self: ObjectStoreBackend, key: str, pieces: Any) -> None:
        if key.endswith(".tck"):
            gets.extend((start, len(view)) for start, view in pieces)
        real(self, key, pieces)

    monkeypatch.setattr(ObjectStoreBackend, "_fetch", recording)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        assert_same(ck.load(), state)
        backend = ck._tiers[0].backend
        index, _blob, _footer = read_index(
            backend, read_manifest(backend, 1, "t").shard_for(0), "t"
        )
    chunks = index["chunks"]
    assert any(c.file_offset % PIECE for c in chunks), "no chunk starts between boundaries"
    data_end = max(c.file_offset + c.stored_size for c in chunks)
    data = sorted((o, n) for o, n in gets if o < data_end)
    # every stored byte fetched exactly once, by GETs that each stay inside one part
    assert sum(n for _o, n in data) == sum(c.stored_size for c in chunks)
    assert all(o // PIECE == (o + n - 1) // PIECE for o, n in data), data


class Recorded(LocalBackend):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[int, int]] = []

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        self.reads.append((offset, len(out)))
        super().read_into(name, offset, out)


def test_streamed_fetch_cuts_pieces_at_the_files_multiples(tmp_path: Path) -> None:
    blob = bytes(range(256)) * 16
    (tmp_path / "f").write_bytes(blob)
    backend = Recorded(tmp_path)
    into = memoryview(bytearray(1000))
    with ThreadPoolExecutor(3) as pool:
        fetch = StreamedFetch(backend, "f", 1000, into, pool, piece_bytes=256)
        try:
            digest = fetch.finish()
        finally:
            fetch.close()
    assert sorted(backend.reads) == [(1000, 24), (1024, 256), (1280, 256), (1536, 256), (1792, 208)]
    assert bytes(into) == blob[1000:2000]
    assert digest == xxhash.xxh3_64_hexdigest(blob[1000:2000])
