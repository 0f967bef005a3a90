"""Uploads straight from the arena (issue 15): the object-store writer's ``write_lent`` hands
obstore the caller's memory instead of a copy, and calls ``release`` once obstore no longer
reads it (every part holding it acknowledged, or the upload failed or aborted); a tail that
leaves a part open is copied, so lent memory never waits for a later write. The tier writer
lends each chunk's arena slot and frees the slot on that ``release``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

pytest.importorskip("obstore", reason="the object-store backend needs obstore")

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.objstore import _writer as writer_mod
from tierckpt.errors import BackendError
from tierckpt.testing.backends import payload
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]
#: generous: on a loaded machine a part may take seconds
WAIT_S = 60


def make(endpoint: str, bucket: str) -> ObjectStoreBackend:
    return ObjectStoreBackend(
        f"s3://{bucket}/lent", endpoint_url=endpoint, part_size=PART, max_concurrency=4
    )


def open_uploads(server: S3Server, bucket: str) -> list[str]:
    return [u["Key"] for u in server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@pytest.mark.s3
def test_lent_memory_is_released_after_its_parts_are_acknowledged_not_before(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    data = payload(2 * PART, seed=1)
    delay = [Fault("delay", method="PUT", path_contains="partNumber=", seconds=5.0)]
    with FaultProxy(moto_server.endpoint_url, delay) as proxy:
        backend = make(proxy.endpoint_url, bucket)
        buf = bytearray(data)
        released = threading.Event()
        w = backend.open_writer("obj")
        w.write_lent(0, buf, released.set)  # type: ignore[attr-defined]
        # both parts are still held back by the proxy: obstore still reads the memory
        assert not released.is_set()
        # once they land the memory is free, before the commit
        assert released.wait(WAIT_S)
        buf[:] = bytes(len(buf))  # the caller reuses it: the object must not change
        w.commit()
        assert backend.get("obj") == data
        backend.close()


@pytest.mark.s3
def test_a_tail_that_leaves_a_part_open_is_copied_so_the_memory_comes_back(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """The second part's first half waits in obstore's buffer for the next write: were it
    lent, the memory would come back only at commit (a small arena would deadlock)."""
    bucket = s3_bucket(moto_server)
    first, second = payload(PART + PART // 2, seed=2), payload(PART, seed=3)
    backend = make(moto_server.endpoint_url, bucket)
    bufs = [bytearray(first), bytearray(second)]
    released = [threading.Event(), threading.Event()]
    w = backend.open_writer("obj")
    w.write_lent(0, bufs[0], released[0].set)  # type: ignore[attr-defined]
    assert released[0].wait(WAIT_S)
    bufs[0][:] = bytes(len(first))
    w.write_lent(len(first), bufs[1], released[1].set)  # type: ignore[attr-defined]
    w.commit()
    assert released[1].is_set()
    assert backend.get("obj") == first + second
    backend.close()


@pytest.mark.s3
def test_lent_memory_comes_back_when_the_upload_is_aborted_or_fails(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    faults = [
        Fault("delay", method="PUT", path_contains="/aborted?partNumber=", seconds=5.0),
        Fault("error500", method="PUT", path_contains="/failed?partNumber=2"),
    ]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = make(proxy.endpoint_url, bucket)
        released = threading.Event()
        w = backend.open_writer("aborted")
        w.write_lent(0, bytearray(payload(2 * PART, seed=4)), released.set)  # type: ignore[attr-defined]
        w.abort()
        assert released.wait(WAIT_S)

        released = threading.Event()
        w = backend.open_writer("failed")
        with pytest.raises(BackendError):
            w.write_lent(0, bytearray(payload(3 * PART, seed=5)), released.set)  # type: ignore[attr-defined]
            w.commit()
        assert released.wait(WAIT_S)
        assert not backend.exists("failed") and not backend.exists("aborted")
        assert open_uploads(moto_server, bucket) == []
        backend.close()


@pytest.mark.s3
def test_a_lost_start_is_sent_again_from_the_lent_memory(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    data = payload(2 * PART + 7, seed=6)
    lost = [Fault("reset_response", method="POST", path_contains="?uploads", times=1)]
    with FaultProxy(moto_server.endpoint_url, lost) as proxy:
        backend = make(proxy.endpoint_url, bucket)
        released = threading.Event()
        w = backend.open_writer("obj")
        w.write_lent(0, bytearray(data), released.set)  # type: ignore[attr-defined]
        w.commit()
        assert proxy.fired["reset_response"] == 1
        assert released.wait(WAIT_S)
        assert backend.get("obj") == data
        assert open_uploads(moto_server, bucket) == []
        backend.close()


@pytest.mark.s3
def test_an_s3_tier_uploads_from_the_arena_and_reuses_its_few_slots(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 6 MiB (not whole parts) through an arena of a few slots: whole parts go
    lent, tails copied; every slot comes back (else the save would hang), and two saves with
    different values read back exactly."""
    bucket = s3_bucket(moto_server)
    handed: list[int] = []
    hand = writer_mod._Writer._hand

    def spy(self: writer_mod._Writer, chunk: bytes | memoryview, at: int, lent: bool) -> None:
        if lent:
            handed.append(len(chunk))
        hand(self, chunk, at, lent)

    monkeypatch.setattr(writer_mod._Writer, "_hand", spy)
    tier = S3Tier(
        f"s3://{bucket}/ck",
        endpoint_url=moto_server.endpoint_url,
        codec="raw",
        part_size=PART,
        keep_last=None,
    )
    gen = torch.Generator().manual_seed(7)
    states = [
        {f"t{i}": torch.randn(6 * MiB // 4 + 999 * i, generator=gen) for i in range(6)}
        for _ in range(2)
    ]
    with Checkpointer([tier], host_buffer_bytes=24 * MiB, chunk_bytes=6 * MiB) as ck:
        for step, state in enumerate(states, 1):
            ck.save(state, step=step).result(timeout=300)
        for step, state in enumerate(states, 1):
            got = ck.load(step=step)
            assert all(torch.equal(got[k], v) for k, v in state.items())
    assert sum(handed) >= 6 * PART  # most of the bytes went uncopied
