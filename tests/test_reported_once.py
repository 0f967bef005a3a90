"""An operator reads each cause of failure once per Checkpointer: a missing bucket fails the
timeline's listing, the lease and the save, and logs one WARNING and each failed save's ERROR;
a different cause is still reported, and the same one again after a commit there."""

from __future__ import annotations

import logging
import secrets

import pytest
import torch

from tierckpt import Checkpointer, CheckpointFailed, S3Tier
from tierckpt.backends.memory import MemoryBackend
from tierckpt.errors import BackendError
from tierckpt.reported import forget_causes, report_once
from tierckpt.testing.s3servers import S3Server


def _loud(caplog: pytest.LogCaptureFixture, bucket: str) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == "tierckpt" and bucket in r.getMessage()
    ]


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["boto3", "obstore"])
def test_a_missing_bucket_is_reported_once_per_checkpointer(
    moto_server: S3Server,
    driver: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", driver)
    bucket = "no-such-bucket-" + secrets.token_hex(3)
    state = {"w": torch.ones(4)}
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    for attempt in range(2):  # each Checkpointer reports it once
        caplog.clear()
        tier = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
        with Checkpointer([tier]) as ck:
            for step in (1, 2):
                h = ck.save(state, step=10 * attempt + step)
                with pytest.raises(CheckpointFailed, match="create the bucket"):
                    h.wait()
            ck.wait(retention=True)
        loud = _loud(caplog, bucket)
        assert [r.levelname for r in loud] == ["WARNING", "ERROR", "ERROR"], [
            r.getMessage() for r in loud
        ]
        for r in loud:  # each names the bucket and says what to do
            assert f"bucket {bucket!r} does not exist" in r.getMessage()
            assert "create the bucket or check the URL" in r.getMessage()
        # the lease's own warning still reached the debug log
        assert any("lease" in r.getMessage() and r.levelno == logging.DEBUG for r in caplog.records)


def test_a_different_cause_is_still_reported_and_the_same_again_after_a_commit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backend, other = MemoryBackend(), MemoryBackend()
    missing = BackendError("s3://b/x: list failed: NoSuchBucket")
    missing.code, missing.status = "NoSuchBucket", 404  # type: ignore[attr-defined]
    same = BackendError("s3://b/y: put failed: NoSuchBucket")
    same.code, same.status = "NoSuchBucket", 404  # type: ignore[attr-defined]
    denied = BackendError("s3://b/y: put failed: AccessDenied")
    denied.code, denied.status = "AccessDenied", 403  # type: ignore[attr-defined]
    plain, plain2 = BackendError("disk full on /a"), BackendError("disk full on /b")
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    for exc in (missing, same, denied, plain, plain2, plain, missing):
        report_once(backend, exc, "m %s", exc)
    report_once(other, missing, "m %s", missing)  # another backend: its own
    forget_causes(backend)  # a save committed there
    report_once(backend, same, "m %s", same)
    levels = [(r.levelname, r.getMessage()[2:]) for r in caplog.records]
    assert levels == [
        ("WARNING", str(missing)),
        ("DEBUG", str(same)),
        ("WARNING", str(denied)),
        ("WARNING", str(plain)),
        ("WARNING", str(plain2)),
        ("DEBUG", str(plain)),
        ("DEBUG", str(missing)),
        ("WARNING", str(missing)),
        ("WARNING", str(same)),
    ]
