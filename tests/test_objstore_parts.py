"""When an S3 tier's parts go on the wire (issue 15): a raw tier of a host-only save uploads
each chunk from its arena slot as soon as the chunk is copied, without waiting for its checksum
(host chunks' checksums wait for the end of the capture); the slot is freed only once the
writer and the checksum are both done with it, so the recorded checksum is always that of the
uploaded bytes. A tier that encodes (the stored bytes are the encoder's) still waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

pytest.importorskip("obstore", reason="the object-store backend needs obstore")

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.pipeline import _capture
from tierckpt.testing.faultproxy import FaultProxy
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]
#: generous: on a loaded machine a part may take seconds
WAIT_S = 30


def parts_sent(proxy: FaultProxy) -> int:
    return sum(1 for r in list(proxy.requests) if "partNumber=" in r.target)


def state_of(n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(PART // 4, generator=gen) for i in range(n)}


def _checkpointer(bucket: str, proxy: FaultProxy, codec: str) -> Checkpointer:
    """One S3 tier of ``codec`` through ``proxy``, chunks of two parts."""
    tier = S3Tier(f"s3://{bucket}/ck", endpoint_url=proxy.endpoint_url, codec=codec, part_size=PART)
    return Checkpointer([tier], host_buffer_bytes=64 * MiB, chunk_bytes=2 * PART)


def _hold_checksums(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every chunk checksum waits until the returned event is set."""
    hold = threading.Event()
    checksum = _capture.checksum

    def held(data: object) -> str:
        assert hold.wait(120), "the test never released the checksums"
        return checksum(data)  # type: ignore[arg-type]

    monkeypatch.setattr(_capture, "checksum", held)
    return hold


@pytest.mark.s3
def test_a_raw_tier_sends_parts_while_the_checksums_are_still_being_computed(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every chunk checksum is held back: parts still reach the store (before the fix the tier
    waited for each chunk's checksum, so nothing went on the wire until it came)."""
    bucket = s3_bucket(moto_server)
    hold = _hold_checksums(monkeypatch)
    state = state_of(4, seed=1)
    with FaultProxy(moto_server.endpoint_url) as proxy, _checkpointer(bucket, proxy, "raw") as ck:
        handle = ck.save(state, step=1)
        try:
            deadline = time.monotonic() + WAIT_S
            while parts_sent(proxy) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            sent = parts_sent(proxy)
            assert not handle.done()  # no checksum yet: nothing can commit
        finally:
            hold.set()
        assert sent >= 2, f"{sent} parts sent while the checksums were held"
        handle.result(timeout=300)
        got = ck.load(step=1)  # every chunk's checksum verified on the way
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.s3
def test_a_slot_uploaded_early_is_not_reused_before_its_checksum_is_done(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow checksums and an arena of two slots for eight chunks: a slot freed once its parts
    were acknowledged but before its checksum ran would be refilled with the next chunk, and
    that chunk's checksum recorded for this one (the load would refuse the checkpoint)."""
    bucket = s3_bucket(moto_server)
    checksum = _capture.checksum

    def slow(data: object) -> str:
        time.sleep(0.3)  # the parts are acknowledged meanwhile
        return checksum(data)  # type: ignore[arg-type]

    monkeypatch.setattr(_capture, "checksum", slow)
    tier = S3Tier(
        f"s3://{bucket}/ck", endpoint_url=moto_server.endpoint_url, codec="raw", part_size=PART
    )
    states = [state_of(8, seed=2), state_of(8, seed=3)]
    with Checkpointer([tier], host_buffer_bytes=2 * PART, chunk_bytes=PART) as ck:
        for step, state in enumerate(states, 1):
            ck.save(state, step=step).result(timeout=300)
        for step, state in enumerate(states, 1):
            got = ck.load(step=step)
            assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.s3
def test_a_tier_that_encodes_waits_for_the_encoder(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zstd's stored bytes are the encoder's: no part leaves before the encoder is done."""
    pytest.importorskip("zstandard")
    bucket = s3_bucket(moto_server)
    hold = _hold_checksums(monkeypatch)
    state = state_of(4, seed=4)
    with FaultProxy(moto_server.endpoint_url) as proxy, _checkpointer(bucket, proxy, "zstd") as ck:
        handle = ck.save(state, step=1)
        try:
            time.sleep(2)
            sent = parts_sent(proxy)
        finally:
            hold.set()
        handle.result(timeout=300)
        got = ck.load(step=1)
    assert sent == 0
    assert all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize(
    ("endpoint", "config", "unsigned"),
    [
        (None, {}, "true"),  # AWS: TLS
        ("https://s3.example.test:9000", {}, "true"),
        ("http://127.0.0.1:9000", {}, None),  # the signature is the body's only protection
        ("https://s3.example.test:9000", {"unsigned_payload": False}, "false"),
        ("http://127.0.0.1:9000", {"unsigned_payload": True}, "true"),
    ],
)
def test_s3_bodies_are_hashed_for_the_signature_only_without_tls(
    monkeypatch: pytest.MonkeyPatch, endpoint: str | None, config: dict[str, bool], unsigned: str
) -> None:
    """SHA-256 of every uploaded byte was most of an upload's client CPU; over TLS the AWS SDKs
    send UNSIGNED-PAYLOAD, and so does the tier unless told otherwise."""
    from tierckpt.backends.objstore import ObjectStoreBackend

    for name, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    backend = ObjectStoreBackend("s3://bucket/p", endpoint_url=endpoint, config=config)
    try:
        for store in (backend._store, backend._once):
            assert store.config.get("unsigned_payload") == unsigned
    finally:
        backend.close()
