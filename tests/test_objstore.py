"""The obstore backend's own behaviour (s3://, gs://, az://) on real servers: URLs, errors,
conditional puts, faults, GCS on its emulator, the tier classes that pick it. The shared
backend suite and the state machine run on it in tests/test_backends.py (moto, SeaweedFS,
fake-gcs-server, Azurite)."""

from __future__ import annotations

import pickle
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip(
    "obstore", reason="the object-store backend needs obstore (pip install obstore)"
)

from tierckpt.backends.objstore import ObjectStoreBackend, ObjectStoreError, parse_url
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.testing.backends import payload, write_object
from tierckpt.testing.emulators import Emulator
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.gcsxml import GcsXmlFront
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
MIN_PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]


def make_obs(server: S3Server, bucket: str, **kwargs: object) -> ObjectStoreBackend:
    options: dict[str, object] = {
        "endpoint_url": server.endpoint_url,
        "part_size": MIN_PART,
        "max_concurrency": 4,
        "read_timeout": 20,
    }
    options.update(kwargs)
    return ObjectStoreBackend(f"s3://{bucket}/run-1", **options)  # type: ignore[arg-type]


def open_uploads(server: S3Server, bucket: str) -> list[str]:
    return [u["Key"] for u in server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


# -- URLs and configuration -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("url", "prefix", "parsed"),
    [
        ("s3://bkt", "", ("s3", "bkt", "")),
        ("gs://bkt/a/b/", "", ("gs", "bkt", "a/b")),
        ("az://cont/a", "b", ("az", "cont", "a/b")),
    ],
)
def test_url_parsing(url: str, prefix: str, parsed: tuple[str, str, str]) -> None:
    assert parse_url(url, prefix) == parsed


@pytest.mark.parametrize(
    "url",
    ["s3://", "gs://bkt/a/../b", "az://c/a//b", "s3://b?x=1", "ftp://b/x", "gs://KEY:s3kr1t@b/x"],
)
def test_bad_urls_refused(url: str) -> None:
    with pytest.raises(FormatError) as info:
        ObjectStoreBackend(url, endpoint_url="http://127.0.0.1:9")
    assert "s3kr1t" not in str(info.value)


def test_part_size_below_5_mib_refused() -> None:
    with pytest.raises(ValueError, match="5 MiB"):
        ObjectStoreBackend("s3://bkt", part_size=MIN_PART - 1, endpoint_url="http://127.0.0.1:9")


def test_no_aws_credentials_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(BackendError, match="no AWS credentials found"):
        ObjectStoreBackend("s3://bkt/p", endpoint_url="http://127.0.0.1:9")


@pytest.mark.s3
def test_endpoint_and_profile_from_the_standard_chain(
    moto_server: S3Server,
    s3_bucket: BucketFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Credentials from an AWS profile file (no key in the environment), endpoint from env."""
    bucket = s3_bucket(moto_server)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ckpt]\naws_access_key_id = {moto_server.access_key}\n"
        f"aws_secret_access_key = {moto_server.secret_key}\n"
    )
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_PROFILE", "ckpt")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_server.endpoint_url)
    backend = ObjectStoreBackend(f"s3://{bucket}")
    backend.put_atomic("x", b"1")
    assert moto_server.admin.get_object(Bucket=bucket, Key="x")["Body"].read() == b"1"
    backend.close()


# -- errors ------------------------------------------------------------------------------------
@pytest.mark.s3
def test_errors_name_the_url_and_never_credentials(
    seaweedfs_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_bucket(seaweedfs_server)
    wrong = "not-the-secret-" + secrets.token_hex(4)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    backend = make_obs(seaweedfs_server, bucket, max_attempts=1)
    with pytest.raises(ObjectStoreError) as info:
        backend.put_atomic("p/m", b"x", overwrite=True)
    err = info.value
    assert isinstance(err, BackendError) and err.status == 403
    assert err.code in ("SignatureDoesNotMatch", "AccessDenied", "InvalidAccessKeyId")
    assert f"s3://{bucket}/run-1/p/m" in str(err) and "credentials" in str(err)
    assert wrong not in str(err) and seaweedfs_server.secret_key not in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, ObjectStoreError) and again.code == err.code
    backend.close()


@pytest.mark.s3
def test_missing_bucket_is_a_backend_error(moto_server: S3Server) -> None:
    backend = make_obs(moto_server, "no-such-bucket-" + secrets.token_hex(3))
    with pytest.raises(BackendError, match="create the bucket"):
        backend.read("x", 0, 1)
    backend.close()


@pytest.mark.s3
def test_missing_container_is_a_backend_error(azurite: Emulator, azure_env: None) -> None:
    backend = ObjectStoreBackend("az://no-such-container/x", endpoint_url=azurite.endpoint_url)
    with pytest.raises(BackendError, match="create the container"):
        backend.read("x", 0, 1)
    backend.close()


@pytest.mark.s3
def test_unreachable_endpoint_fails_after_retries() -> None:
    with socket_closed_port() as port:
        backend = ObjectStoreBackend(
            "s3://bkt/p", endpoint_url=f"http://127.0.0.1:{port}", max_attempts=2, connect_timeout=1
        )
        with pytest.raises(ObjectStoreError, match="reachable") as info:
            backend.size("x")
        assert "s3://bkt/p/x" in str(info.value)
        backend.close()


def socket_closed_port():  # type: ignore[no-untyped-def]
    import contextlib
    import socket

    @contextlib.contextmanager
    def cm() -> Iterator[int]:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there now
        yield port

    return cm()


@pytest.mark.s3
def test_closed_backend_refuses_work(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    backend = make_obs(moto_server, s3_bucket(moto_server))
    backend.close()
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.open_writer("x")


# -- conditional puts -------------------------------------------------------------------------
@pytest.mark.s3
def test_conditional_put_detected(s3_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(s3_server)
    backend = make_obs(s3_server, bucket)
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
    with FaultProxy(moto_server.endpoint_url, drop_request_headers=["If-None-Match"]) as proxy:
        backend = make_obs(moto_server, bucket, endpoint_url=proxy.endpoint_url)
        assert not backend.supports_conditional_put
        backend.put_atomic("m", b"1")
        with pytest.raises(FileExistsError):
            backend.put_atomic("m", b"2")
        assert backend.get("m") == b"1"
        assert backend.list() == ["m"]
        backend.close()


# -- faults --------------------------------------------------------------------------------------
@pytest.mark.s3
def test_round_trip_with_transient_faults(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    bucket = s3_bucket(moto_server)
    faults = [
        Fault("slowdown", method="PUT", path_contains="partNumber=", nth={1, 4}),
        Fault("error500", method="PUT", path_contains="partNumber=", nth={3}),
        Fault("reset_response", method="GET", nth={1, 3}),
        Fault("error500", method="GET", nth={2}),
    ]
    with FaultProxy(moto_server.endpoint_url, faults, seed=1234) as proxy:
        backend = make_obs(moto_server, bucket, endpoint_url=proxy.endpoint_url, max_attempts=6)
        data = payload(4 * MIN_PART + 99, seed=10)
        write_object(backend, "obj", data, [MiB] * 7)
        out = bytearray(len(data))
        backend.read_into("obj", 0, memoryview(out))
        assert out == data
        for action in ("slowdown", "error500", "reset_response"):
            assert proxy.fired[action] >= 1, proxy.fired
        assert open_uploads(moto_server, bucket) == []
        backend.close()


@pytest.mark.s3
def test_lost_answers_are_asked_again(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    """object_store retries failed requests but not a response cut off after its headers: the
    backend asks again. A CreateMultipartUpload whose answer was lost leaves no open upload
    (the one it may have opened is aborted), a cut LIST or GET answer is read again."""
    bucket = s3_bucket(moto_server)
    faults = [
        Fault("reset_response", method="POST", path_contains="?uploads", times=1),
        Fault("reset_response", method="GET", path_contains="list-type=2", times=1),
        Fault("reset_response", method="GET", path_contains="/run-1/small", times=1),
    ]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = make_obs(moto_server, bucket, endpoint_url=proxy.endpoint_url)
        data = payload(2 * MIN_PART + 5, seed=40)
        write_object(backend, "big", data, [MiB] * 3)
        assert proxy.fired["reset_response"] == 1
        backend.put_atomic("small", payload(300_000, seed=41))
        assert backend.list() == ["big", "small"]
        assert backend.get("small") == payload(300_000, seed=41)
        assert proxy.fired["reset_response"] == 3
        assert backend.get("big") == data
        assert open_uploads(moto_server, bucket) == []
        backend.close()


@pytest.mark.s3
def test_permanent_part_failure_aborts_upload(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    faults = [Fault("error500", method="PUT", path_contains="partNumber=3")]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = make_obs(moto_server, bucket, endpoint_url=proxy.endpoint_url, max_attempts=2)
        writer = backend.open_writer("doomed")
        data = payload(MIN_PART, seed=12)
        with pytest.raises(BackendError) as info:
            for i in range(8):
                writer.write(i * len(data), data)
            writer.commit()
        assert "doomed" in str(info.value) and bucket in str(info.value)
        writer.abort()  # already aborted: a no-op
        assert open_uploads(moto_server, bucket) == []
        assert backend.list() == []
        backend.close()


@pytest.mark.s3
def test_writer_copies_the_callers_buffer(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    """The pipeline reuses an arena slot once write() returns: what was written must stay."""
    backend = make_obs(moto_server, s3_bucket(moto_server))
    slot = bytearray(payload(3 * MiB, seed=20))
    first = bytes(slot)
    writer = backend.open_writer("obj")
    writer.write(0, memoryview(slot))
    slot[:] = b"\0" * len(slot)  # reused for the next chunk
    writer.write(len(slot), memoryview(slot))
    writer.commit()
    assert backend.get("obj") == first + bytes(len(slot))
    backend.close()


@pytest.mark.s3
def test_missing_object_in_parallel_read(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    backend = make_obs(moto_server, s3_bucket(moto_server))
    with pytest.raises(CheckpointNotFound):
        backend.read_into("missing", 0, memoryview(bytearray(3 * MIN_PART)))
    write_object(backend, "obj", payload(2 * MIN_PART, seed=17))
    with pytest.raises(FormatError):
        backend.read_into("obj", 1, memoryview(bytearray(2 * MIN_PART)))
    backend.close()


# -- GCS -----------------------------------------------------------------------------------------
def gcs_backend(fake_gcs: Emulator, front: GcsXmlFront, **kwargs: object) -> ObjectStoreBackend:
    bucket = f"tierckpt-{secrets.token_hex(6)}"
    fake_gcs.create_bucket(bucket)
    options: dict[str, object] = {"endpoint_url": front.endpoint_url, "part_size": MIN_PART}
    options.update(kwargs)
    return ObjectStoreBackend(f"gs://{bucket}/run-1", **options)  # type: ignore[arg-type]


@pytest.mark.s3
def test_fake_gcs_serves_reads_but_not_obstores_writes(
    fake_gcs: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why tests put tierckpt.testing.gcsxml in front of fake-gcs-server: it serves the XML
    API's reads (GET, ranged GET, HEAD, list, DELETE) but answers obstore's object PUT with
    ``400 invalid uploadType`` (fsouza/fake-gcs-server#331). When this fails, the emulator
    has learnt the writes and the front can go."""
    bucket = f"tierckpt-{secrets.token_hex(6)}"
    fake_gcs.create_bucket(bucket)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.endpoint_url)
    backend = ObjectStoreBackend(f"gs://{bucket}/run-1", part_size=MIN_PART, max_attempts=1)
    with pytest.raises(ObjectStoreError, match="invalid uploadType"):
        backend.put_atomic("m", b"1", overwrite=True)
    with GcsXmlFront(fake_gcs.endpoint_url) as front:
        writer = ObjectStoreBackend(f"gs://{bucket}/run-1", endpoint_url=front.endpoint_url)
        writer.put_atomic("m", b"0123456789")
        writer.close()
    # read straight from the emulator (STORAGE_EMULATOR_HOST), no front
    assert backend.get("m") == b"0123456789"
    assert bytes(backend.read("m", 3, 4)) == b"3456"
    assert backend.size("m") == 10 and backend.list() == ["m"]
    backend.delete("m")
    assert not backend.exists("m")
    backend.close()


@pytest.mark.s3
def test_gcs_create_only_put_is_the_generation_precondition(
    fake_gcs: Emulator, gcs_xml: GcsXmlFront
) -> None:
    """A create-only put sends ``x-goog-if-generation-match: 0``; the emulator refuses it on
    an existing object (412), which the backend reports as FileExistsError."""
    backend = gcs_backend(fake_gcs, gcs_xml)
    assert backend.supports_conditional_put
    backend.put_atomic("manifests/1", b"first")
    with pytest.raises(FileExistsError):
        backend.put_atomic("manifests/1", b"second")
    assert backend.get("manifests/1") == b"first"
    backend.close()


@pytest.mark.s3
def test_gcs_multipart_upload_and_abort(fake_gcs: Emulator, gcs_xml: GcsXmlFront) -> None:
    """Beyond one part a GCS object is an XML multipart upload; an abort leaves none open."""
    backend = gcs_backend(fake_gcs, gcs_xml)
    data = payload(3 * MIN_PART + 17, seed=30)
    write_object(backend, "big", data, [MiB] * 4)
    assert backend.get("big") == data
    writer = backend.open_writer("doomed")
    writer.write(0, payload(2 * MIN_PART + 1, seed=31))  # at least one part sent
    assert any(u.endswith("run-1/doomed") for u in gcs_xml.open_uploads())
    writer.abort()
    assert not any(u.endswith("run-1/doomed") for u in gcs_xml.open_uploads())
    assert backend.list() == ["big"]
    backend.close()


@pytest.mark.s3
def test_checkpoint_round_trip_on_gcs_tier(fake_gcs: Emulator, gcs_xml: GcsXmlFront) -> None:
    """A Checkpointer saves to a GCSTier (the emulator) and a fresh one restores bit-exact."""
    import torch

    from tierckpt import Checkpointer, GCSTier

    bucket = f"tierckpt-{secrets.token_hex(6)}"
    fake_gcs.create_bucket(bucket)
    url = f"gs://{bucket}/run"
    state = {"w": torch.arange(3_000_000, dtype=torch.float32), "ids": torch.arange(70_001)}
    with Checkpointer(
        [GCSTier(url, endpoint_url=gcs_xml.endpoint_url, part_size=MIN_PART)],
        chunk_bytes=1 << 20,
        host_buffer_bytes=4 << 20,
    ) as ck:
        ck.save(state, step=1).result()
    with Checkpointer([GCSTier(url, endpoint_url=gcs_xml.endpoint_url)]) as fresh:
        loaded = fresh.load()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["ids"], state["ids"])


# -- tiers ---------------------------------------------------------------------------------------
def test_tiers_pick_the_driver() -> None:
    from tierckpt import AzureTier, GCSTier, S3Tier
    from tierckpt.backends.s3 import S3Backend

    s3 = S3Tier("s3://bkt/p", driver="boto3", endpoint_url="http://127.0.0.1:9")
    b = s3.make_backend()
    assert isinstance(b, S3Backend)
    b.close()
    obs = S3Tier("s3://bkt/p", driver="obstore", endpoint_url="http://127.0.0.1:9")
    b = obs.make_backend()
    assert isinstance(b, ObjectStoreBackend) and b.url == "s3://bkt/p"
    b.close()
    with pytest.raises(ValueError, match="driver"):
        S3Tier("s3://bkt/p", driver="nope")
    assert GCSTier("gs://bkt/p").name == "gcs"
    assert AzureTier("az://c/p").name == "azure"
    with pytest.raises(ValueError, match="gs://"):
        GCSTier("s3://bkt/p")
    with pytest.raises(ValueError, match="az://"):
        AzureTier("gs://bkt/p")


@pytest.mark.s3
def test_checkpoint_round_trip_on_azure_tier(azurite: Emulator, azure_env: None) -> None:
    """A Checkpointer saves to an AzureTier (Azurite) and a fresh one restores bit-exact."""
    import torch

    from tierckpt import AzureTier, Checkpointer

    container = f"tierckpt-{secrets.token_hex(6)}"
    azurite.create_bucket(container)
    url = f"az://{container}/run"
    state = {"w": torch.arange(3_000_000, dtype=torch.float32), "ids": torch.arange(70_001)}
    with Checkpointer(
        [AzureTier(url, endpoint_url=azurite.endpoint_url, part_size=MIN_PART)],
        chunk_bytes=1 << 20,
        host_buffer_bytes=4 << 20,
    ) as ck:
        ck.save(state, step=1).result()
    with Checkpointer([AzureTier(url, endpoint_url=azurite.endpoint_url)]) as fresh:
        loaded = fresh.load()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["ids"], state["ids"])


def test_default_s3_driver_is_obstore_and_env_or_argument_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tierckpt import S3Tier
    from tierckpt.backends.objstore import ObjectStoreBackend
    from tierckpt.backends.s3 import S3Backend

    monkeypatch.delenv("TIERCKPT_S3_DRIVER", raising=False)
    tier = S3Tier("s3://bkt/p", endpoint_url="http://127.0.0.1:9")
    backend = tier.make_backend()
    assert tier.driver == "obstore" and isinstance(backend, ObjectStoreBackend)
    backend.close()
    assert S3Tier("s3://bkt/p", driver="boto3").driver == "boto3"
    assert S3Tier("s3://bkt/p", driver="obstore").driver == "obstore"
    assert S3Tier("s3://bkt/p", client=object()).driver == "boto3"  # a boto3 client implies it
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "obstore")
    tier = S3Tier("s3://bkt/p", endpoint_url="http://127.0.0.1:9")
    backend = tier.make_backend()
    assert tier.driver == "obstore" and isinstance(backend, ObjectStoreBackend)
    backend.close()
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "boto3")
    tier = S3Tier("s3://bkt/p", endpoint_url="http://127.0.0.1:9")
    backend = tier.make_backend()
    assert tier.driver == "boto3" and isinstance(backend, S3Backend)
    backend.close()
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "curl")
    with pytest.raises(ValueError, match="TIERCKPT_S3_DRIVER"):
        S3Tier("s3://bkt/p")


@pytest.mark.s3
def test_offline_tools_open_gs_and_az_urls(azurite: Emulator, azure_env: None) -> None:
    from tierckpt.offline import open_backend

    container = f"tierckpt-{secrets.token_hex(6)}"
    azurite.create_bucket(container)
    backend = open_backend(f"az://{container}/run", endpoint_url=azurite.endpoint_url)
    assert isinstance(backend, ObjectStoreBackend)
    backend.put_atomic("x", b"1")
    assert backend.list() == ["x"]
    backend.close()
    gs = open_backend("gs://bkt/run", endpoint_url="http://127.0.0.1:9")
    assert isinstance(gs, ObjectStoreBackend) and gs.url == "gs://bkt/run"
    gs.close()


def test_a_boto3_client_on_the_obstore_driver_says_what_to_do() -> None:
    from tierckpt import S3Tier

    with pytest.raises(ValueError, match=r"client=.*boto3 driver only.*driver='boto3'"):
        S3Tier("s3://bkt/p", driver="obstore", client=object())
    assert S3Tier("s3://bkt/p", driver="obstore", profile="training").driver == "obstore"
    assert S3Tier("s3://bkt/p", driver="boto3", profile="training").driver == "boto3"
