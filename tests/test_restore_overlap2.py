"""A remote load's work beside its GETs, taken off the critical path: the part around a boundary
of two raw chunks is one GET for both (not one each), the first chunk's GETs go out before the
other storages are allocated, and the tree is decoded while the bytes download (not where it
holds a quantized tensor, whose rebuild reads them). Checksums still guard every chunk: a
corrupt byte on either side of a shared part fails the load naming its chunk, tier and file,
and ``load(into=)`` leaves the caller's tensors untouched."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import tierckpt.restore._shard as shard_mod
from tierckpt import Checkpointer, CorruptCheckpoint, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.bench.scale import classify
from tierckpt.restore import read_index, read_manifest, read_shard
from tierckpt.restore._fetch import PIECE_BYTES
from tierckpt.testing.faultproxy import FaultProxy
from tierckpt.testing.s3servers import S3Server

CHUNK = 16 << 20


def _state() -> dict[str, torch.Tensor]:
    """~42 MB in 4 chunks of 16 MiB: the dtype change cuts a short chunk, so the two later
    chunk boundaries fall inside 8 MiB parts (with padding between the chunks)."""
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(1_000_003 + 7 * i, generator=g) for i in range(6)}
    state |= {
        f"h{i}": torch.randn(1_500_001 + 3 * i, generator=g).to(torch.bfloat16) for i in range(6)
    }
    state |= {f"s{i}": torch.randn(1001 + i, generator=g) for i in range(30)}
    return state


def _parts_and_splits(backend: Any) -> tuple[str, int, int]:
    """The shard file, the parts its data spans, and the chunk boundaries inside a part."""
    ref = read_manifest(backend, 1, "t").shard_for(0)
    chunks = read_index(backend, ref, "t")[0]["chunks"]
    lo, hi = chunks[0].file_offset, chunks[-1].file_offset + chunks[-1].stored_size
    parts = (hi - 1) // PIECE_BYTES - lo // PIECE_BYTES + 1
    splits = sum(
        1
        for a, b in itertools.pairwise(chunks)
        if (a.file_offset + a.stored_size - 1) // PIECE_BYTES == b.file_offset // PIECE_BYTES
    )
    return ref.file, parts, splits


@pytest.mark.s3
def test_a_part_across_a_chunk_boundary_is_one_get(
    s3_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    """Requests counted at a proxy in front of the store: one GET per 8 MiB part the data
    spans (plus the file's tail), where a GET per chunk share sent one more per boundary."""
    bucket = s3_bucket(s3_server)
    url = f"s3://{bucket}/run"
    state = _state()
    with FaultProxy(s3_server.endpoint_url) as proxy:
        tier = S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw", name="t")
        with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
            ck.save(state, step=1).result()
            file, parts, splits = _parts_and_splits(ck.backend("t"))
        assert splits == 2  # the layout this test is about
        tier = S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw", name="t")
        with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
            proxy.requests.clear()
            got = ck.load()
            seen = [classify(r, bucket) for r in proxy.requests]
    assert_same(got, state)
    file_gets = [rel for kind, _top, rel in seen if kind == "GET" and rel.endswith(file)]
    assert len(file_gets) == parts + 1, (parts, splits, seen)  # + the tail (index, footer)


class _Remote(LocalBackend):
    """A local file read as a remote store is (fetch pool, ranged scatter reads), each
    read announced to ``on_read``."""

    on_read: Callable[[int, int], None] = staticmethod(lambda offset, n: None)

    @property
    def is_remote(self) -> bool:
        return True

    def read_into_pieces(self, name: str, offset: int, outs: Any) -> None:
        self.on_read(offset, sum(len(o) for o in outs))
        super().read_into_pieces(name, offset, outs)


def _saved(tmp_path: Path, state: Any, chunk: int = CHUNK) -> _Remote:
    with Checkpointer([LocalTier(tmp_path, codec="raw", name="t")], chunk_bytes=chunk) as ck:
        ck.save(state, step=1).result()
    return _Remote(tmp_path)


class _CountingTorch:
    """``torch`` as ``tierckpt.restore._shard`` sees it, its ``empty`` calls counted: at the
    last storage's allocation it waits (up to 10 s) for the first data read to have begun."""

    def __init__(self, storages: int, fetched: threading.Event) -> None:
        self._storages, self._fetched = storages, fetched
        self.calls = 0
        self.fetched_before_last: bool | None = None

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == self._storages:
            self.fetched_before_last = self._fetched.wait(10)
        return torch.empty(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def test_first_data_read_is_issued_before_every_storage_is_allocated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first chunk's GETs go out once its own storages exist; the others are allocated
    while they download. Before: all 42 storages first, then the first read."""
    state = _state()
    backend = _saved(tmp_path, state)
    storages = len(
        read_index(backend, read_manifest(backend, 1, "t").shard_for(0), "t")[0]["storages"]
    )
    fetched = threading.Event()
    backend.on_read = lambda offset, n: fetched.set()
    counting = _CountingTorch(storages, fetched)
    monkeypatch.setattr(shard_mod, "torch", counting)
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", read_manifest(backend, 1, "t"), 0, pool)
    assert_same(loaded.state, state)
    assert counting.calls == storages
    assert counting.fetched_before_last is True


def _last_chunk_gate(
    backend: _Remote, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, list[str]]:
    """Reads of the last chunk's bytes wait (up to 10 s) until the tree was decoded; the
    order of the tree's decode and the last read is recorded."""
    ref = read_manifest(backend, 1, "t").shard_for(0)
    last = read_index(backend, ref, "t")[0]["chunks"][-1]
    decoded = threading.Event()
    order: list[str] = []

    def on_read(offset: int, n: int) -> None:
        if offset + n > last.file_offset:
            decoded.wait(10)
            order.append("last read")

    real = shard_mod.decode_tree

    def decode(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        order.append("tree")
        decoded.set()
        return out

    backend.on_read = on_read
    monkeypatch.setattr(shard_mod, "decode_tree", decode)
    return decoded, order


def test_tree_is_decoded_while_the_bytes_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tree (a few ms for a thousand tensors) is built before the last chunk arrived;
    the load still returns only once every chunk was read and checked. Before: after."""
    state = {"model": _state(), "step": 3, "names": ["a", "b"]}
    backend = _saved(tmp_path, state, chunk=1 << 20)
    _decoded, order = _last_chunk_gate(backend, monkeypatch)
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", read_manifest(backend, 1, "t"), 0, pool)
    assert_same(loaded.state, state)
    assert order[0] == "tree" and "last read" in order, order


def test_a_quantized_tensor_waits_for_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree holding a quantized tensor is decoded only once every chunk is in (its rebuild
    copies the integers): the gated last read goes first, and the values are right."""
    q = torch.quantize_per_tensor(torch.randn(300_000), 0.05, 3, torch.qint8)
    state = {"model": _state(), "q": q}
    backend = _saved(tmp_path, state, chunk=1 << 20)
    decoded, order = _last_chunk_gate(backend, monkeypatch)
    decoded.set()  # nothing waits: the order alone tells
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", read_manifest(backend, 1, "t"), 0, pool)
    assert order[-1] == "tree", order
    assert torch.equal(loaded.state["q"].int_repr(), q.int_repr())
    assert_same(loaded.state["model"], state["model"])


@pytest.mark.s3
@pytest.mark.parametrize("side", ["end of the earlier chunk", "start of the later chunk"])
def test_corrupt_byte_in_a_shared_part_fails_the_load(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], side: str
) -> None:
    """One flipped byte on either side of a part two chunks share: the load fails naming the
    chunk that holds it, its tier and file, and ``load(into=)`` changes nothing."""
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    state = _state()
    with Checkpointer(
        [S3Tier(url, endpoint_url=moto_server.endpoint_url, codec="raw", name="t")],
        chunk_bytes=CHUNK,
    ) as ck:
        ck.save(state, step=1).result()
        backend = ck.backend("t")
        ref = read_manifest(backend, 1, "t").shard_for(0)
        chunks = read_index(backend, ref, "t")[0]["chunks"]
    # the last boundary of the layout: chunks 2 and 3 share the part chunk 3 starts in
    a, b = chunks[2], chunks[3]
    assert (a.file_offset + a.stored_size - 1) // PIECE_BYTES == b.file_offset // PIECE_BYTES
    bad, pos = (
        (2, a.file_offset + a.stored_size - 5)
        if side.startswith("end")
        else (
            3,
            b.file_offset + 5,
        )
    )
    key = f"run/{ref.file}"
    body = bytearray(moto_server.admin.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[pos] ^= 0xFF
    moto_server.admin.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    with (
        Checkpointer(
            [S3Tier(url, endpoint_url=moto_server.endpoint_url, codec="raw", name="t")],
            chunk_bytes=CHUNK,
        ) as ck,
        pytest.raises(CorruptCheckpoint) as err,
    ):
        ck.load(into=target)
    msg = str(err.value)
    assert f"chunk {bad} " in msg and "tier 't'" in msg and ref.file in msg, msg
    assert all(not v.any() for v in target.values())
