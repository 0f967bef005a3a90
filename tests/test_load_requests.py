"""The requests a load sends before its first data GET: each one is a round trip the whole
job waits for after a failure. Through obstore a load of one S3 tier sends a LIST, one GET
of the manifest (its size from the GET's own headers, no HEAD) and one GET of the shard
file's tail (footer and index together, the file's size from the same answer), then the data
GETs; and a load through a policy of several tiers lists each tier once, also when a peer
replicator's ``prepare_load`` listed it first."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import tierckpt.restore._index as index_mod
from tierckpt import Checkpointer, CorruptCheckpoint, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.bench.scale import classify
from tierckpt.errors import FormatError, TierCkptError
from tierckpt.format import manifest_name
from tierckpt.limits import MAX_MANIFEST_BYTES
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

pytestmark = pytest.mark.s3


def _state(n: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {f"t{i}": torch.randn(64 + i, generator=g) for i in range(n)}


def _kinds(proxy: FaultProxy, bucket: str) -> list[tuple[str, str]]:
    return [(kind, rel) for kind, _top, rel in (classify(r, bucket) for r in proxy.requests)]


@pytest.fixture
def bucket_url(s3_server: S3Server, s3_bucket: Callable[[S3Server], str]) -> tuple[str, str]:
    return s3_bucket(s3_server), s3_server.endpoint_url


def test_s3_load_sends_three_requests_before_its_data(
    bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh job's load: LIST, GET manifest and GET tail (sent together), then the one data
    GET (a single chunk); no HEAD. Before: LIST, HEAD + GET of the manifest, HEAD + GETs of
    the footer and the index (7 requests in all)."""
    bucket, endpoint = bucket_url
    state = _state()
    url = f"s3://{bucket}/run"
    with FaultProxy(endpoint) as proxy:
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            ck.save(state, step=1).result()
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            proxy.requests.clear()
            got = ck.load()
            seen = _kinds(proxy, bucket)
    assert_same(got, state)
    kinds = Counter(k for k, _ in seen)
    assert kinds["HEAD"] == 0, seen
    assert kinds["LIST"] == 1, seen
    gets = [rel for k, rel in seen if k == "GET"]
    # the manifest and the file's tail (either first), then its one chunk
    assert len(gets) == 3, seen
    assert manifest_name(1) in gets[:2], seen
    assert gets[0] != gets[1] and all(g.endswith(".tck") for g in gets if "manifest" not in g)
    assert len(seen) == 4, seen


def test_s3_load_reads_the_tail_while_the_manifest_is_read(
    bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard file's tail GET is sent before the manifest's answer is in: the manifest read
    here waits (up to 20 s) for the tail read to have started, which happens only if the two
    overlap. Before, the tail was read after the manifest named the file."""
    bucket, endpoint = bucket_url
    state = _state()
    url = f"s3://{bucket}/run"
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(state, step=1).result()
    tail_started = threading.Event()
    overlapped: list[bool] = []
    real_tail, real_manifest = ObjectStoreBackend.read_tail, ObjectStoreBackend.get_bounded

    def read_tail(self: ObjectStoreBackend, name: str, length: int) -> Any:
        tail_started.set()
        return real_tail(self, name, length)

    def get_bounded(self: ObjectStoreBackend, name: str, limit: int) -> Any:
        if name == manifest_name(1):
            overlapped.append(tail_started.wait(20))
        return real_manifest(self, name, limit)

    monkeypatch.setattr(ObjectStoreBackend, "read_tail", read_tail)
    monkeypatch.setattr(ObjectStoreBackend, "get_bounded", get_bounded)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        got = ck.load()
    assert_same(got, state)
    assert overlapped == [True]


def test_s3_load_whose_guessed_file_name_misses_reads_the_named_one(
    bucket_url: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Files saved under the v1 names (``prefixes=0``) and loaded by a tier of the default
    layout: the early tail read guesses a v2 name, misses (one GET answered 404), and the
    load reads the file the manifest names, with nothing logged about the miss."""
    bucket, endpoint = bucket_url
    state = _state()
    url = f"s3://{bucket}/run"
    with FaultProxy(endpoint) as proxy:
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, prefixes=0)]) as ck:
            ck.save(state, step=1).result()
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url)]) as ck:
            proxy.requests.clear()
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="tierckpt"):
                got = ck.load()
            seen = _kinds(proxy, bucket)
    assert_same(got, state)
    gets = [rel for k, rel in seen if k == "GET"]
    shard = [g for g in gets if g.endswith(".tck")]
    # the guess (v2: under a hashed prefix), the named file's tail, its data; the guess is
    # sent beside the manifest's GET, on its own thread, so it may reach the store after the
    # named file's tail (a busy machine once showed that order)
    assert len(shard) == 3, seen
    named = [g for g in shard if g.startswith("steps/")]  # the v1 name the manifest gives
    guessed = [g for g in shard if not g.startswith("steps/")]
    assert len(named) == 2 and len(set(named)) == 1, seen
    assert len(guessed) == 1 and guessed[0].endswith(named[0]), seen
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_large_index_is_read_in_pieces_once_then_whole(
    bucket_url: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An index larger than the first read of the tail (here: made small) is completed with
    a check of its head and a read of the rest, and the next load reads it with the tail."""
    bucket, endpoint = bucket_url
    state = _state(1000)  # an index of ~100 KB: over HEAD_PROBE_BYTES (its head checked first)
    url = f"s3://{bucket}/run"
    monkeypatch.setattr(index_mod, "_tail_guess", 4096)
    with FaultProxy(endpoint) as proxy:
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            ck.save(state, step=1).result()
        gets = []
        for _ in range(2):
            with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
                proxy.requests.clear()
                got = ck.load()
                gets.append([rel for k, rel in _kinds(proxy, bucket) if k == "GET"])
            assert_same(got, state)
    shard = [g for g in gets[0] if g.endswith(".tck")]
    again = [g for g in gets[1] if g.endswith(".tck")]
    # tail, head of the index, rest of the index, data; the next load: tail, data
    assert len(shard) - len(again) == 2, (gets[0], gets[1])
    assert index_mod._tail_guess > 80_000


def test_a_shard_file_that_keeps_failing_is_tried_once_as_long(
    bucket_url: tuple[str, str],
) -> None:
    """The tail read started beside the manifest's is the named file's read: where the store
    keeps failing it (500 on every GET of the file), the load gives up after the tries of one
    read of it, not of two (the early read's, then another's), and says what failed."""
    bucket, endpoint = bucket_url
    state = _state()
    url = f"s3://{bucket}/run"
    opts = {"max_attempts": 2}
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(state, step=1).result()
    with FaultProxy(endpoint) as proxy:
        proxy.set_faults([Fault("error500", method="GET", path_contains=".tck")])
        backend = ObjectStoreBackend(url, endpoint_url=proxy.endpoint_url, **opts)
        name = next(n for n in backend.list("") if n.endswith(".tck"))
        proxy.requests.clear()
        with pytest.raises(TierCkptError):
            backend.read_tail(name, 4096)
        one_read = sum(1 for r in proxy.requests if ".tck" in r.target)
        backend.close()
        assert one_read >= 2  # the tries of one read
        proxy.requests.clear()
        tier = S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw", **opts)
        with Checkpointer([tier]) as ck, pytest.raises(TierCkptError):
            ck.load()
        tried = sum(1 for r in proxy.requests if ".tck" in r.target)
    assert tried == one_read, (tried, one_read)


def test_replaced_or_truncated_shard_file_is_refused_by_its_size(
    bucket_url: tuple[str, str],
) -> None:
    """The file's size comes with its tail now, not from a HEAD: a shard file replaced by a
    longer or a shorter one is still refused, naming both sizes."""
    bucket, endpoint = bucket_url
    url = f"s3://{bucket}/run"
    state = _state()
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(state, step=1).result()
    backend = ObjectStoreBackend(url, endpoint_url=endpoint)
    name = next(n for n in backend.list("") if n.endswith(".tck"))
    good = backend.get(name)
    for bad in (good + b"\0" * 100, good[: len(good) // 2], good[:10]):
        backend.put_atomic(name, bad, overwrite=True)
        match = f"file is {len(bad)} bytes.*{len(good)}"
        with (
            Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck,
            pytest.raises(CorruptCheckpoint, match=match),
        ):
            ck.load()
    backend.put_atomic(name, good, overwrite=True)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        assert_same(ck.load(), state)
    backend.close()


def test_huge_manifest_is_refused_without_reading_it(bucket_url: tuple[str, str]) -> None:
    """The manifest's size is checked from the GET's headers before its body is read."""
    bucket, endpoint = bucket_url
    backend = ObjectStoreBackend(f"s3://{bucket}/run", endpoint_url=endpoint)
    backend.put_atomic("small", b"x" * 10)
    assert backend.get_bounded("small", 10) == (10, b"x" * 10)
    assert backend.get_bounded("small", 9) == (10, None)
    backend.put_atomic(manifest_name(1), b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(FormatError, match="manifest is .* bytes, more than"):
        index_mod.read_manifest(backend, 1, "s3")
    backend.close()


def test_read_tail_matches_the_default_on_every_store(bucket_url: tuple[str, str]) -> None:
    """The suffix read gives the same size and bytes as a HEAD and a ranged read: longer
    than the object, exactly it, shorter, and an empty object."""
    bucket, endpoint = bucket_url
    backend = ObjectStoreBackend(f"s3://{bucket}/run", endpoint_url=endpoint)
    backend.put_atomic("ten", b"0123456789")
    backend.put_atomic("empty", b"")
    for name, n in (("ten", 4), ("ten", 10), ("ten", 100), ("empty", 5)):
        size, data = backend.read_tail(name, n)
        want = Backend.read_tail(backend, name, n)  # the default: a HEAD and a read
        assert (size, bytes(data)) == (want[0], bytes(want[1])), (name, n)
    backend.close()


def test_local_tier_load_unchanged(tmp_path: Path) -> None:
    """The defaults (a HEAD-less local file: stat and read) give the same load."""
    from tierckpt import LocalTier

    state = _state(50)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(state, step=1).result()
        assert_same(ck.load(), state)


@pytest.mark.distributed
def test_node_ram_recipe_lists_each_tier_once_per_load(
    tmp_path: Path, moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    """2 gloo ranks, node RAM + peer + local + S3: the peer replicator's ``prepare_load``
    lists the local and S3 tiers, and the load reuses that listing (before: each listed
    twice per load)."""
    import shutil
    import uuid

    import peer_workers

    shm = f"/dev/shm/tierckpt-test-{uuid.uuid4().hex[:10]}"
    s3 = {"bucket": s3_bucket(moto_server), "endpoint": moto_server.endpoint_url}
    try:
        res = peer_workers.run(
            "load_requests_workers:w_lists_per_load", 2, shm=shm, disk=str(tmp_path), s3=s3
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    for r in res:
        assert r["step"] == 2 and r["diff"] == []
        assert r["lists"]["local"] == 1 and r["lists"]["s3"] == 1, r["lists"]


def _same_tail_as_default(backend: ObjectStoreBackend) -> None:
    backend.put_atomic("ten", b"0123456789")
    for n in (4, 10, 100):
        size, data = backend.read_tail("ten", n)
        want = Backend.read_tail(backend, "ten", n)
        assert (size, bytes(data)) == (want[0], bytes(want[1])), n
    assert backend.get_bounded("ten", 10) == (10, b"0123456789")
    assert backend.get_bounded("ten", 9) == (10, None)
    backend.close()


def test_read_tail_on_gcs(fake_gcs: Any, gcs_xml: Any) -> None:
    import secrets

    bucket = f"tierckpt-{secrets.token_hex(6)}"
    fake_gcs.create_bucket(bucket)
    _same_tail_as_default(ObjectStoreBackend(f"gs://{bucket}/r", endpoint_url=gcs_xml.endpoint_url))


def test_read_tail_on_azure(azurite: Any, azure_env: None) -> None:
    import secrets

    container = f"tierckpt-{secrets.token_hex(6)}"
    azurite.create_bucket(container)
    _same_tail_as_default(
        ObjectStoreBackend(f"az://{container}/r", endpoint_url=azurite.endpoint_url)
    )


def test_data_requests_go_out_before_the_tensors_are_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loading thread builds its tensors only once the fetch threads have begun their
    ranged reads (its Python would hold the GIL they need to send them). Reader threads made
    slow to start: before, the tensors were all built before the first read began."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import tierckpt.restore._chunks as chunks_mod
    import tierckpt.restore._shard as shard_mod
    from tierckpt import LocalTier
    from tierckpt.backends.local import LocalBackend
    from tierckpt.restore import read_manifest, read_shard

    class Remote(LocalBackend):
        @property
        def is_remote(self) -> bool:
            return True

        def read_into_pieces(self, name: str, offset: int, outs: Any) -> None:
            events.append("fetch")
            super().read_into_pieces(name, offset, outs)

    events: list[str] = []
    state = _state(40)
    with Checkpointer([LocalTier(tmp_path, codec="raw")], chunk_bytes=64 << 10) as ck:
        ck.save(state, step=1).result()
    real_read, real_rebuild = chunks_mod.ChunkReader.read, shard_mod.rebuild_tensors

    def slow_read(self: Any, ci: int) -> int:
        time.sleep(0.1)  # a reader thread that starts late
        return real_read(self, ci)

    def rebuild(*args: Any) -> Any:
        events.append("tensor")
        return real_rebuild(*args)

    monkeypatch.setattr(chunks_mod.ChunkReader, "read", slow_read)
    monkeypatch.setattr(shard_mod, "rebuild_tensors", rebuild)
    backend = Remote(tmp_path)
    with ThreadPoolExecutor(2) as pool:
        loaded = read_shard(backend, "t", read_manifest(backend, 1, "t"), 0, pool)
    assert_same(loaded.state, state)
    assert events[0] == "fetch", events[:5]


def test_body_copy_fills_plain_and_spread_views() -> None:
    """A GET's body lands in its pieces byte for byte, large pieces copied with the GIL
    released, small ones by slice assignment."""
    from tierckpt.backends.objstore._reads import NOGIL_COPY_BYTES, fill
    from tierckpt.backends.objstore._spread import _Spread

    body = bytes(range(256)) * (3 * NOGIL_COPY_BYTES // 256)
    whole = bytearray(len(body))
    fill(memoryview(whole), memoryview(body))
    assert whole == body
    a, b, c = (
        bytearray(NOGIL_COPY_BYTES),
        bytearray(10),
        bytearray(len(body) - NOGIL_COPY_BYTES - 10),
    )
    fill(_Spread([memoryview(a), memoryview(b), memoryview(c)]), memoryview(body))
    assert a + b + c == body
