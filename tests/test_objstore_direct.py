"""A load's ranged GETs of ``s3://`` data are read off the socket straight into place
(``tierckpt.backends.objstore._direct``): signed as AWS signs (checked against botocore's signer
and against SeaweedFS, which verifies signatures), and never the deciding party: what they
cannot use is read through obstore, whose answer and errors stay the load's."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

pytest.importorskip(
    "obstore", reason="the object-store backend needs obstore (pip install obstore)"
)

from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.objstore import _reads as reads
from tierckpt.backends.objstore._direct import DirectReads, SigV4
from tierckpt.errors import CheckpointNotFound, FormatError
from tierckpt.testing.backends import payload, write_object
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]
ONE_PART = [1, 7, 4096, 3 * MiB + 5, 100_003, MiB - 1, 1, 12_345]


def _backend(server: S3Server, bucket: str, endpoint: str | None = None, **kw: Any) -> Any:
    return ObjectStoreBackend(
        f"s3://{bucket}/run dir",  # a space: the key is percent-encoded as S3 signs it
        endpoint_url=endpoint or server.endpoint_url,
        part_size=PART,
        max_concurrency=4,
        **{"read_timeout": 20, **kw},
    )


def _stored(server: S3Server, bucket: str, parts: int, seed: int) -> bytes:
    """An object ``obj`` of ``parts`` parts written to a fresh ``bucket``; its bytes."""
    data = payload(parts * PART, seed=seed)
    write_object(_backend(server, bucket), "obj", data, [PART] * parts)
    return data


def _pieces(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


def _no_obstore_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def streamed(*_a: object, **_k: object) -> None:
        raise AssertionError("a single-range read went through obstore")

    monkeypatch.setattr(reads, "stream_into", streamed)


@pytest.mark.parametrize("token", [None, "FwoGZX+/token=="])
def test_signature_is_botocores(token: str | None) -> None:
    """The Authorization header is the one botocore's S3 SigV4 signer makes for the same GET
    (same time, keys, session token, a key needing percent-encoding, a Range header)."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    key, secret = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
    when = datetime(2026, 12, 2, 9, 30, 1, tzinfo=UTC)
    signer = SigV4(
        "eu-west-3", lambda: {"access_key_id": key, "secret_access_key": secret, "token": token}
    )
    reads_ = DirectReads(
        "http://127.0.0.1:8333", "bkt", signer, connect_timeout=1, read_timeout=1, pool_size=1
    )
    path = reads_.path("run dir/step-00000012/rank-00003.tck+x~y")
    assert path == "/bkt/run%20dir/step-00000012/rank-00003.tck%2Bx~y"
    ours = signer.headers("GET", "127.0.0.1:8333", path, {"Range": "bytes=5-1048580"}, now=when)

    request = AWSRequest(
        method="GET",
        url=f"http://127.0.0.1:8333{path}",
        headers={"Range": "bytes=5-1048580", "X-Amz-Content-SHA256": ours["x-amz-content-sha256"]},
    )
    auth = S3SigV4Auth(Credentials(key, secret, token), "s3", "eu-west-3")
    auth._timestamp = lambda: when.strftime("%Y%m%dT%H%M%SZ")  # type: ignore[method-assign]
    request.context["timestamp"] = when.strftime("%Y%m%dT%H%M%SZ")
    import botocore.auth

    real = botocore.auth.datetime.datetime

    class Frozen(real):  # type: ignore[misc, valid-type]
        @classmethod
        def utcnow(cls) -> Any:
            return when.replace(tzinfo=None)

        @classmethod
        def now(cls, tz: Any = None) -> Any:
            return when if tz else when.replace(tzinfo=None)

    botocore.auth.datetime.datetime = Frozen
    try:
        auth.add_auth(request)
    finally:
        botocore.auth.datetime.datetime = real
    assert request.headers["X-Amz-Date"] == ours["x-amz-date"]
    assert request.headers["Authorization"] == ours["authorization"]


def test_credentials_are_asked_again_before_they_expire() -> None:
    """Refreshable credentials (a role's) are used until shortly before ``expires_at``, then
    the provider is asked again: a long load never signs with expired keys."""
    from datetime import timedelta

    calls: list[int] = []

    def provider() -> dict[str, Any]:
        calls.append(1)
        soon = datetime.now(UTC) + timedelta(seconds=30 if len(calls) == 1 else 3600)
        return {"access_key_id": f"K{len(calls)}", "secret_access_key": "s", "expires_at": soon}

    signer = SigV4("us-east-1", provider)
    first = signer.headers("GET", "h", "/b/k", {})
    second = signer.headers("GET", "h", "/b/k", {})
    third = signer.headers("GET", "h", "/b/k", {})
    assert "Credential=K1/" in first["authorization"]  # expiring within the margin: used once
    assert "Credential=K2/" in second["authorization"] and "K2/" in third["authorization"]
    assert len(calls) == 2


@pytest.mark.s3
def test_a_scatter_read_goes_straight_into_its_pieces(
    s3_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On moto and on SeaweedFS (which checks every signature) a part's pieces are filled by
    the direct read, byte for byte, over a connection kept for the next read; obstore never
    reads them."""
    backend = _backend(s3_server, s3_bucket(s3_server))
    data = payload(3 * PART, seed=81)
    write_object(backend, "obj", data, [PART] * 3)
    _no_obstore_reads(monkeypatch)
    for offset in (0, PART + 99, 2 * PART - 3):
        bufs, views = _pieces(ONE_PART)
        backend.read_into_pieces("obj", offset, views)
        assert b"".join(bufs) == data[offset : offset + sum(ONE_PART)]
    assert backend._direct is not None and len(backend._direct._pool) == 1
    backend.close()
    assert backend._direct._pool == []


@pytest.mark.s3
def test_refused_direct_reads_fall_back_to_obstore_and_stop(
    seaweedfs_server: S3Server, s3_bucket: BucketFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that refuses the direct request (403 here: its signature made with a wrong
    secret) while obstore is let in: the read is made through obstore and succeeds, the direct
    reads are turned off for the backend, said once at INFO."""
    backend = _backend(seaweedfs_server, s3_bucket(seaweedfs_server))
    data = payload(PART, seed=82)
    write_object(backend, "obj", data, [PART])
    direct = backend._direct
    assert direct is not None
    direct._signer._provider = lambda: {"access_key_id": "AKIA", "secret_access_key": "wrong"}
    with caplog.at_level(logging.INFO, logger="tierckpt.backends.objstore"):
        for offset in (0, 1000):
            bufs, views = _pieces([100, 200_000])
            backend.read_into_pieces("obj", offset, views)
            assert b"".join(bufs) == data[offset : offset + 200_100]
    assert backend._direct is None
    said = [r for r in caplog.records if "direct ranged reads off" in r.getMessage()]
    assert len(said) == 1 and "403" in said[0].getMessage()
    backend.close()


@pytest.mark.s3
def test_missing_object_and_past_the_end_are_the_loads_errors(
    s3_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """A missing object is ``CheckpointNotFound``, a range past the end ``FormatError`` naming
    it, with nothing written past the pieces; neither turns the direct reads off."""
    backend = _backend(s3_server, s3_bucket(s3_server))
    data = payload(PART, seed=83)
    write_object(backend, "obj", data, [PART])
    with pytest.raises(CheckpointNotFound):
        backend.read_into_pieces("nope", 0, _pieces([10, 20])[1])
    for offset in (PART - 1000, PART + 5):
        whole = bytearray(b"\xa5" * (1100 + 4096))
        mv = memoryview(whole)
        with pytest.raises(FormatError, match="past its end|not satisfiable"):
            backend.read_into_pieces("obj", offset, [mv[:500], mv[500:1100]])
        assert whole[1100:] == b"\xa5" * 4096
    assert backend._direct is not None
    backend.close()


@pytest.mark.s3
def test_a_pooled_connection_the_server_dropped_is_replaced(
    seaweedfs_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keep-alive connection (SeaweedFS keeps them; moto closes each) that the server
    closed while it sat in the pool is replaced by a new one, without a failed attempt and
    without obstore."""
    backend = _backend(seaweedfs_server, s3_bucket(seaweedfs_server))
    data = payload(PART, seed=84)
    write_object(backend, "obj", data, [PART])
    bufs, views = _pieces([3, 5000])
    backend.read_into_pieces("obj", 0, views)
    assert len(backend._direct._pool) == 1
    stale = backend._direct._pool[0]
    assert stale.sock is not None  # kept open for the next read
    stale.sock.shutdown(socket.SHUT_RD)  # the next answer reads EOF, as after a server's close
    _no_obstore_reads(monkeypatch)
    bufs, views = _pieces([3, 5000])
    backend.read_into_pieces("obj", 10, views)
    assert b"".join(bufs) == data[10:5013]
    assert backend._direct._pool and backend._direct._pool[0] is not stale
    backend.close()


@pytest.mark.s3
@pytest.mark.parametrize("action", ["reset_response", "stall_response"])
def test_a_body_cut_or_stalled_is_one_attempt_then_obstore(
    moto_server: S3Server, s3_bucket: BucketFactory, action: str
) -> None:
    """A direct read whose body is cut (reset) or stops (a hang, ended by the read timeout)
    counts as the read's first attempt; the next is obstore's, and the pieces hold exactly the
    object's bytes."""
    bucket = s3_bucket(moto_server)
    data = _stored(moto_server, bucket, 2, seed=85)
    faults = [Fault(action, method="GET", path_contains="/obj", times=1, seconds=30)]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = _backend(moto_server, bucket, proxy.endpoint_url, read_timeout=2)
        bufs, views = _pieces(ONE_PART)
        backend.read_into_pieces("obj", 7, views)
        assert proxy.fired[action] == 1
        assert len([r for r in proxy.requests if r.method == "GET"]) == 2
        backend.close()
    assert b"".join(bufs) == data[7 : 7 + sum(ONE_PART)]


@pytest.mark.s3
def test_a_store_that_keeps_failing_gets_max_attempts_reads(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """Every answer cut: the direct read is the first of ``max_attempts`` attempts (not one
    more), and the error names the object."""
    bucket = s3_bucket(moto_server)
    _stored(moto_server, bucket, 1, seed=86)
    faults = [Fault("reset_response", method="GET", path_contains="/obj")]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = _backend(moto_server, bucket, proxy.endpoint_url, max_attempts=2)
        with pytest.raises(Exception, match="obj") as err:
            backend.read_into_pieces("obj", 0, _pieces([10, 3 * MiB])[1])
        gets = [r for r in proxy.requests if r.method == "GET"]
        backend.close()
    assert not isinstance(err.value, AssertionError)
    # attempt 1 direct; attempt 2 obstore, without object_store's own retries (they made it
    # max_attempts attempts on the store per attempt here: 1 + 2 GETs)
    assert len(gets) == 2


def test_off_where_obstore_would_send_other_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """No direct reads where they would not be obstore's requests: other store settings (in
    ``config=`` or the environment), a proxy in the environment, or
    ``TIERCKPT_S3_DIRECT_READS=0``; GCS and Azure never."""
    url, ep = "s3://bkt/p", "http://127.0.0.1:9"
    assert ObjectStoreBackend(url, endpoint_url=ep)._direct is not None
    assert ObjectStoreBackend(url, endpoint_url=ep, config={"unsigned_payload": True})._direct
    opts = {"virtual_hosted_style_request": True}
    assert ObjectStoreBackend(url, endpoint_url=ep, config=opts)._direct is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert ObjectStoreBackend(url, endpoint_url=ep)._direct is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.setenv("AWS_REQUEST_PAYER", "true")
    assert ObjectStoreBackend(url, endpoint_url=ep)._direct is None
    monkeypatch.delenv("AWS_REQUEST_PAYER")
    monkeypatch.setenv("TIERCKPT_S3_DIRECT_READS", "0")
    assert ObjectStoreBackend(url, endpoint_url=ep)._direct is None
    monkeypatch.setenv("TIERCKPT_S3_DIRECT_READS", "1")
    gs = ObjectStoreBackend("gs://bkt/p", endpoint_url="http://127.0.0.1:9")
    assert gs._direct is None


@pytest.mark.s3
def test_failing_credentials_or_a_slow_drip_leave_the_read_to_obstore(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The direct reads' credential provider failing (a role's refresh, say) is not the read's
    error: obstore makes that attempt with its own and the direct reads stay on. A body that
    keeps coming but too slowly for ``request_timeout`` is one failed attempt, then obstore's."""
    backend = _backend(moto_server, s3_bucket(moto_server))
    data = payload(PART, seed=87)
    write_object(backend, "obj", data, [PART])
    direct = backend._direct
    assert direct is not None

    def broken() -> dict[str, Any]:
        raise RuntimeError("the metadata service is down")

    real = direct._signer._provider
    direct._signer._provider = broken
    direct._signer._creds = None
    bufs, views = _pieces([100, 4000])
    backend.read_into_pieces("obj", 50, views)
    assert b"".join(bufs) == data[50:4150]
    assert backend._direct is direct
    direct._signer._provider = real
    direct._request_timeout = 0.0  # every body is too slow
    streamed: list[int] = []
    real_stream = reads.stream_into

    def counted(*args: Any) -> None:
        streamed.append(1)
        real_stream(*args)

    monkeypatch.setattr(reads, "stream_into", counted)
    bufs, views = _pieces([100, 3 * MiB])
    backend.read_into_pieces("obj", 60, views)
    assert b"".join(bufs) == data[60 : 60 + 100 + 3 * MiB]
    assert streamed == [1]  # the second attempt, obstore's
    assert backend._direct is direct
    backend.close()


@pytest.mark.s3
@pytest.mark.parametrize("action", ["slowdown", "error500"])
def test_a_busy_store_keeps_the_direct_reads_on(
    moto_server: S3Server, s3_bucket: BucketFactory, action: str
) -> None:
    """A 503 SlowDown or a 500 on the direct request is the server's moment, not a refusal:
    that attempt is made through obstore and the next read is direct again."""
    bucket = s3_bucket(moto_server)
    data = _stored(moto_server, bucket, 1, seed=88)
    faults = [Fault(action, method="GET", path_contains="/obj", times=1)]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = _backend(moto_server, bucket, proxy.endpoint_url)
        for offset in (0, 777):
            bufs, views = _pieces([10, 70_000])
            backend.read_into_pieces("obj", offset, views)
            assert b"".join(bufs) == data[offset : offset + 70_010]
        assert proxy.fired[action] == 1 and backend._direct is not None
        backend.close()
