"""While a save's host chunks are copied and training waits for that copy (``wait_captured()``,
the guarded optimizer step), their checksums (and so the writes) wait, so the copy has the
cores to itself (a save whose commit is waited for instead overlaps them:
tests/test_every_step_cpu.py); they start when the capture ends, or earlier
when the arena runs low (never a deadlock behind backpressure). Every stored chunk is still
checksummed, and verified when loaded."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, wait_in_a_thread

from tierckpt import Checkpointer, LocalTier
from tierckpt.pipeline import StageEvent


def _state(n: int, elems: int = 16 << 10) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {f"t{i}": torch.randn(elems, generator=g) for i in range(n)}  # 64 KiB each


class _Order:
    """The stage events of a save, in the order they happened (from every thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stages: list[str] = []

    def __call__(self, event: StageEvent) -> None:
        with self.lock:
            self.stages.append(event.stage)


def _slow_copies(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Each chunk copy takes a while: a checksum that did not wait would surely run then. The
    first waits for the returned event."""
    import tierckpt.pipeline._capture as pipeline_mod

    real = pipeline_mod.copy_chunk
    go = threading.Event()

    def slow(*args: Any, **kwargs: Any) -> Any:
        assert go.wait(30), "the test never let the copies go"
        time.sleep(0.02)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "copy_chunk", slow)
    return go


def _save_training_waits_for(ck: Checkpointer, state: Any, go: threading.Event) -> None:
    """Save ``state`` as training does: its capture waited for (``wait_captured()``, as the
    guarded optimizer step does) from before the first copy, then its commit."""
    h = ck.save(state, step=1)
    wait_in_a_thread(h.wait_captured, h.capture_awaited, go)
    h.wait(timeout=60)


def test_checksums_wait_until_every_chunk_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    go = _slow_copies(monkeypatch)
    state = _state(12)
    # an arena with room for every chunk: nothing forces a checksum before the copy ends
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10, host_buffer_bytes=4 << 20) as ck:
        order = _Order()
        ck._get_pipeline().subscribe(order)
        _save_training_waits_for(ck, state, go)
        captures = [i for i, s in enumerate(order.stages) if s == "capture"]
        checksums = [i for i, s in enumerate(order.stages) if s == "checksum"]
        assert len(captures) == 12 and len(checksums) == 12
        assert max(captures) < min(checksums), order.stages
        assert_same(state, ck.load())


def test_a_save_bigger_than_the_arena_starts_its_checksums_before_its_copy_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 slots for 12 chunks: the checksums (and writes) must free slots while the capture
    runs, or it would wait forever."""
    go = _slow_copies(monkeypatch)
    state = _state(12)
    with Checkpointer(
        [LocalTier(tmp_path)], chunk_bytes=64 << 10, host_buffer_bytes=256 << 10
    ) as ck:
        order = _Order()
        ck._get_pipeline().subscribe(order)
        _save_training_waits_for(ck, state, go)
        assert ck._pipeline.arena.n_slots == 4  # type: ignore[union-attr]
        captures = [i for i, s in enumerate(order.stages) if s == "capture"]
        checksums = [i for i, s in enumerate(order.stages) if s == "checksum"]
        assert len(captures) == 12 and len(checksums) == 12
        assert min(checksums) < max(captures), order.stages
        assert_same(state, ck.load())


def test_a_failed_capture_releases_the_waiting_checksums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy that fails mid-save: the chunks already handed over are not left waiting (the
    save fails, its slots come back, the next save commits)."""
    import tierckpt.pipeline._capture as pipeline_mod
    from tierckpt import CheckpointFailed

    real = pipeline_mod.copy_chunk
    calls = {"n": 0}

    def third_fails(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("copy failed (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "copy_chunk", third_fails)
    state = _state(8)
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10, host_buffer_bytes=4 << 20) as ck:
        h = ck.save(state, step=1)
        with pytest.raises(CheckpointFailed, match="injected"):
            h.wait(timeout=60)
        arena = ck._pipeline.arena  # type: ignore[union-attr]
        assert arena.wait_idle(timeout=30)
        ck.save(state, step=2).wait(timeout=60)
        assert ck.steps() == [2]
        assert_same(state, ck.load())
