"""Observability: Checkpointer.stats(), commit callbacks, blocked time."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import Checkpointer, CommitStats, LocalTier, MemoryTier, TierResult


def test_stats_and_callbacks(tmp_path: Path) -> None:
    seen: list[TierResult] = []
    threads: set[str] = set()

    def on_commit(r: TierResult) -> None:
        seen.append(r)
        threads.add(threading.current_thread().name)

    extra: list[int] = []
    with Checkpointer(
        [MemoryTier(namespace="obs"), LocalTier(tmp_path, codec="zstd")], on_commit=on_commit
    ) as ck:
        ck.add_callback(lambda r: extra.append(r.step))
        for step in (1, 2, 3):
            ck.save({"w": torch.zeros(10_000), "step": step}, step).result()
        stats = ck.stats()
    assert [(s.step, s.tier) for s in stats] == [
        (1, "memory"),
        (1, "local"),
        (2, "memory"),
        (2, "local"),
        (3, "memory"),
        (3, "local"),
    ]
    assert [(r.step, r.tier) for r in seen] == [(s.step, s.tier) for s in stats]
    assert sorted(extra) == [1, 1, 2, 2, 3, 3]
    assert all(not t.startswith("MainThread") for t in threads)  # background threads
    s = stats[-1]
    assert isinstance(s, CommitStats)
    assert s.raw_bytes == 40_000 and s.stored_bytes < s.raw_bytes and s.ratio > 10
    assert s.seconds > 0 and s.gbps > 0 and s.blocked_seconds >= 0 and s.codec == "zstd"
    d = s.as_dict()
    assert set(d) == {
        "step",
        "tier",
        "raw_bytes",
        "stored_bytes",
        "seconds",
        "gbps",
        "ratio",
        "blocked_seconds",
        "codec",
        "committed_at",
    }


def test_stats_history_is_bounded() -> None:
    with Checkpointer([MemoryTier(namespace="obs-bound")], stats_history=4) as ck:
        for step in range(10):
            ck.save({"x": torch.ones(4)}, step).result()
        assert [s.step for s in ck.stats()] == [6, 7, 8, 9]
    with pytest.raises(ValueError):
        Checkpointer([MemoryTier(namespace="obs-bad")], stats_history=0)


def test_failing_callback_never_fails_the_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    def boom(_r: TierResult) -> None:
        raise RuntimeError("metrics sink down")

    with Checkpointer([MemoryTier(namespace="obs-boom")], on_commit=boom) as ck:
        with caplog.at_level(logging.ERROR, logger="tierckpt"):
            ck.save({"x": torch.ones(4)}, 1).result()
        assert ck.steps() == [1]
        assert len(ck.stats()) == 1
    assert "metrics sink down" in caplog.text
    with pytest.raises(TypeError):
        ck.add_callback("not callable")  # type: ignore[arg-type]


def test_remove_callback() -> None:
    seen: list[int] = []
    cb = seen.append
    with Checkpointer([MemoryTier(namespace="obs-rm")]) as ck:
        ck.add_callback(lambda r: cb(r.step))
        fn = ck.add_callback(lambda r: seen.append(-r.step))
        ck.save({"x": torch.ones(4)}, 1).result()
        ck.remove_callback(fn)
        ck.save({"x": torch.ones(4)}, 2).result()
    assert sorted(seen) == [-1, 1, 2]


def test_blocked_seconds_count_save_and_wait() -> None:
    with Checkpointer([MemoryTier(namespace="obs-blocked")]) as ck:
        h = ck.save({"x": torch.ones(1000)}, 1)
        after_save = h.blocked_seconds
        assert after_save > 0
        ck.wait_captured()
        assert h.blocked_seconds >= after_save
        h.result()
        assert ck.stats()[0].blocked_seconds == h.blocked_seconds
    assert tierckpt.CommitStats is CommitStats
