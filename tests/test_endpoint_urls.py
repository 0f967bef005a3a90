"""An endpoint written without its scheme is refused with the URL that was meant.

Found by trying it: ``S3Tier("s3://bucket/run", endpoint_url="127.0.0.1:9000")`` (how MinIO's
own tools write an endpoint) was accepted, and the first ``save()`` died in obstore's client
with a Rust panic (``PanicException: request valid: InvalidUri``, and a backtrace): a
``BaseException``, which the training loop's ``except Exception`` does not catch. The same
through ``AWS_ENDPOINT_URL``."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from tierckpt import AzureTier, Checkpointer, GCSTier, S3Tier
from tierckpt.errors import FormatError
from tierckpt.testing.s3servers import S3Server


def _state() -> dict[str, object]:
    return {"w": torch.arange(10_000, dtype=torch.float32), "step": 1}


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_an_endpoint_without_its_scheme_is_refused_when_the_tier_is_made(
    driver: str, moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    bucket = s3_bucket(moto_server)
    hostport = moto_server.endpoint_url.removeprefix("http://")
    with pytest.raises(FormatError, match="not an http:// or https:// URL") as info:
        S3Tier(f"s3://{bucket}/run", endpoint_url=hostport, driver=driver)
    assert f"'http://{hostport}'" in str(info.value)  # the URL that was meant
    for bad in ("ftp://127.0.0.1:1", "http://", "http://127.0.0.1:port"):
        with pytest.raises(FormatError, match="https://host"):
            S3Tier(f"s3://{bucket}/run", endpoint_url=bad, driver=driver)
    # a space in its path also made obstore panic; a query sent requests no server answers
    for bad, says in (
        (f"http://{hostport}/a b", "does not belong in a URL"),
        (f"http://{hostport}?x=1", "no query or fragment"),
        (f"http://{hostport}#part", "no query or fragment"),
    ):
        with pytest.raises(FormatError, match=says):
            S3Tier(f"s3://{bucket}/run", endpoint_url=bad, driver=driver)
    # control characters in the bucket URL: a newline was dropped without a word by Python's
    # URL parsing (s3://b/run<newline>2 wrote to run2), others failed at the first request
    for url in (f"s3://{bucket}/run\n2", f"s3://{bucket}/run\x01"):
        with pytest.raises(FormatError, match="control character"):
            S3Tier(url, endpoint_url=moto_server.endpoint_url, driver=driver)
    # a region that is not one: obstore signed with it and saved, but every retention pass
    # failed on it (the boto3 client retention uses for open uploads refused it)
    for region in ("us east 1", "us-east-1 ", ""):
        with pytest.raises(FormatError, match="not a region name"):
            S3Tier(f"s3://{bucket}/run", endpoint_url=f"http://{hostport}", region=region)
    # the URL it suggests works
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=f"http://{hostport}", driver=driver)
    with Checkpointer([tier]) as ck:
        ck.save(_state(), 1).wait()
        assert torch.equal(ck.load()["w"], _state()["w"])


@pytest.mark.s3
def test_an_environment_endpoint_without_its_scheme_is_refused_before_any_save(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_bucket(moto_server)
    hostport = moto_server.endpoint_url.removeprefix("http://")
    monkeypatch.setenv("AWS_ENDPOINT_URL", hostport)
    with pytest.raises(FormatError, match="AWS_ENDPOINT_URL") as info:
        Checkpointer([S3Tier(f"s3://{bucket}/run", driver="obstore")])
    assert f"'http://{hostport}'" in str(info.value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{hostport}")
    with Checkpointer([S3Tier(f"s3://{bucket}/run", driver="obstore")]) as ck:
        ck.save(_state(), 1).wait()
        assert ck.steps() == [1]


def test_an_azure_endpoint_without_its_scheme_is_refused() -> None:
    with pytest.raises(FormatError, match="'http://127.0.0.1:10000/devstoreaccount1'"):
        AzureTier("az://container/run", endpoint_url="127.0.0.1:10000/devstoreaccount1")


@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("127.0.0.1 :4443", "does not belong in a URL"),
        ("ftp://127.0.0.1:4443", "is not an http:// or https:// URL"),
        ("http://127.0.0.1:4443/?x=1", "no query or fragment"),
    ],
)
def test_a_gcs_emulator_endpoint_is_checked_like_the_others(endpoint: str, why: str) -> None:
    """``GCSTier`` takes ``host:port`` (as ``STORAGE_EMULATOR_HOST`` has it) but was not
    checked at all; the same checks as S3's and Azure's now, where the tier is made and where
    the emulator's address comes from the environment."""
    from tierckpt.backends.objstore import ObjectStoreBackend

    assert GCSTier("gs://bucket/run", endpoint_url="127.0.0.1:4443").url == "gs://bucket/run"
    with pytest.raises(FormatError, match=why):
        GCSTier("gs://bucket/run", endpoint_url=endpoint)
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", endpoint)
    try:
        with pytest.raises(FormatError, match=f"STORAGE_EMULATOR_HOST.*{why}"):
            ObjectStoreBackend("gs://bucket/run")
    finally:
        mp.undo()


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_an_endpoint_ending_with_the_bucket_s_name_is_warned_about(
    driver: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by trying it: ``endpoint_url="http://host:9000/ckpts"`` beside ``s3://ckpts/run``
    (the bucket written into both) sent listings to ``/ckpts/ckpts`` ("manifests/ does not
    exist", "NoSuchKey") while the object_store driver's lease and probe PUTs landed under
    ``ckpts/run/`` inside the bucket; nothing was committed and nothing said why. A warning
    names the endpoint meant (a gateway may serve S3 under such a path: not refused)."""
    from tierckpt.backends.objstore import ObjectStoreBackend
    from tierckpt.backends.s3 import S3Backend

    def make(url: str, endpoint: str | None) -> None:
        cls = ObjectStoreBackend if driver == "obstore" else S3Backend
        cls(url, endpoint_url=endpoint).close()

    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    caplog.set_level(logging.WARNING, logger="tierckpt")
    make("s3://ckpts/run", "http://127.0.0.1:9/ckpts/")
    said = [r.getMessage() for r in caplog.records if "bucket's name" in r.getMessage()]
    assert len(said) == 1, said
    assert "'http://127.0.0.1:9'" in said[0] and "s3://ckpts" in said[0], said
    caplog.clear()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://gw.example:8443/s3/ckpts")  # the same, set
    make("s3://ckpts/run", None)
    said = [r.getMessage() for r in caplog.records if "bucket's name" in r.getMessage()]
    assert len(said) == 1 and "'https://gw.example:8443/s3'" in said[0], said
    caplog.clear()
    for url, endpoint in (  # a path of another name, a bucket named like the host: quiet
        ("s3://ckpts/run", "https://gw.example/s3"),
        ("s3://minio/run", "http://minio:9000"),
        ("s3://ckpts/ckpts", "http://127.0.0.1:9"),
    ):
        make(url, endpoint)
    assert not [r for r in caplog.records if "bucket's name" in r.getMessage()]
