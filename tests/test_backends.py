"""Every backend against the one shared contract suite (memory, local, S3 through boto3 and
through obstore on moto and SeaweedFS, obstore on the GCS emulator and on Azurite), plus
S3-specific behaviour under faults (the boto3 driver; obstore's own: tests/test_objstore.py)."""

from __future__ import annotations

import http.client
import logging
import pickle
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.s3 import MIN_PART_SIZE, S3Backend, S3Error
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.testing.backends import BackendTests, payload, write_object
from tierckpt.testing.emulators import Emulator
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.gcsxml import GcsXmlFront
from tierckpt.testing.s3servers import S3Server
from tierckpt.testing.stateful import run_backend_state_machine

MiB = 2**20
BucketFactory = Callable[[S3Server], str]


def make_s3(server: S3Server, bucket: str, **kwargs: object) -> S3Backend:
    options: dict[str, object] = {
        "endpoint_url": server.endpoint_url,
        "part_size": MIN_PART_SIZE,
        "max_concurrency": 4,
        "max_attempts": 4,
        "read_timeout": 20,
    }
    options.update(kwargs)
    return S3Backend(f"s3://{bucket}/run-1", **options)  # type: ignore[arg-type]


def make_obs(server: S3Server, bucket: str, **kwargs: object) -> ObjectStoreBackend:
    """The obstore driver on an S3 server, with make_s3's settings."""
    options: dict[str, object] = {
        "endpoint_url": server.endpoint_url,
        "part_size": MIN_PART_SIZE,
        "max_concurrency": 4,
        "max_attempts": 4,
        "read_timeout": 20,
    }
    options.update(kwargs)
    return ObjectStoreBackend(f"s3://{bucket}/run-1", **options)  # type: ignore[arg-type]


def open_uploads(server: S3Server, bucket: str) -> list[str]:
    return [u["Key"] for u in server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


# -- the shared suite on every backend ----------------------------------------------------
S3 = pytest.mark.s3  # talks HTTP to a server on 127.0.0.1
#: every backend and driver the suite runs on (one id each)
BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("local", id="local"),
    pytest.param("local-buffered", id="local-buffered"),  # direct I/O off: the page cache
    pytest.param("boto3-moto", id="boto3-moto", marks=S3),
    pytest.param("boto3-seaweedfs", id="boto3-seaweedfs", marks=S3),
    pytest.param("obstore-moto", id="obstore-moto", marks=S3),
    pytest.param("obstore-seaweedfs", id="obstore-seaweedfs", marks=S3),
    pytest.param("obstore-gcs", id="obstore-gcs", marks=S3),
    pytest.param("obstore-azure", id="obstore-azure", marks=S3),
]
#: where an abandoned writer leaves something that cleanup_incomplete finds (temp files, S3
#: multipart uploads); GCS and Azure have no listing of them to clean from (see objstore)
LEAVES_INCOMPLETE = frozenset(
    {
        "local",
        "local-buffered",
        "boto3-moto",
        "boto3-seaweedfs",
        "obstore-moto",
        "obstore-seaweedfs",
    }
)


def open_backend(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A fresh, empty backend of ``kind`` (one of BACKENDS)."""
    if kind == "memory":
        namespace = f"test-{secrets.token_hex(4)}"
        request.addfinalizer(lambda: MemoryBackend.clear_namespace(namespace))
        return MemoryBackend(namespace)
    if kind.startswith("local"):
        return LocalBackend(tmp_path / "store", direct_io=kind == "local")
    driver, _, where = kind.partition("-")
    if where in ("moto", "seaweedfs"):
        server: S3Server = request.getfixturevalue(f"{where}_server")
        bucket = request.getfixturevalue("s3_bucket")(server)
        return (make_s3 if driver == "boto3" else make_obs)(server, bucket)
    container = f"tierckpt-{secrets.token_hex(6)}"
    options = {"part_size": MIN_PART_SIZE, "max_concurrency": 4, "read_timeout": 20}
    if where == "gcs":
        request.getfixturevalue("fake_gcs").create_bucket(container)
        front: GcsXmlFront = request.getfixturevalue("gcs_xml")
        return ObjectStoreBackend(
            f"gs://{container}/run-1", endpoint_url=front.endpoint_url, **options
        )
    azurite: Emulator = request.getfixturevalue("azurite")
    request.getfixturevalue("azure_env")
    azurite.create_bucket(container)
    return ObjectStoreBackend(
        f"az://{container}/run-1", endpoint_url=azurite.endpoint_url, **options
    )


class TestBackendContract(BackendTests):
    """The shared suite (tierckpt.testing.backends) on each of BACKENDS."""

    @pytest.fixture(params=BACKENDS)
    def backend(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
        kind = str(request.param)
        # this instance runs one test on one backend: the suite reads this for that backend
        self.leaves_incomplete = kind in LEAVES_INCOMPLETE  # type: ignore[misc]
        backend = open_backend(kind, request, tmp_path)
        yield backend
        backend.close()


def _aligned(n: int, fill: int) -> memoryview:
    """``n`` bytes at a 4 KiB-aligned address (as a host-arena slot is)."""
    import numpy as np

    raw = np.empty(n + 4096, np.uint8)
    skip = (-raw.ctypes.data) % 4096
    out = raw[skip : skip + n]
    out[:] = np.arange(n, dtype=np.uint64).astype(np.uint8) ^ fill
    return memoryview(out)


def test_local_direct_io_for_aligned_writes_page_cache_for_the_rest(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path)
    if not b._direct_ok:
        pytest.skip("this filesystem refuses O_DIRECT")
    big = _aligned((3 << 20) + 1000, 1)  # aligned head, 1000-byte tail
    misaligned = _aligned((2 << 20) + 1, 2)[1:]  # aligned length but not address
    small = _aligned(8192, 3)  # aligned, but too small to be worth it
    w = b.open_writer("obj")
    w.write(0, big)
    w.write(4 << 20, misaligned)  # an aligned offset after a hole
    w.write((7 << 20) + 4096, small)
    w.write((7 << 20) + 12288, b"index+footer")
    assert w.direct_bytes == 3 << 20  # only the big write's aligned head  # type: ignore[attr-defined]
    w.commit()
    data = (tmp_path / "obj").read_bytes()
    assert len(data) == (7 << 20) + 12288 + 12
    assert data[: len(big)] == big.tobytes()
    assert data[len(big) : 4 << 20] == bytes((4 << 20) - len(big))  # the hole reads as zeros
    assert data[4 << 20 : (4 << 20) + len(misaligned)] == misaligned.tobytes()
    assert data[(7 << 20) + 4096 : (7 << 20) + 12288] == small.tobytes()
    assert data.endswith(b"index+footer")
    assert not list(tmp_path.glob("*.tmp"))


def test_local_direct_io_refused_falls_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    import tierckpt.backends.local as local_mod

    if not local_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open = os.open
    refused = []

    def no_direct(path: str, flags: int, *a: object) -> int:
        if flags & local_mod._O_DIRECT:
            refused.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    b = LocalBackend(tmp_path)
    for name in ("a", "b"):
        w = b.open_writer(name)
        w.write(0, _aligned(2 << 20, 5))
        assert w.direct_bytes == 0  # type: ignore[attr-defined]
        w.commit()
        assert (tmp_path / name).read_bytes() == _aligned(2 << 20, 5).tobytes()
    assert len(refused) == 1  # tried once, then remembered
    monkeypatch.setenv("TIERCKPT_DIRECT_IO", "0")
    assert not LocalBackend(tmp_path)._direct_ok


def test_local_direct_io_refused_at_write_falls_back_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import os

    import tierckpt.backends.local as local_mod

    if not local_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    real_open, real_pwrite = os.open, os.pwrite
    direct_fds: set[int] = set()
    refused = []

    def tracking_open(path: str, flags: int, *a: object) -> int:
        fd = real_open(path, flags, *a)
        if flags & local_mod._O_DIRECT:
            direct_fds.add(fd)
        return fd

    def picky_pwrite(fd: int, data: object, offset: int) -> int:
        if fd in direct_fds:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")  # accepted at open, not at write
        return real_pwrite(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    b = LocalBackend(tmp_path)
    w = b.open_writer("obj")
    w.write(0, _aligned(2 << 20, 7))
    w.write(2 << 20, _aligned(2 << 20, 8))  # no second try
    w.commit()
    assert refused == [0] and not b._direct_ok
    expected = _aligned(2 << 20, 7).tobytes() + _aligned(2 << 20, 8).tobytes()
    assert (tmp_path / "obj").read_bytes() == expected


# -- the state machine on every backend ---------------------------------------------------
def test_stateful_memory() -> None:
    namespace = f"stateful-{secrets.token_hex(4)}"
    run_backend_state_machine(MemoryBackend(namespace))
    MemoryBackend.clear_namespace(namespace)


def test_stateful_local(tmp_path: Path) -> None:
    run_backend_state_machine(LocalBackend(tmp_path))


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["boto3", "obstore"])
def test_stateful_s3(s3_server: S3Server, s3_bucket: BucketFactory, driver: str) -> None:
    make = make_s3 if driver == "boto3" else make_obs
    backend = make(s3_server, s3_bucket(s3_server))
    run_backend_state_machine(backend, max_examples=10)
    backend.close()


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["obstore-gcs", "obstore-azure"])
def test_stateful_emulators(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    backend = open_backend(kind, request, tmp_path)
    run_backend_state_machine(backend, max_examples=10)
    backend.close()


# -- S3: configuration --------------------------------------------------------------------
def test_part_size_below_5_mib_refused() -> None:
    with pytest.raises(ValueError, match="5 MiB"):
        S3Backend("s3://bucket", part_size=MIN_PART_SIZE - 1, endpoint_url="http://127.0.0.1:9")


@pytest.mark.parametrize(
    ("url", "prefix", "bucket", "key_prefix", "label"),
    [
        ("s3://bkt", "", "bkt", "", "s3://bkt"),
        ("s3://bkt/", "", "bkt", "", "s3://bkt"),
        ("s3://bkt/a/b/", "", "bkt", "a/b", "s3://bkt/a/b"),
        ("bkt", "runs/7", "bkt", "runs/7", "s3://bkt/runs/7"),
        ("s3://bkt/a", "b", "bkt", "a/b", "s3://bkt/a/b"),
    ],
)
def test_url_parsing(url: str, prefix: str, bucket: str, key_prefix: str, label: str) -> None:
    b = S3Backend(url, prefix, endpoint_url="http://127.0.0.1:9")
    assert (b.bucket, b.prefix, b.url) == (bucket, key_prefix, label)
    assert b.is_durable and b.is_remote and b.supports_ranged_read
    assert not b.supports_random_write
    b.close()


@pytest.mark.parametrize("url", ["s3://", "s3://bkt/a/../b", "s3://bkt/a//b", "s3://b?x=1"])
def test_bad_urls_refused(url: str) -> None:
    with pytest.raises(FormatError):
        S3Backend(url, endpoint_url="http://127.0.0.1:9")


@pytest.mark.s3
def test_endpoint_from_environment(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_bucket(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint_url)
    backend = S3Backend(f"s3://{bucket}")
    backend.put_atomic("x", b"1")
    assert moto_server.admin.get_object(Bucket=bucket, Key="x")["Body"].read() == b"1"
    backend.close()


@pytest.mark.s3
def test_errors_name_bucket_key_and_code_never_credentials(
    seaweedfs_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    client = seaweedfs_server.client()
    wrong_secret = "not-the-secret-" + secrets.token_hex(4)
    bad = S3Server(
        "seaweedfs",
        seaweedfs_server.endpoint_url,
        lambda: None,
        secret_key=wrong_secret,
    ).client(retries={"total_max_attempts": 1})
    backend = S3Backend(f"s3://{bucket}/p", client=bad)
    with pytest.raises(S3Error) as info:
        backend.put_atomic("m", b"x", overwrite=True)
    err = info.value
    assert isinstance(err, BackendError)
    assert (err.bucket, err.key) == (bucket, "p/m")
    assert err.code in ("SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId")
    assert bucket in str(err) and err.code in str(err)
    assert wrong_secret not in str(err) and seaweedfs_server.secret_key not in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, S3Error) and again.code == err.code
    backend.close()
    bad.close()
    client.close()


@pytest.mark.s3
def test_missing_bucket_is_a_backend_error(moto_server: S3Server) -> None:
    backend = make_s3(moto_server, "no-such-bucket-" + secrets.token_hex(3))
    with pytest.raises(BackendError, match="NoSuchBucket"):
        backend.read("x", 0, 1)
    backend.close()


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["boto3", "obstore"])
def test_a_missing_bucket_is_reported_once(
    moto_server: S3Server, driver: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first save's probe of create-only puts fails on a missing bucket with an error that
    says what to do; no second warning follows about the probe object it never created."""
    make = make_s3 if driver == "boto3" else make_obs
    backend = make(moto_server, "no-such-bucket-" + secrets.token_hex(3))
    with (
        caplog.at_level(logging.DEBUG, logger="tierckpt"),
        pytest.raises(BackendError, match="NoSuchBucket.*create the bucket"),
    ):
        assert backend.supports_conditional_put is None  # raises first
    noisy = [r for r in caplog.records if "could not delete probe" in r.getMessage()]
    assert noisy and all(r.levelno < logging.WARNING for r in noisy)  # tried, quietly
    backend.close()


@pytest.mark.s3
def test_closed_backend_refuses_work(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    backend = make_s3(moto_server, s3_bucket(moto_server))
    backend.close()
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.open_writer("x")


# -- S3: conditional puts -----------------------------------------------------------------
@pytest.mark.s3
def test_conditional_put_detected(s3_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(s3_server)
    backend = make_s3(s3_server, bucket)
    assert backend.supports_conditional_put
    assert s3_server.admin.list_objects_v2(Bucket=bucket).get("Contents", []) == []
    backend.put_atomic("m", b"1")
    with pytest.raises(FileExistsError):
        backend.put_atomic("m", b"2")
    backend.close()


@pytest.mark.s3
def test_conditional_put_fallback_when_server_ignores_it(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    # moto checks no signatures, so a proxy may drop the header: a server that ignores it
    with FaultProxy(moto_server.endpoint_url, drop_request_headers=["If-None-Match"]) as proxy:
        backend = make_s3(moto_server, bucket, endpoint_url=proxy.endpoint_url)
        assert not backend.supports_conditional_put
        backend.put_atomic("m", b"1")
        with pytest.raises(FileExistsError):
            backend.put_atomic("m", b"2")
        assert backend.get("m") == b"1"
        assert backend.list() == ["m"]
        backend.close()


@pytest.mark.s3
def test_conditional_put_configured(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        backend = make_s3(
            moto_server, bucket, endpoint_url=proxy.endpoint_url, conditional_put=False
        )
        assert not backend.supports_conditional_put
        backend.put_atomic("m", b"1")
        with pytest.raises(FileExistsError):
            backend.put_atomic("m", b"2")
        methods = [r.method for r in proxy.requests]
        assert methods == ["HEAD", "PUT", "HEAD"]  # no probe, HEAD-then-PUT
        backend.close()


# -- S3: multipart uploads under faults ---------------------------------------------------
@pytest.fixture
def moto_proxy(moto_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.endpoint_url, seed=1234) as proxy:
        yield proxy


@pytest.mark.s3
def test_proxy_forwards_chunked_bodies(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(moto_server)
    data = payload(300_000, seed=9)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        pieces = (data[i : i + 70_000] for i in range(0, len(data), 70_000))
        conn.request("PUT", f"/{bucket}/chunked", body=pieces, encode_chunked=True)
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        conn.close()
        assert proxy.requests[-1].method == "PUT"
    assert moto_server.admin.get_object(Bucket=bucket, Key="chunked")["Body"].read() == data


@pytest.mark.s3
def test_proxy_records_when_each_request_was_sent_and_answered(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """Each record carries when the request arrived and when the upstream's answer began
    (``time.perf_counter()``); a request the proxy answered itself (a fault) has no answer
    time."""
    bucket = s3_bucket(moto_server)
    faults = [Fault("error500", method="GET", nth={1})]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
        before = time.perf_counter()
        for method, body in (("PUT", b"x" * 1000), ("GET", None), ("GET", None)):
            conn.request(method, f"/{bucket}/timed", body=body)
            resp = conn.getresponse()
            resp.read()
        after = time.perf_counter()
        conn.close()
        put, failed, got = list(proxy.requests)
    assert (put.method, failed.fault, got.fault) == ("PUT", "error500", None)
    assert failed.answered is None
    assert put.answered is not None and got.answered is not None
    assert before <= put.sent <= put.answered <= failed.sent <= got.sent <= got.answered <= after


@pytest.mark.s3
def test_round_trip_with_transient_faults(s3_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(s3_server)
    faults = [
        Fault("slowdown", method="PUT", path_contains="partNumber=", nth={1, 4}),
        Fault("error500", method="PUT", path_contains="partNumber=", probability=0.3),
        Fault("reset_request", method="PUT", path_contains="partNumber=", nth={2, 6}),
        Fault("slowdown", method="POST", path_contains="uploadId=", nth={1}),
        Fault("reset_response", method="GET", nth={1, 3}),
        Fault("error500", method="GET", nth={2}),
    ]
    with FaultProxy(s3_server.endpoint_url, faults, seed=1234) as proxy:
        backend = make_s3(s3_server, bucket, endpoint_url=proxy.endpoint_url, max_attempts=6)
        data = payload(6 * MIN_PART_SIZE + 99, seed=10)
        write_object(backend, "obj", data, [MiB] * 7)
        assert backend.get("obj") == data
        out = bytearray(len(data))
        backend.read_into("obj", 0, memoryview(out))
        assert out == data
        for action in ("slowdown", "error500", "reset_request", "reset_response"):
            assert proxy.fired[action] >= 1, proxy.fired
        assert open_uploads(s3_server, bucket) == []
        backend.close()


@pytest.mark.s3
def test_stalled_connections_time_out_and_retry(
    moto_server: S3Server, s3_bucket: BucketFactory, moto_proxy: FaultProxy
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_s3(moto_server, bucket, endpoint_url=moto_proxy.endpoint_url, read_timeout=1)
    moto_proxy.set_faults(
        [
            Fault("stall", method="PUT", path_contains="partNumber=", nth={2}, seconds=5),
            Fault("stall", method="GET", nth={1}, seconds=5),
        ]
    )
    data = payload(2 * MIN_PART_SIZE + 5, seed=11)
    start = time.monotonic()
    write_object(backend, "obj", data)
    assert bytes(backend.read("obj", 3, 1000)) == data[3:1003]
    assert moto_proxy.fired["stall"] == 2
    assert time.monotonic() - start < 30
    backend.close()


@pytest.mark.s3
def test_permanent_part_failure_aborts_upload(
    s3_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(s3_server)
    faults = [Fault("error500", method="PUT", path_contains="partNumber=3")]
    with FaultProxy(s3_server.endpoint_url, faults) as proxy:
        backend = make_s3(s3_server, bucket, endpoint_url=proxy.endpoint_url, max_attempts=2)
        writer = backend.open_writer("doomed")
        data = payload(MIN_PART_SIZE, seed=12)
        with pytest.raises(BackendError) as info:
            for i in range(8):
                writer.write(i * len(data), data)
            writer.commit()
        assert isinstance(info.value, S3Error) and info.value.code == "InternalError"
        assert "doomed" in str(info.value) and bucket in str(info.value)
        writer.abort()  # already aborted: a no-op
        assert open_uploads(s3_server, bucket) == []
        assert backend.list() == []
        backend.close()


@pytest.mark.s3
def test_failed_completion_aborts_upload(
    moto_server: S3Server, s3_bucket: BucketFactory, moto_proxy: FaultProxy
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_s3(moto_server, bucket, endpoint_url=moto_proxy.endpoint_url, max_attempts=2)
    moto_proxy.set_faults([Fault("slowdown", method="POST", path_contains="uploadId=")])
    with pytest.raises(BackendError, match="SlowDown"):
        write_object(backend, "doomed", payload(2 * MIN_PART_SIZE, seed=13))
    assert open_uploads(moto_server, bucket) == []
    assert backend.list() == []
    backend.close()


@pytest.mark.s3
def test_abort_leaves_no_multipart_upload(s3_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(s3_server)
    backend = make_s3(s3_server, bucket)
    writer = backend.open_writer("x")
    writer.write(0, payload(3 * MIN_PART_SIZE, seed=14))
    assert open_uploads(s3_server, bucket) == ["run-1/x"]
    writer.abort()
    assert open_uploads(s3_server, bucket) == []
    backend.close()


@pytest.mark.s3
def test_cleanup_incomplete_aborts_only_under_prefix(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_s3(moto_server, bucket)
    for name in ("a/1", "a/2", "b/1"):
        backend.open_writer(name).write(0, payload(MIN_PART_SIZE, seed=15))
    assert backend.cleanup_incomplete("a/") == 2
    assert open_uploads(moto_server, bucket) == ["run-1/b/1"]
    assert backend.cleanup_incomplete() == 1
    backend.close()


@pytest.mark.s3
def test_writes_block_at_the_concurrency_bound(
    moto_server: S3Server, s3_bucket: BucketFactory, moto_proxy: FaultProxy
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_s3(moto_server, bucket, endpoint_url=moto_proxy.endpoint_url, max_concurrency=2)
    moto_proxy.set_faults([Fault("delay", method="PUT", path_contains="partNumber=", seconds=0.3)])
    data = payload(6 * MIN_PART_SIZE, seed=16)
    start = time.monotonic()
    writer = backend.open_writer("slow")
    writer.write(0, data)  # 6 parts, 2 at a time, 0.3 s each: write() must wait
    elapsed = time.monotonic() - start
    writer.commit()
    assert elapsed >= 0.5
    assert moto_proxy.max_in_flight <= 2
    assert backend.get("slow") == data
    backend.close()


@pytest.mark.s3
def test_missing_object_in_parallel_read(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    backend = make_s3(moto_server, s3_bucket(moto_server))
    with pytest.raises(CheckpointNotFound):
        backend.read_into("missing", 0, memoryview(bytearray(3 * MIN_PART_SIZE)))
    write_object(backend, "obj", payload(2 * MIN_PART_SIZE, seed=17))
    with pytest.raises(FormatError):
        backend.read_into("obj", 1, memoryview(bytearray(2 * MIN_PART_SIZE)))
    backend.close()


@pytest.mark.s3
def test_listing_and_cleanup_paginate(s3_server: S3Server, s3_bucket: BucketFactory) -> None:
    backend = make_s3(s3_server, s3_bucket(s3_server))
    backend._page_size = 2
    names = [f"p/{i:02d}" for i in range(7)]
    for name in reversed(names):
        backend.put_atomic(name, b"x")
    assert backend.list() == names
    assert backend.list("p/0") == names
    for name in ("u/1", "u/2", "u/3"):
        backend.open_writer(name).write(0, payload(MIN_PART_SIZE, seed=18))
    assert backend.cleanup_incomplete() == 3
    backend.close()


def test_range_responses_checked() -> None:
    backend = S3Backend("s3://bkt", endpoint_url="http://127.0.0.1:9")
    check = backend._check_range
    check("k", {"ContentLength": 10, "ContentRange": "bytes 5-14/100"}, 5, 14)
    check("k", {"ContentLength": 10}, 0, 9)  # a 200 for the whole (10-byte) object
    bad = [
        ({"ContentLength": 4, "ContentRange": "bytes 5-8/9"}, "past its end"),  # short
        ({"ContentLength": 12, "ContentRange": "bytes 5-16/100"}, "server sent 12"),  # long
        ({"ContentLength": 10, "ContentRange": "bytes 0-9/100"}, "got bytes 0-9"),  # wrong start
        ({"ContentLength": 100}, "ignored the Range"),  # a 200 with the whole object
    ]
    for resp, message in bad:
        with pytest.raises(FormatError, match=message):
            check("k", resp, 5, 14)
    backend.close()
