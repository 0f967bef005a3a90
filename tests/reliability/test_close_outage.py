"""``close()`` during an S3 outage does not wait out S3's timeouts.

A writer gives its lease on every tier back at ``close()`` (so that the next job there starts
at once). While S3 held every request, that took the lease's read and delete with all their
timeouts and retries (a minute with S3's defaults), on top of whatever the close waited for
anyway: a job ending (or preempted, with a grace period of ~30 s) during an outage did not
exit. Now each lease is given back on a thread of its own, waited for at most
``RELEASE_WAIT_S``; one not given back by then expires after its ttl (logged), and the local
folder's lock is released as before.

A tier thread blocked in a call to the held store (an upload, a retention delete) is not
waited for either once it made no progress for ``save_deadline``: its copies are given up,
``close()`` returns, and its lease is given back when the call returns (70 s with S3's
defaults before: the deadline, the blocked call's timeouts, then the lease). ``close(timeout=)``
bounds the whole wait.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import BLACKHOLE, Recorder, held_s3

import tierckpt.pipeline._close as close_module
from tierckpt import Checkpointer, LocalTier
from tierckpt.errors import CloseTimeout, WriterConflict
from tierckpt.testing.faultproxy import Fault, FaultProxy

#: the bound on giving a lease back, for this test
RELEASE_S = 1.0
#: slack for a loaded 2-core machine (a held lease read costs 2 x 10 s here)
SLACK_S = 8.0


def _close_timed(ck: Checkpointer, caplog: pytest.LogCaptureFixture) -> float:
    """``ck.close()`` with its warnings captured; the seconds it took."""
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        ck.close()
    return time.monotonic() - t0


@pytest.mark.s3
def test_close_during_an_s3_outage_leaves_the_lease_to_expire_instead_of_waiting(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    record: Recorder,
) -> None:
    monkeypatch.setattr(close_module, "RELEASE_WAIT_S", RELEASE_S)
    bucket = str(s3_bucket(moto_server))
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        ck = Checkpointer([LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url)])
        ck.save(state, 1).wait(timeout=60)  # both tiers: the writer holds both leases
        ck.wait(retention=True)  # no retention pass left to run (one blocked would be waited for)
        proxy.set_faults(BLACKHOLE)
        took = _close_timed(ck, caplog)
        assert took <= RELEASE_S + SLACK_S, took
        assert "lease was not given back within" in caplog.text, caplog.text
        # the local folder's lock is free: the next job there saves at once
        with Checkpointer([LocalTier(tmp_path / "nvme")]) as nxt:
            assert int(nxt.load()["step"]) == 1
            nxt.save({**state, "step": 2}, 2).wait(timeout=60)
            assert nxt.steps() == [1, 2]
        proxy.set_faults([])
    record(
        "outages",
        "close() while S3 holds every request (writer holding leases on local + S3; a held "
        "lease read costs 2 x 10 s)",
        f"close() returned after {took:.1f} s (bound {RELEASE_S:.0f} s), the S3 lease left to "
        "expire (logged); the next job on the local folder saved at once",
        took_s=round(took, 2),
    )


#: save_deadline of the in-flight tests: how long a tier may make no progress
DEADLINE_S = 2.0


def _save_into_an_outage(
    tmp_path: Path, bucket: str, proxy: FaultProxy
) -> tuple[Checkpointer, Any, dict[str, Any]]:
    """A writer on local + S3 (its one held request costs 2 x 10 s) that committed step 1 on
    both; then S3 holds every request and step 2 is saved: committed locally, S3's copy
    blocked in its upload."""
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 1}
    tiers = [LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url)]
    ck = Checkpointer(tiers, save_deadline=DEADLINE_S)
    ck.save(state, 1).wait(timeout=60)
    ck.wait(retention=True)
    proxy.set_faults(BLACKHOLE)
    handle = ck.save({**state, "step": 2}, 2)
    handle.wait(tier="local", timeout=60)
    return ck, handle, state


@pytest.mark.s3
def test_close_with_a_save_blocked_in_a_held_store_returns_after_the_deadline(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    caplog: pytest.LogCaptureFixture,
    record: Recorder,
) -> None:
    """close() gives the blocked copy up after ``save_deadline`` without progress and does not
    wait for the call it is blocked in (2 x 10 s here: 30-60 s with S3's defaults); the
    location stays this writer's until that call returns, then its lease is given back."""
    bucket = str(s3_bucket(moto_server))
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        ck, handle, state = _save_into_an_outage(tmp_path, bucket, proxy)
        took = _close_timed(ck, caplog)
        assert took <= DEADLINE_S + SLACK_S, took
        assert "still in a call to its store" in caplog.text, caplog.text
        assert handle.done()
        assert type(handle.errors["s3"]).__name__ == "SaveDeadlineExceeded", handle.errors
        with Checkpointer([LocalTier(tmp_path / "nvme")]) as nxt:  # committed locally
            assert nxt.steps() == [1, 2]
            assert int(nxt.load()["step"]) == 2
        proxy.set_faults([])
        # the blocked call still runs in this process: the S3 location is still this
        # writer's (nothing of it can publish after another writer took over) ...
        with (
            Checkpointer([held_s3(bucket, proxy.endpoint_url)]) as other,
            pytest.raises(WriterConflict),
        ):
            other.save({**state, "step": 3}, 3).wait(timeout=60)
        # ... until the call returns (its timeouts): then the lease is given back
        given_back = _wait_for_s3_writer(bucket, proxy.endpoint_url, state, within_s=60)
        with Checkpointer([held_s3(bucket, proxy.endpoint_url)]) as s3:
            assert s3.steps() == [1, 3]  # step 2 never committed there
    record(
        "outages",
        "close() right after a save while S3 holds every request (save_deadline 2 s; the "
        "blocked upload costs 2 x 10 s)",
        f"close() returned after {took:.1f} s with the S3 copy given up and step 2 committed "
        f"locally; S3's location was given back {given_back:.0f} s later, when the blocked "
        "call returned (a new writer was refused until then)",
        took_s=round(took, 2),
    )


def _wait_for_s3_writer(
    bucket: str, endpoint: str, state: dict[str, Any], within_s: float
) -> float:
    """Seconds until a new writer could save step 3 on S3 (polling), or fail after
    ``within_s``."""
    t0 = time.monotonic()
    while True:
        try:
            with Checkpointer([held_s3(bucket, endpoint)]) as other:
                other.save({**state, "step": 3}, 3).wait(timeout=60)
            return time.monotonic() - t0
        except WriterConflict:
            if time.monotonic() - t0 > within_s:
                raise
            time.sleep(1.0)


@pytest.mark.s3
def test_close_with_a_timeout_gives_up_what_is_not_committed_by_then(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    """``close(timeout=)``, e.g. what is left of a preemption's grace period: the S3 copy
    still blocked then is given up (``CloseTimeout`` on the handle), the local one stays."""
    bucket = str(s3_bucket(moto_server))
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        ck, handle, _ = _save_into_an_outage(tmp_path, bucket, proxy)
        with pytest.raises(ValueError, match="close\\(timeout=\\)"):
            ck.close(timeout=-1)  # refused before anything is closed
        t0 = time.monotonic()
        ck.close(timeout=0.5)
        took = time.monotonic() - t0
        assert took <= 0.5 + SLACK_S, took
        assert isinstance(handle.errors["s3"], CloseTimeout), handle.errors
        assert "close(timeout=0.5" in str(handle.errors["s3"])
        with Checkpointer([LocalTier(tmp_path / "nvme")]) as nxt:
            assert nxt.steps() == [1, 2]
        proxy.set_faults([])
    with Checkpointer([held_s3(bucket, moto_server.endpoint_url)]) as s3:
        assert s3.steps() == [1]
    record(
        "outages",
        "close(timeout=0.5) right after a save while S3 holds every request",
        f"returned after {took:.1f} s: the S3 copy given up (CloseTimeout on its handle), "
        "step 2 committed locally, S3 still holds step 1",
        took_s=round(took, 2),
    )


@pytest.mark.s3
def test_close_does_not_wait_for_a_retention_pass_blocked_in_a_held_store(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    """S3 holds only deletes: step 2 commits on both tiers, and the retention pass after it
    (``keep_last=1``: delete step 1) blocks. ``close()`` no longer waits for that delete's
    timeouts (2 x 10 s here); step 1 is left on S3 for a later pass, nothing else changes."""
    bucket = str(s3_bucket(moto_server))
    state = {"w": torch.arange(1 << 16, dtype=torch.float32), "step": 1}
    hold_deletes = [
        Fault("stall", method="DELETE", seconds=600),
        Fault("stall", method="POST", path_contains="delete", seconds=600),
    ]
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = held_s3(bucket, proxy.endpoint_url, keep_last=1)
        ck = Checkpointer([LocalTier(tmp_path / "nvme"), s3], save_deadline=DEADLINE_S)
        ck.save(state, 1).wait(timeout=60)
        ck.wait(retention=True)
        proxy.set_faults(hold_deletes)
        ck.save({**state, "step": 2}, 2).wait(timeout=60)  # committed on both tiers
        deadline = time.monotonic() + 10
        while not any(r.fault for r in list(proxy.requests)):
            assert time.monotonic() < deadline, "the retention pass sent no delete"
            time.sleep(0.05)
        t0 = time.monotonic()
        ck.close()
        took = time.monotonic() - t0
        assert took <= DEADLINE_S + SLACK_S, took
        proxy.set_faults([])
    with Checkpointer([held_s3(bucket, moto_server.endpoint_url)]) as back:
        assert 2 in back.steps(), back.steps()
        assert int(back.load()["step"]) == 2
    record(
        "outages",
        "close() while the retention pass after a commit is blocked in an S3 delete that is "
        "never answered (save_deadline 2 s; the delete costs 2 x 10 s)",
        f"close() returned after {took:.1f} s; step 2 committed on both tiers, the old step "
        "left on S3 for a later pass",
        took_s=round(took, 2),
    )


def _release_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tierckpt-release"]


@pytest.mark.s3
def test_a_new_writer_of_the_process_takes_the_s3_lease_a_close_during_an_outage_left(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """close() while S3 held every request could not delete the writer's S3 lease. The next
    Checkpointer of the same process (a training script that closes and reopens, a notebook)
    took that lease for another live writer of this process: its save() raised
    WriterConflict into the loop for the lease's ttl. Now, while the closed writer's release
    is still in flight, the S3 copy waits (the save goes on with the local tier, nothing
    raised); once the release ended, the lease is taken over at once."""
    monkeypatch.setattr(close_module, "RELEASE_WAIT_S", RELEASE_S)
    bucket = str(s3_bucket(moto_server))
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:

        def tiers() -> list[Any]:
            s3 = held_s3(bucket, proxy.endpoint_url, read_timeout=3)
            return [LocalTier(tmp_path / "nvme"), s3]

        ck = Checkpointer(tiers())
        ck.save(state, 1).wait(timeout=60)
        ck.wait(retention=True)
        proxy.set_faults(BLACKHOLE)
        _close_timed(ck, caplog)
        assert _release_threads(), "the release is expected to be still held"
        proxy.set_faults([])  # S3 answers again; the held release waits for its timeout
        with Checkpointer(tiers()) as nxt:
            h = nxt.save({**state, "step": 2}, 2)  # raised WriterConflict before
            h.wait(tier="local", timeout=60)
            deadline = time.monotonic() + 60
            while not h.done():
                assert time.monotonic() < deadline, "step 2's S3 copy never ended"
                time.sleep(0.1)
            s3_err = h.errors.get("s3")
            assert s3_err is None or (isinstance(s3_err, WriterConflict) and s3_err.presumed)
            deadline = time.monotonic() + 30
            while _release_threads():
                assert time.monotonic() < deadline, "the release never ended"
                time.sleep(0.1)
            nxt.save({**state, "step": 3}, 3).wait(timeout=60)  # both tiers
            assert nxt.steps("local") == [1, 2, 3]
            assert 3 in nxt.steps("s3"), nxt.steps("s3")


@pytest.mark.s3
def test_a_lease_a_closed_writer_could_not_delete_is_taken_over_at_once(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The release failed (S3 held it through all its attempts): the lease stays for its
    ttl (60 s), but no writer holds it; the next writer of this process saves on S3 at once,
    warning that it took the lease over from a closed writer."""
    monkeypatch.setattr(close_module, "RELEASE_WAIT_S", RELEASE_S)
    bucket = str(s3_bucket(moto_server))
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 1}
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = held_s3(bucket, proxy.endpoint_url, read_timeout=1)
        ck = Checkpointer([s3])
        ck.save(state, 1).wait(timeout=60)
        ck.wait(retention=True)
        proxy.set_faults(BLACKHOLE)
        _close_timed(ck, caplog)
        deadline = time.monotonic() + 30
        while _release_threads():
            assert time.monotonic() < deadline, "the release never ended"
            time.sleep(0.1)
        proxy.set_faults([])
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, logger="tierckpt"),
            Checkpointer([held_s3(bucket, proxy.endpoint_url)]) as nxt,
        ):
            nxt.save({**state, "step": 2}, 2).wait(timeout=60)  # raised WriterConflict before
            assert nxt.steps() == [1, 2]
        assert "closed while the store did not answer" in caplog.text, caplog.text
