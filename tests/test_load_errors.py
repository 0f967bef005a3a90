"""The error a failed load raises: "nothing committed" and "committed but unreadable" are told
apart by a listing made after the failure, and a save that committed in between is neither.

Seen in a field test: ``ck.save(state, 1)`` then ``ck.load()`` at once (no ``ck.wait()``). The
load listed nothing (step 1 still in flight), the save committed, and the second listing found
step 1: the load raised "checkpoint step 1 is committed but could not be read (damaged, ...)",
which sends an operator to look for damage that is not there.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer
from tierckpt.checkpointer import _loading
from tierckpt.checkpointer._load_errors import committed_yet_unread
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint
from tierckpt.format import CheckpointId


def _not_found() -> CheckpointNotFound:
    return CheckpointNotFound("no committed checkpoint on any tier (local: /x)")


def test_a_step_committed_while_the_load_ran_is_not_called_damaged() -> None:
    listed = [CheckpointId(1, 0)]
    error = _not_found()
    assert committed_yet_unread(error, lambda: listed, None, None, "error", {1}) is error
    # the same listing without the step in flight: committed yet unread
    other = committed_yet_unread(_not_found(), lambda: listed, None, None, "error", set())
    assert isinstance(other, CorruptCheckpoint)
    assert "step 1 is committed but could not be read" in str(other)
    # an older committed step is still named, the in-flight one is not blamed
    listed = [CheckpointId(1, 0), CheckpointId(2, 0)]
    got = committed_yet_unread(_not_found(), lambda: listed, None, None, "error", {2})
    assert isinstance(got, CorruptCheckpoint) and "step 1 is committed" in str(got)


def test_load_right_after_save_says_wait_not_damaged(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.arange(8.0)}
    with Checkpointer(str(tmp_path / "run")) as ck:
        real = _loading.list_checkpoints
        handle = None
        calls = []

        def listing_after_the_commit(ctx, tier):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 1:
                return []  # listed before the save committed
            assert handle is not None
            handle.wait()  # ... and it commits before the next listing
            return real(ctx, tier)

        real_once = _loading._load_once

        def load_once_before_the_commit(ctx, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise CheckpointNotFound(
                "no committed checkpoint on any tier; this Checkpointer is still saving step(s) "
                "[1]: call ck.wait() first"
            )

        monkeypatch.setattr(_loading, "list_checkpoints", listing_after_the_commit)
        monkeypatch.setattr(_loading, "_load_once", load_once_before_the_commit)
        handle = ck.save(state, 1)
        with pytest.raises(CheckpointNotFound) as ei:
            ck.load()
        assert not isinstance(ei.value, CorruptCheckpoint), str(ei.value)
        assert "call ck.wait() first" in str(ei.value)
        monkeypatch.setattr(_loading, "_load_once", real_once)
        monkeypatch.setattr(_loading, "list_checkpoints", real)
        assert torch.equal(ck.load()["w"], state["w"])


def test_a_copy_removed_since_the_listing_is_read_from_the_next_tier_quietly(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # a [Memory(keep_last=1), Local] writer that loads beside its saves: the memory copy the
    # load listed is removed by the next commit's retention before it is read. The local copy
    # is the expected path; it used to log a WARNING per load
    from tierckpt import LocalTier, MemoryTier
    from tierckpt.format import manifest_name

    state = {"w": torch.arange(8.0)}
    tiers = [MemoryTier(namespace="quiet-vanish"), LocalTier(str(tmp_path / "run"))]
    with Checkpointer(tiers) as ck:
        ck.save(state, 1).wait()
        real = _loading.list_tiers

        def listed_then_removed(*args, **kwargs):  # type: ignore[no-untyped-def]
            got = real(*args, **kwargs)
            ck.backend("memory").delete(manifest_name(1))
            return got

        monkeypatch.setattr(_loading, "list_tiers", listed_then_removed)
        with caplog.at_level("INFO", logger="tierckpt"):
            out = ck.load()
    assert torch.equal(out["w"], state["w"])
    tried = [r for r in caplog.records if "trying the next" in r.getMessage()]
    assert tried and all(r.levelname == "INFO" for r in tried), [
        (r.levelname, r.getMessage()) for r in tried
    ]


def test_a_shard_file_missing_under_its_manifest_is_still_a_warning(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    # damage on a fast tier (its manifest is there, a shard file is not): every load then
    # reads the slower tier, and the user must hear of it
    from tierckpt import LocalTier
    from tierckpt.format import shard_name

    state = {"w": torch.arange(8.0)}
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    tiers = [LocalTier(fast, name="fast"), LocalTier(slow, name="slow")]
    with Checkpointer(tiers) as ck:
        ck.save(state, 1).wait()
    (fast / shard_name(1, 0)).unlink()
    with caplog.at_level("INFO", logger="tierckpt"), Checkpointer(tiers) as ck:
        out = ck.load()
    assert torch.equal(out["w"], state["w"])
    tried = [r for r in caplog.records if "trying the next" in r.getMessage()]
    assert tried and all(r.levelname == "WARNING" for r in tried), [
        (r.levelname, r.getMessage()) for r in tried
    ]


def test_a_fallback_to_an_older_checkpoint_is_said_aloud(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``load(fallback="previous")`` returns only the state: where the newest could not be
    read and an older one was loaded, a WARNING names both (it was INFO, so a state without a
    step key of its own did not tell which step training resumed from)."""
    from tierckpt import LocalTier
    from tierckpt.format import shard_name

    with Checkpointer([LocalTier(tmp_path)]) as ck:
        for step in (1, 2):
            ck.save({"w": torch.full((64,), float(step))}, step).wait()
    p = tmp_path / shard_name(2, 0)
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))
    with Checkpointer([LocalTier(tmp_path)]) as ck, caplog.at_level("WARNING", "tierckpt"):
        got = ck.load(fallback="previous")
    assert torch.equal(got["w"], torch.full((64,), 1.0))
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("loaded the older" in m and "1" in m for m in said), said
