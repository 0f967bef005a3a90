"""A remote load's first data parts are fetched while the shard file's tail (footer and index)
is read, not after the index arrived and was decoded (``tierckpt.restore._early``): the file's
name and size come from the manifest. What they hold is trusted no more than before: a shard
file that disagrees with its manifest (truncated, its index changed, a data byte changed in
an early part) still fails that tier's load with a clear error, and the load goes on to the
next tier holding the checkpoint."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, CorruptCheckpoint, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.format import FOOTER_SIZE
from tierckpt.restore import read_index, read_manifest, read_shard
from tierckpt.restore._fetch import PIECE_BYTES
from tierckpt.testing.s3servers import S3Server

CHUNK = 16 << 20


def _state() -> dict[str, torch.Tensor]:
    """~42 MB in chunks of 16 MiB: five whole 8 MiB parts."""
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(1_000_003 + 7 * i, generator=g) for i in range(6)}
    state |= {
        f"h{i}": torch.randn(1_500_001 + 3 * i, generator=g).to(torch.bfloat16) for i in range(6)
    }
    state |= {f"s{i}": torch.randn(1001 + i, generator=g) for i in range(30)}
    return state


class _Remote(LocalBackend):
    """A local file read as a remote store is (fetch pool, ranged scatter reads). Its tail
    read waits (up to ``patience`` s) for an early part's fetch to have begun, and records
    whether one had; every read is logged as ``(kind, offset, length)``."""

    patience = 5.0

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.early_began = threading.Event()
        self.early_before_tail: bool | None = None
        self.log: list[tuple[str, int, int]] = []

    @property
    def is_remote(self) -> bool:
        return True

    def read_tail(self, name: str, length: int) -> tuple[int, Any]:
        self.early_before_tail = self.early_began.wait(self.patience)
        return super().read_tail(name, length)

    def read_owned(self, name: str, offset: int, length: int) -> Any:
        self.log.append(("owned", offset, length))
        self.early_began.set()
        return super().read(name, offset, length)

    def read_into_pieces(self, name: str, offset: int, outs: Any) -> None:
        self.log.append(("pieces", offset, sum(len(o) for o in outs)))
        super().read_into_pieces(name, offset, outs)


def _saved(tmp_path: Path, state: Any) -> _Remote:
    with Checkpointer([LocalTier(tmp_path, codec="raw", name="t")], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
    return _Remote(tmp_path)


def test_first_parts_are_fetched_while_the_tail_is_read(tmp_path: Path) -> None:
    """The first data parts' fetches begin before the tail (footer and index) is answered,
    and the chunk reads they cover are served from them, not fetched again. Before: the
    tail first, then (index decoded) every data read."""
    state = _state()
    backend = _saved(tmp_path, state)
    manifest = read_manifest(backend, 1, "t")
    size = manifest.shard_for(0).size
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", manifest, 0, pool)
    assert_same(loaded.state, state)
    assert backend.early_before_tail is True
    owned = sorted(o for k, o, _n in backend.log if k == "owned")
    assert owned == [i * PIECE_BYTES for i in range(min(4, size // PIECE_BYTES))]
    # no backend read of bytes an early part holds
    early_end = owned[-1] + PIECE_BYTES
    again = [(o, n) for k, o, n in backend.log if k == "pieces" and o < early_end]
    assert again == [], again


def test_a_file_smaller_than_a_part_is_read_as_before(tmp_path: Path) -> None:
    state = {"a": torch.arange(1000.0), "b": torch.ones(3, dtype=torch.int64)}
    backend = _saved(tmp_path, state)
    backend.patience = 0.0
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", read_manifest(backend, 1, "t"), 0, pool)
    assert_same(loaded.state, state)
    assert [k for k, _o, _n in backend.log if k == "owned"] == []


def _file_of(backend: Any) -> tuple[str, int, int]:
    """The shard file, its size and its first chunk's file offset."""
    ref = read_manifest(backend, 1, "t").shard_for(0)
    chunks = read_index(backend, ref, "t")[0]["chunks"]
    return ref.file, ref.size, chunks[0].file_offset


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


@pytest.mark.s3
@pytest.mark.parametrize("damage", ["early_data_byte", "index_byte", "truncated", "replaced"])
def test_a_file_that_disagrees_with_its_manifest_fails_and_the_next_tier_loads(
    s3_server: S3Server, s3_bucket: Callable[[S3Server], str], damage: str
) -> None:
    """Two S3 tiers hold step 1; the first's shard file is damaged after the commit. Its
    load fails naming the file (a data byte inside an early-fetched part: that chunk's
    checksum; an index byte: the index checksum; a shorter or longer file: the manifest's
    size) and the second tier's copy is loaded. With only the damaged tier: the error."""
    bucket = s3_bucket(s3_server)
    ep = s3_server.endpoint_url
    state = _state()

    def tiers() -> list[S3Tier]:
        return [
            S3Tier(f"s3://{bucket}/a", endpoint_url=ep, codec="raw", name="a"),
            S3Tier(f"s3://{bucket}/b", endpoint_url=ep, codec="raw", name="b"),
        ]

    with Checkpointer(tiers(), chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
        file, size, first = _file_of(ck.backend("a"))
    key = f"a/{file}"
    data = s3_server.admin.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(data) == size and size >= 2 * PIECE_BYTES
    if damage == "early_data_byte":
        data = _flip(data, first + PIECE_BYTES // 2)  # inside the first (early) part
    elif damage == "index_byte":
        data = _flip(data, size - FOOTER_SIZE - 10)
    elif damage == "truncated":
        data = data[: size - PIECE_BYTES]
    else:  # a longer file in its place, the same first parts
        data = data + b"\0" * 4096
    s3_server.admin.put_object(Bucket=bucket, Key=key, Body=data)
    with Checkpointer(tiers(), chunk_bytes=CHUNK) as ck:
        got = ck.load()
    assert_same(got, state)
    only_a = [S3Tier(f"s3://{bucket}/a", endpoint_url=ep, codec="raw", name="a")]
    with Checkpointer(only_a, chunk_bytes=CHUNK) as ck, pytest.raises(CorruptCheckpoint) as err:
        ck.load()
    msg = str(err.value)
    assert file in msg, msg
    expect = {
        "early_data_byte": "chunk 0",
        "index_byte": "index bytes do not match their checksum",
        "truncated": "truncated or replaced",
        "replaced": "truncated or replaced",
    }[damage]
    assert expect in msg, msg
