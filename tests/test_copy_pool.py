"""The capture's copy team: helpers reused across saves (not a thread start per save), gone when
idle or when the writer closes."""

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
from tierckpt.pipeline import _copyteam as copyteam
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


def test_every_save_splits_its_big_host_chunks_on_the_same_helpers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lazy saves nobody waits for split too (training's threads meet at barriers: one
    background thread on one core stalls them all longer than the copy spread over every
    core), and the writer's helpers are started once, not per save."""
    real = capture_stage.copy_chunk
    split: list[bool] = []

    def recording(*args: Any) -> Any:
        team = args[5] if len(args) > 5 else None
        split.append(team is not None and team.threads > 1)
        return real(*args)

    monkeypatch.setattr(capture_stage, "copy_chunk", recording)
    monkeypatch.setattr(capture_stage, "copy_threads", lambda: 3)
    monkeypatch.setattr(copyteam, "IDLE_S", 600.0)  # no helper leaves between these saves
    state = _big_state()
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=8 << 20) as ck:
        for step in range(1, 4):
            h = ck.save(state, step=step)
            _until(lambda h=h: h.captured)  # polled: nobody blocks on the save
            h.wait()
            assert_same(state, ck.load(step=step))
            state["a"].add_(1)
        team = ck._pipeline._copy_team  # type: ignore[union-attr]
        assert team is not None and team.started == 2 and team.live == 2
    assert split == [True] * 6
    assert team.live == 0  # the writer's close stopped the helpers
