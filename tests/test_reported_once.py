"""An operator reads each cause of failure once per Checkpointer: a missing bucket fails the
timeline's listing, the lease and the save, and logs one WARNING and each failed save's ERROR;
a different cause is still reported, and the same one again after a commit there."""

from __future__ import annotations

import errno
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.errors import BackendError
from tierckpt.format import manifest_name
from tierckpt.reported import RETENTION, forget_causes, report_once
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


def _retention_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "tierckpt" and r.getMessage().startswith("retention on")
    ]


def test_a_retention_pass_failing_at_every_save_warns_once_until_a_pass_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deletes refused on a tier (a folder, a bucket policy without delete): the retention
    pass after every commit fails the same way, and logged a WARNING at every save."""
    deny = threading.Event()
    deny.set()

    class NoDelete(LocalBackend):
        def delete(self, name: str) -> None:
            if deny.is_set():
                msg = f"{self.url}/{name}: delete failed: Permission denied"
                raise BackendError(errno.EACCES, msg)
            super().delete(name)

    class NoDeleteTier(LocalTier):
        def make_backend(self) -> LocalBackend:
            return NoDelete(self.path)

    caplog.set_level(logging.DEBUG, logger="tierckpt")
    state = {"w": torch.ones(64)}
    with Checkpointer([NoDeleteTier(tmp_path, keep_last=1)]) as ck:
        for step in range(1, 6):  # passes 2..5 fail: one WARNING
            ck.save(state, step=step).wait()
            ck.wait(retention=True)
        levels = [r.levelname for r in _retention_warnings(caplog)]
        assert levels == ["WARNING", "DEBUG", "DEBUG", "DEBUG"], levels
        assert ck.steps() == [1, 2, 3, 4, 5]  # nothing was deleted, nothing lost
        deny.clear()  # deletes work again: the next pass succeeds
        ck.save(state, step=6).wait()
        ck.wait(retention=True)
        assert ck.steps() == [6]
        deny.set()  # and fail again: news again
        for step in (7, 8):
            ck.save(state, step=step).wait()
            ck.wait(retention=True)
        deny.clear()  # close gives the lease back
    levels = [r.levelname for r in _retention_warnings(caplog)]
    assert levels == ["WARNING", "DEBUG", "DEBUG", "DEBUG", "WARNING", "DEBUG"], levels
    assert "Permission denied" in _retention_warnings(caplog)[-1].getMessage()


def test_unreadable_metrics_warn_once_per_checkpoint_not_at_every_pass(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """keep_best reads every checkpoint's metrics at every pass: one whose manifest cannot
    be read is kept, and said so with a WARNING at every save."""
    state = {"w": torch.ones(64)}
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save(state, step=1, metrics={"loss": 1.0}).wait()
    (tmp_path / manifest_name(1)).write_bytes(b"{not json")
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    tier = LocalTier(tmp_path, keep_last=1, keep_best=1, best_metric="loss")
    with Checkpointer([tier]) as ck:
        for step in range(2, 6):
            ck.save(state, step=step, metrics={"loss": float(step)}).wait()
            ck.wait(retention=True)
        assert ck.steps() == [1, 2, 5]  # kept: unreadable, best, newest
    records = _retention_warnings(caplog)
    assert [r.levelname for r in records] == ["WARNING", "DEBUG", "DEBUG", "DEBUG"], [
        r.getMessage() for r in records
    ]
    assert "keeps step 1: its metrics cannot be read" in records[0].getMessage()


def test_a_local_error_is_one_cause_whatever_the_file_and_topics_are_apart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A folder that refuses writes fails every file with the same errno: one cause (its
    message names each file). A retention failure is not a save failure: a commit does not
    make the retention pass's cause news again, a completed pass does."""
    backend = MemoryBackend()
    a = BackendError(errno.EACCES, "/run/manifests/step-1.json: delete failed: denied")
    b = BackendError(errno.EACCES, "/run/de/steps/000000000001/rank-0.tck: delete failed")
    full = BackendError(errno.ENOSPC, "/run/de/steps/000000000002/rank-0.tck: write failed")
    caplog.set_level(logging.DEBUG, logger="tierckpt")
    for exc in (a, b, full):
        report_once(backend, exc, "save %s", exc)
    report_once(backend, b, "retention %s", b, topic=RETENTION)  # its own topic: news
    forget_causes(backend)  # a save committed
    report_once(backend, a, "retention %s", a, topic=RETENTION)  # still reported
    report_once(backend, a, "save %s", a)  # news again
    forget_causes(backend, topic=RETENTION)  # a pass completed
    report_once(backend, a, "retention %s", a, topic=RETENTION)
    levels = [(r.levelname, r.getMessage().split()[0]) for r in caplog.records]
    assert levels == [
        ("WARNING", "save"),
        ("DEBUG", "save"),
        ("WARNING", "save"),
        ("WARNING", "retention"),
        ("DEBUG", "retention"),
        ("WARNING", "save"),
        ("WARNING", "retention"),
    ]


def test_lease_renewals_failing_while_the_store_is_down_warn_once_per_outage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The tier thread renews its lease every ttl / 4 and retries a failed renewal every
    ttl / 16: while the store is down, that logged a WARNING at every try. Now one WARNING
    per outage, and an INFO when a renewal works again; a later outage is news again."""
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", "0.8")  # renewed every 0.2 s, retried every 0.05
    down = threading.Event()
    failed = [0]  # lease requests refused while the store is down

    class Flaky(LocalBackend):
        def _refuse(self, name: str) -> None:
            if down.is_set() and name.startswith("leases/"):
                failed[0] += 1
                raise BackendError(errno.EIO, f"{self.url}/{name}: I/O error (store down)")

        def get(self, name: str) -> bytes:
            self._refuse(name)
            return super().get(name)

        def put_atomic(self, name: str, data: Any, *, overwrite: bool = False) -> None:
            self._refuse(name)
            super().put_atomic(name, data, overwrite=overwrite)

    class FlakyTier(LocalTier):
        def make_backend(self) -> LocalBackend:
            return Flaky(self.path)

    def renewals() -> list[str]:
        return [
            r.levelname
            for r in caplog.records
            if r.name == "tierckpt"
            and "renew" in r.getMessage()
            and "writer's lease" in r.getMessage()
        ]

    def until(what: Any) -> None:
        deadline = time.monotonic() + 20
        while not what():
            assert time.monotonic() < deadline, (failed, renewals())
            time.sleep(0.02)

    caplog.set_level(logging.DEBUG, logger="tierckpt")
    state = {"w": torch.ones(64)}
    with Checkpointer([FlakyTier(tmp_path)]) as ck:
        ck.save(state, step=1).wait()  # takes the lease; the tier thread renews it from now
        for outage in range(2):
            failed[0] = 0
            down.set()
            until(lambda: failed[0] >= 5)  # several renewals failed
            down.clear()
            until(lambda: renewals()[-1:] == ["INFO"])  # one worked again
            ck.save(state, step=2 + outage).wait()
    levels = renewals()
    first = levels.index("INFO")
    assert levels[0] == "WARNING" and set(levels[1:first]) == {"DEBUG"}, levels
    assert len(levels[:first]) >= 3, levels  # it failed several times: said once
    again = levels[first + 1 :]
    assert again[0] == "WARNING" and set(again[1:-1]) == {"DEBUG"}, levels
    assert again[-1] == "INFO" and len(again) >= 3, levels
    back = [r.getMessage() for r in caplog.records if "lease again" in r.getMessage()]
    assert "tries failed over" in back[0], back
