"""A tier's thread outlives anything one save throws at it. A backend whose writer's abort
raised (against :class:`ObjectWriter`'s contract: a third-party backend, a link that died
mid-abort) used to end the tier's thread: every later save on the tier then waited for arena
space until given up, for the rest of the run. And a save whose only tier was given up while
its capture waited for an arena slot failed with ``capture failed: list index out of range``
(the capture went on copying from a state the finished save had let go of)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.base import ObjectWriter
from tierckpt.errors import CheckpointFailed, SaveDeadlineExceeded
from tierckpt.format import shard_name


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((6 << 20,), float(step))}  # 24 MiB: several chunks


class _Broken(ObjectWriter):
    """Every write fails, and so does the abort."""

    def write(self, offset: int, data: Any) -> None:
        raise OSError(5, "Input/output error")

    def commit(self) -> None:
        raise AssertionError("a failed write is never committed")

    def abort(self) -> None:
        raise OSError(101, "Network is unreachable")


class _Hung(ObjectWriter):
    """Writes hang until ``release`` is set, then fail."""

    def __init__(self, name: str, release: threading.Event) -> None:
        super().__init__(name)
        self._release = release

    def write(self, offset: int, data: Any) -> None:
        self._release.wait(60)
        raise OSError(110, "Connection timed out")

    def commit(self) -> None:
        raise AssertionError("never reached")

    def abort(self) -> None:
        pass


def _swap_writer(ck: Checkpointer, file: str, make: Any) -> None:
    backend = ck.backend(ck.tier_names[0])
    real = backend.open_writer

    def open_writer(name: str) -> ObjectWriter:
        return make(name) if name == file else real(name)

    backend.open_writer = open_writer  # type: ignore[method-assign]


def test_an_abort_that_raises_does_not_end_the_tiers_thread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Checkpointer(
        [LocalTier(tmp_path, keep_last=None)],
        host_buffer_bytes=8 << 20,
        chunk_bytes=1 << 20,
        save_deadline=120,
    ) as ck:
        ck.save(_state(1), 1).wait(timeout=60)
        _swap_writer(ck, shard_name(2, 0), _Broken)
        with pytest.raises(CheckpointFailed) as info:
            ck.save(_state(2), 2).wait(timeout=60)
        # the write's own error, not a deadline on a tier whose thread is gone
        assert "Input/output error" in str(info.value)
        t0 = time.monotonic()
        ck.save(_state(3), 3).wait(timeout=60)
        assert time.monotonic() - t0 < 30  # not waiting out save_deadline
        assert ck.steps() == [1, 3]
        assert torch.equal(ck.load()["w"], _state(3)["w"])
    assert "abort of" in caplog.text and "Network is unreachable" in caplog.text


def test_a_hung_only_tier_is_given_up_with_its_own_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with Checkpointer(
        [LocalTier(tmp_path, keep_last=None)],
        host_buffer_bytes=4 << 20,  # the save does not fit: its capture waits for slots
        chunk_bytes=1 << 20,
        save_deadline=2,
    ) as ck:
        ck.save(_state(1), 1).wait(timeout=60)
        for step in (2, 3, 4):  # the give-up races the capture's wait: three tries
            release = threading.Event()
            _swap_writer(ck, shard_name(step, 0), lambda name, r=release: _Hung(name, r))
            try:
                with pytest.raises(CheckpointFailed) as info:
                    ck.save(_state(step), step).wait(timeout=60)
            finally:
                release.set()
            errors = info.value.errors
            assert isinstance(errors["local"], SaveDeadlineExceeded), errors
        # the capture stopped when its last tier was given up; it did not copy on from a
        # state the finished save had let go of
        assert "capture failed" not in caplog.text, caplog.text
        ck.save(_state(5), 5).wait(timeout=60)
        assert ck.steps() == [1, 5]
        assert torch.equal(ck.load()["w"], _state(5)["w"])
