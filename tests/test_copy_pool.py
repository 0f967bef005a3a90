"""The capture's copy team: helpers reused across saves (not a thread start per save), gone when
idle or closed, and used only while training waits for the capture — a lazy capture that
nobody waits for copies on the capture thread alone, leaving the other cores to training."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.pipeline import _capture as capture_stage
from tierckpt.pipeline._copyteam import CopyTeam


def _until(cond: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_helpers_are_started_once_and_reused_by_later_runs() -> None:
    seen: list[str] = []
    lock = threading.Lock()

    def part() -> None:
        with lock:
            seen.append(threading.current_thread().name)

    with CopyTeam(3) as team:
        for _ in range(5):
            team.run([part, part, part])
        assert team.started == 2
        assert team.live == 2
    assert len(seen) == 15
    assert seen.count("tierckpt-copy") == 10  # two parts of each run on the helpers
    assert team.live == 0  # closed: every helper has left


def test_an_idle_helper_exits_and_the_next_run_starts_one_again() -> None:
    out: list[int] = []
    team = CopyTeam(2, idle_s=0.05)
    try:
        team.run([lambda: out.append(1), lambda: out.append(2)])
        assert team.started == 1
        _until(lambda: team.live == 0)
        team.run([lambda: out.append(3), lambda: out.append(4)])
        assert team.started == 2
        assert sorted(out) == [1, 2, 3, 4]
    finally:
        team.close()
    with pytest.raises(RuntimeError, match="closed"):
        team.run([lambda: None, lambda: None])


def test_one_thread_or_one_part_runs_on_the_caller_without_helpers() -> None:
    names: list[str] = []
    with CopyTeam(1) as one:
        one.run([lambda: names.append(threading.current_thread().name)] * 3)
    with CopyTeam(4) as four:
        four.run([lambda: names.append(threading.current_thread().name)])
        assert four.started == 0
    assert names == [threading.current_thread().name] * 4


def _big_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(2 << 20, generator=g), "b": torch.randn(2 << 20, generator=g)}


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records, per copied chunk, whether the capture split it among the copy team; the first
    chunk's copy waits for ``go`` once ``entered`` is set."""
    real = capture_stage.copy_chunk
    rec: dict[str, Any] = {
        "split": [],
        "entered": threading.Event(),
        "go": threading.Event(),
    }
    rec["go"].set()

    def recording(*args: Any) -> Any:
        team = args[5] if len(args) > 5 else None
        rec["split"].append(team is not None)
        if len(rec["split"]) == 1:
            rec["entered"].set()
            assert rec["go"].wait(30)
        return real(*args)

    monkeypatch.setattr(capture_stage, "copy_chunk", recording)
    monkeypatch.setattr(capture_stage, "copy_threads", lambda: 3)
    return rec


def test_a_capture_nobody_waits_for_is_copied_without_helpers(
    tmp_path: Path, copies: dict[str, Any]
) -> None:
    state = _big_state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=8 << 20) as ck:
        h = ck.save(state, step=1)
        _until(lambda: h.captured)  # polled: nobody blocks on the save
        assert copies["split"] == [False, False]
        team = ck._pipeline._copy_team  # type: ignore[union-attr]
        assert team is None or team.started == 0
        h.wait()
        assert_same(state, ck.load(step=1))


def test_the_capture_splits_copies_once_training_waits(
    tmp_path: Path, copies: dict[str, Any]
) -> None:
    state = _big_state()
    copies["go"].clear()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=8 << 20) as ck:
        h = ck.save(state, step=1)
        assert copies["entered"].wait(30)  # the first chunk's copy started, nobody waited yet
        waiter = threading.Thread(target=h.wait_captured)
        waiter.start()
        _until(lambda: h._awaited.is_set())
        copies["go"].set()
        waiter.join(30)
        assert copies["split"] == [False, True]
        h.wait()
        assert_same(state, ck.load(step=1))
        team = ck._pipeline._copy_team  # type: ignore[union-attr]
        assert team is not None and team.started == 2
    assert team.live == 0  # the writer's close stopped the helpers
