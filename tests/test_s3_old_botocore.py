"""An S3 client too old to know ``IfNoneMatch`` (botocore < 1.35) still saves and loads.

botocore refuses an unknown parameter on the client side (``ParamValidationError: Unknown
parameter in input: "IfNoneMatch"``) before anything is sent. Here a real boto3 client talks to
a real moto server on 127.0.0.1, with ``IfNoneMatch`` removed from its own PutObject model, so
botocore itself raises exactly that error, as boto3 1.34.x does. ``make test-min`` runs the S3
tests with the declared boto3 floor installed, the same case for real.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from botocore.exceptions import ParamValidationError

from tierckpt.backends.s3 import MIN_PART_SIZE, S3Backend
from tierckpt.testing.s3servers import S3Server

BucketFactory = Callable[[S3Server], str]


def old_client(server: S3Server) -> Any:
    """A boto3 S3 client whose PutObject does not know ``IfNoneMatch`` (as botocore 1.34)."""
    client = server.client()
    shape = client.meta.service_model.operation_model("PutObject").input_shape
    shape.members.pop("IfNoneMatch", None)
    with pytest.raises(ParamValidationError, match='Unknown parameter in input: "IfNoneMatch"'):
        client.put_object(Bucket="b", Key="k", Body=b"", IfNoneMatch="*")
    return client


def make_backend(client: Any, bucket: str, **kwargs: Any) -> S3Backend:
    return S3Backend(f"s3://{bucket}/run-1", part_size=MIN_PART_SIZE, client=client, **kwargs)


@pytest.mark.s3
def test_probe_treats_unknown_parameter_as_unsupported(
    moto_server: S3Server, s3_bucket: BucketFactory, caplog: pytest.LogCaptureFixture
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_backend(old_client(moto_server), bucket)
    with caplog.at_level(logging.INFO, logger="tierckpt.backends.s3"):
        assert not backend.supports_conditional_put
    assert "too old" in caplog.text
    # the HEAD-then-PUT fallback still refuses to overwrite
    backend.put_atomic("m", b"1")
    with pytest.raises(FileExistsError):
        backend.put_atomic("m", b"2")
    assert backend.get("m") == b"1"
    assert backend.list() == ["m"]  # no probe object left behind
    backend.close()


@pytest.mark.s3
def test_forced_conditional_put_falls_back_on_an_old_client(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    bucket = s3_bucket(moto_server)
    backend = make_backend(old_client(moto_server), bucket, conditional_put=True)
    backend.put_atomic("m", b"1")  # IfNoneMatch refused by the client: HEAD+PUT instead
    assert not backend.supports_conditional_put
    with pytest.raises(FileExistsError):
        backend.put_atomic("m", b"2")
    assert backend.get("m") == b"1"
    backend.close()


@pytest.mark.s3
def test_other_parameter_errors_still_raise(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """Only the missing ``IfNoneMatch`` means "unsupported"; another bad parameter is an error."""
    from tierckpt.backends.s3 import _client_lacks_if_none_match

    client = moto_server.client()
    with pytest.raises(ParamValidationError) as info:
        client.put_object(Bucket=s3_bucket(moto_server), Key="k", Body=b"", NoSuchThing=1)
    assert not _client_lacks_if_none_match(info.value)


@pytest.mark.s3
def test_checkpoint_round_trip_through_an_old_client(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """A whole save and load through an S3 tier, manifest last, with the old client."""
    import tierckpt
    from tierckpt.catalog import committed_steps

    bucket = s3_bucket(moto_server)
    tier = tierckpt.S3Tier(
        f"s3://{bucket}/run-1", client=old_client(moto_server), part_size=MIN_PART_SIZE
    )
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 3}
    ck = tierckpt.Checkpointer([tier])
    ck.save(state, 3).wait()
    restored = ck.load()
    ck.close()
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 3
    reader = make_backend(moto_server.client(), bucket)
    assert committed_steps(reader) == [3]
    reader.close()
