"""A damaged lease file does not stop checkpointing for good.

An object at a lease's name that is no lease tierckpt can read (an empty file left by a disk
fault, a truncated write, a lease written by a newer tierckpt) made every ``save()`` raise
``WriterConflict`` — on every tier, not only the one holding the file — and told the operator
to wait for a ttl that never ended: the object has no renewal time, so it never expired, and
training went on with no checkpoint at all until someone ran ``tierckpt unlock``.

Now such an object is judged by when the store last wrote it (its modification time, by the
store's clock): older than the ttl, it is taken over with a warning; younger, only that tier's
copy fails (nothing written there, the other tiers save) and the next save asks again. Bytes
that change while a writer watches mean another writer renews them: that one is refused.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import Recorder

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier, WriterConflict
from tierckpt.testing.s3servers import S3Server

LEASE = "leases/rank-000000.json"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 12, generator=g), "step": step}


def _damage(root: Path, age_s: float) -> Path:
    path = root / LEASE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_an_old_unreadable_lease_is_taken_over(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Any,
    caplog: pytest.LogCaptureFixture,
    record: Recorder,
) -> None:
    root = tmp_path / "run"
    bucket = s3_bucket(moto_server)
    tiers = [
        LocalTier(root),
        S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, codec="raw"),
    ]
    path = _damage(root, age_s=3600)
    with caplog.at_level(logging.WARNING, logger="tierckpt"), Checkpointer(tiers) as ck:
        ck.save(_state(1), 1).wait(timeout=60)  # both tiers commit
        assert ck.tier_steps() == {"local": [1], "s3": [1]}
    assert any("taking over rank 0's lease" in r.getMessage() for r in caplog.records)
    assert not path.exists()  # this writer's lease, given back at close()
    with Checkpointer([LocalTier(root)]) as reader:
        assert torch.equal(reader.load()["w"], _state(1)["w"])
    record(
        "one_writer",
        "an unreadable lease file an hour old (local tier beside S3)",
        "taken over with a warning; both tiers committed",
    )


def test_a_fresh_unreadable_lease_fails_only_its_tier_until_the_ttl(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    record: Recorder,
) -> None:
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", "3")
    root = tmp_path / "run"
    bucket = s3_bucket(moto_server)
    tiers = [
        LocalTier(root),
        S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, codec="raw"),
    ]
    _damage(root, age_s=0)
    t0 = time.monotonic()
    with Checkpointer(tiers) as ck:
        handle = ck.save(_state(1), 1)  # does not raise
        with pytest.raises(CheckpointFailed) as info:
            handle.wait(timeout=60)
        assert set(info.value.errors) == {"local"}, info.value.errors  # S3 committed
        why = info.value.errors["local"]
        assert isinstance(why, WriterConflict) and why.presumed, repr(why)
        assert "not a lease tierckpt can read" in str(why) and "ttl" in str(why), str(why)
        step = 1
        while ck.tier_steps().get("local") in (None, []):
            assert time.monotonic() - t0 < 60, "the unreadable lease was never taken over"
            time.sleep(0.5)
            step += 1
            try:
                ck.save(_state(step), step).wait(timeout=60)
            except CheckpointFailed as exc:
                assert set(exc.errors) == {"local"}, exc.errors
        assert ck.tier_steps()["local"] == [step]
        assert ck.tier_steps()["s3"][-1] == step  # S3 committed every step (keep_last trims)
    record(
        "one_writer",
        "an unreadable lease file just written (local tier beside S3)",
        f"only the local copies failed, S3 committed every step; taken over after "
        f"{time.monotonic() - t0:.1f} s (ttl 3 s)",
    )


def test_an_unreadable_lease_that_keeps_changing_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", "3")
    root = tmp_path / "run"
    path = _damage(root, age_s=0)
    with Checkpointer([LocalTier(root)]) as ck:
        with pytest.raises(CheckpointFailed):
            ck.save(_state(1), 1).wait(timeout=60)
        path.write_bytes(b"{not json")  # another writer renews it in a format we cannot read
        with pytest.raises(WriterConflict) as info:
            ck.save(_state(2), 2)
        assert not info.value.presumed and "changed while this writer watched" in str(info.value)
    assert path.read_bytes() == b"{not json"  # never overwritten


def test_one_unreadable_answer_for_a_held_lease_does_not_lose_the_tier(
    tmp_path: Path, record: Recorder
) -> None:
    """A writer's own lease read back as something unreadable (a proxy's HTML page in the
    field test; here the file's bytes replaced for one save): before, the writer called the
    lease lost for good ("Two jobs are pointed at one location") and never wrote that tier
    again, though its lease was back the next moment. Now that save's copy fails there (the
    other tiers commit), and once the lease reads as its own again the tier saves again."""
    local, other = tmp_path / "local", tmp_path / "other"
    with Checkpointer([LocalTier(local), LocalTier(other, name="other")]) as ck:
        ck.save(_state(1), 1).wait(timeout=60)
        path = local / LEASE
        mine = path.read_bytes()
        path.write_bytes(b"<html><body>Log in to use this network</body></html>")
        h = ck.save(_state(2), 2)
        with pytest.raises(CheckpointFailed, match="could not be read"):
            h.wait(timeout=60)
        assert h.committed("other") and not h.committed("local")
        path.write_bytes(mine)  # the store answers again
        ck.save(_state(3), 3).wait(timeout=60)
        assert ck.tier_steps() == {"local": [1, 3], "other": [1, 2, 3]}
    with Checkpointer([LocalTier(local)]) as ck:
        assert ck.steps() == [1, 3]
        assert torch.equal(ck.load()["w"], _state(3)["w"])
    record(
        "one_writer",
        "a writer's own lease read back once as an HTML page (local + other tier)",
        "that save's copy failed on the tier (committed on the other); the lease back, the "
        "next save committed on both",
    )
