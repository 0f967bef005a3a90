"""A load from an object store overlaps its first round trips: the shard file's footer and
index are read while its manifest is (the file's name is what the tier would have named it),
not after. A wrong guess (a checkpoint written with other names, or another file at the
guessed name) still loads the right file, and a missing or corrupt shard file still gives its
clear error."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, CheckpointNotFound, CorruptCheckpoint, S3Tier
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.bench.scale import classify
from tierckpt.format import manifest_name, shard_name
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

pytestmark = pytest.mark.s3

#: how long the proxy holds the manifest's GET: far longer than a thread takes to send the
#: tail's GET, so the order seen at the proxy does not depend on the machine's load
HOLD_S = 2.0


def _state(n: int = 8) -> dict[str, Any]:
    g = torch.Generator().manual_seed(n)
    return {f"t{i}": torch.randn(64 + i, generator=g) for i in range(n)}


def _kinds(proxy: FaultProxy, bucket: str) -> list[tuple[str, str]]:
    return [(kind, rel) for kind, _top, rel in (classify(r, bucket) for r in proxy.requests)]


@pytest.fixture
def bucket_url(s3_server: S3Server, s3_bucket: Callable[[S3Server], str]) -> tuple[str, str]:
    return s3_bucket(s3_server), s3_server.endpoint_url


def test_tail_is_read_while_the_manifest_is(bucket_url: tuple[str, str]) -> None:
    """The proxy holds the manifest's GET; the shard file's tail GET reaches the store before
    the manifest's answer is back (before: only after it). Still one LIST, one GET of each
    and no HEAD before the data."""
    bucket, endpoint = bucket_url
    state = _state()
    url = f"s3://{bucket}/run"
    with FaultProxy(endpoint) as proxy:
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            ck.save(state, step=1).result()
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            backend = ck.backend(ck.tier_names[0])
            real = backend.get_bounded
            seen_at_answer: list[list[tuple[str, str]]] = []

            def watched(name: str, limit: int) -> Any:
                out = real(name, limit)
                seen_at_answer.append(_kinds(proxy, bucket))
                return out

            backend.get_bounded = watched  # type: ignore[method-assign]
            proxy.requests.clear()
            proxy.set_faults(
                [Fault("delay", method="GET", path_contains="manifests/step-", seconds=HOLD_S)]
            )
            got = ck.load()
            seen = _kinds(proxy, bucket)
    assert_same(got, state)
    shard = shard_name(1, 0)
    assert len(seen_at_answer) == 1, seen_at_answer
    assert ("GET", shard) in seen_at_answer[0], seen_at_answer[0]
    kinds = Counter(k for k, _ in seen)
    assert kinds == Counter({"LIST": 1, "GET": 3}), seen  # manifest, tail, the one chunk
    assert Counter(rel for _k, rel in seen) == Counter(
        {"manifests/": 1, manifest_name(1): 1, shard: 2}
    ), seen


def test_wrong_guess_loads_the_manifests_file(bucket_url: tuple[str, str]) -> None:
    """A checkpoint written with format v1 names (``prefixes=0``) loaded by a tier that
    writes v2 names: the guessed file is not the manifest's, and another file sits at the
    guessed name; the load reads the manifest's file and gives its state, not the other."""
    bucket, endpoint = bucket_url
    url = f"s3://{bucket}/run"
    state, other = _state(8), _state(9)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw", prefixes=0)]) as ck:
        ck.save(state, step=1).result()
    backend = ObjectStoreBackend(url, endpoint_url=endpoint)
    v1, v2 = shard_name(1, 0, prefixes=0), shard_name(1, 0)
    assert backend.exists(v1) and not backend.exists(v2)
    # a valid shard file of another state at the guessed name (its index checksum is not
    # the manifest's; were it used, the load would fail or give the wrong tensors)
    with Checkpointer([S3Tier(f"{url}-other", endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(other, step=1).result()
    donor = ObjectStoreBackend(f"{url}-other", endpoint_url=endpoint)
    backend.put_atomic(v2, donor.get(v2))
    donor.close()
    with FaultProxy(endpoint) as proxy:
        with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, codec="raw")]) as ck:
            got = ck.load()
        gets = [rel for k, rel in _kinds(proxy, bucket) if k == "GET"]
    assert_same(got, state)
    assert gets.count(v2) == 1, gets  # the guess was sent, and its answer dropped
    assert gets.count(v1) == 2, gets  # the manifest's file: its tail, then its one chunk
    backend.close()


def test_guess_missing_falls_back(bucket_url: tuple[str, str]) -> None:
    """The guessed name holds nothing (v1 names, as above, no other file): the failed
    early read is dropped and the load succeeds."""
    bucket, endpoint = bucket_url
    url = f"s3://{bucket}/run"
    state = _state(8)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw", prefixes=0)]) as ck:
        ck.save(state, step=1).result()
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        assert_same(ck.load(), state)


def test_missing_shard_file_still_names_it(bucket_url: tuple[str, str]) -> None:
    """The shard file is gone (the early read of it fails too): the load fails as before,
    ``CheckpointNotFound`` naming the file."""
    bucket, endpoint = bucket_url
    url = f"s3://{bucket}/run"
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(_state(), step=1).result()
    backend = ObjectStoreBackend(url, endpoint_url=endpoint)
    backend.delete(shard_name(1, 0))
    with (
        Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck,
        pytest.raises(CheckpointNotFound, match=shard_name(1, 0)),
    ):
        ck.load()
    backend.close()


@pytest.mark.parametrize("where", ["index", "footer"])
def test_corrupt_tail_still_refused(bucket_url: tuple[str, str], where: str) -> None:
    """A byte of the index or of the footer changed, the file's size kept: the early read
    is of the right size and file, and its bytes are still checked as before."""
    bucket, endpoint = bucket_url
    url = f"s3://{bucket}/run"
    state = _state()
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        ck.save(state, step=1).result()
    backend = ObjectStoreBackend(url, endpoint_url=endpoint)
    name = shard_name(1, 0)
    good = bytearray(backend.get(name))
    bad = bytearray(good)
    at = len(bad) - 64 - 20 if where == "index" else len(bad) - 30
    bad[at] ^= 0xFF
    backend.put_atomic(name, bytes(bad), overwrite=True)
    with (
        Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck,
        pytest.raises(CorruptCheckpoint, match=name),
    ):
        ck.load()
    backend.put_atomic(name, bytes(good), overwrite=True)
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        assert_same(ck.load(), state)
    backend.close()
