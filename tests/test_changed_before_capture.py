"""A guarded save whose lazily captured tensors are changed in place before their copy.

Parameters and optimizer state are copied after ``save()`` returns, while the next forward and
backward pass run; ``guard()`` holds the optimizer step until that copy is done. Something
else that writes them in between (an EMA or averaged-weights swap for evaluation right after
the save, ``load_state_dict()``, ``clamp_()``, a second optimizer that was not guarded) made
the checkpoint hold values from after ``save()`` or a mix of both, committed as if whole. The
capture now checks each chunk's tensors' version counters once the chunk is copied: a tensor
changed since ``save()`` fails that save everywhere with :class:`StateChanged` naming it and
``wait_captured()``; a change made after a tensor's copy is harmless and fails nothing.

The copy is held at a gate here so that the change lands before or after it, as chosen.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, MemoryTier
from tierckpt.errors import CheckpointFailed, StateChanged
from tierckpt.pipeline import _capture


def _held_copies(
    monkeypatch: pytest.MonkeyPatch, hold_from: int
) -> tuple[threading.Event, threading.Event]:
    """Hold every chunk copy from the ``hold_from``-th one (0-based) until the first event is
    set; the second is set once the copies before it are done."""
    gate, before = threading.Event(), threading.Event()
    real = _capture.copy_chunk
    calls = [0]

    def copy_chunk(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > hold_from:
            before.set()
            assert gate.wait(30), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(_capture, "copy_chunk", copy_chunk)
    return gate, before


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def test_a_parameter_changed_before_its_copy_fails_the_save_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model()
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    gate, _ = _held_copies(monkeypatch, 0)
    tiers = [MemoryTier(namespace=f"changed-{tmp_path.name}"), LocalTier(tmp_path / "nvme")]
    with Checkpointer(tiers) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 1)
        with torch.no_grad():  # evaluation with other weights, swapped in before the copy
            model[1].weight.mul_(0.5)
        gate.set()
        with pytest.raises(CheckpointFailed) as info:
            h.wait(timeout=30)
        assert set(info.value.errors) == {"memory", "local"}, info.value.errors
        for error in info.value.errors.values():
            assert isinstance(error, StateChanged), error
        text = str(info.value)
        assert "['model']['1.weight']" in text and "wait_captured()" in text, text
        assert "['model']['0.weight']" not in text, text  # unchanged tensors are not named
        assert ck.steps() == []  # nothing committed on any tier

        # done right: wait_captured() before the change; the state of save() is committed
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        h = ck.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 2)
        h.wait_captured(timeout=30)
        with torch.no_grad():
            model[1].weight.mul_(0.5)
        h.wait(timeout=30)
        got = ck.load()["model"]
        assert all(torch.equal(got[k], v) for k, v in expected.items())
        # and the next save, with nothing changed, commits as ever
        ck.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, 3).wait(timeout=30)
        assert ck.steps() == [2, 3]


def test_a_change_after_a_tensor_s_copy_fails_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first layer's chunk is copied, the copy of the rest held: the first layer changed
    now changes nothing already copied, and the save commits the state of save()."""
    model, opt = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    gate, copied = _held_copies(monkeypatch, 1)
    # chunks of 256 KiB: each 256 x 256 fp32 weight is a chunk of its own, the first copied
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=256 << 10) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict()}, 1)
        assert copied.wait(30)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # its chunk is in the arena already
        gate.set()
        h.wait(timeout=30)
        got = ck.load()["model"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_without_guard_nothing_is_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without guard() the whole state is lazy and a forward pass writes its buffers: that
    is warned about at save() and left as it was (the save commits)."""
    model, _opt = _model()
    gate, _ = _held_copies(monkeypatch, 0)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        h = ck.save({"model": model.state_dict()}, 1)
        with torch.no_grad():
            model[1].weight.mul_(0.5)
        gate.set()
        h.wait(timeout=30)
        assert ck.steps() == [1]
