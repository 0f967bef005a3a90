"""A guarded save whose lazily captured tensors are changed in place before their copy.

Parameters and optimizer state are copied after ``save()`` returns, while the next forward and
backward pass run; ``guard()`` holds the optimizer step until that copy is done. Something
else that writes them in between (an EMA or averaged-weights swap for evaluation right after
the save, ``load_state_dict()``, ``clamp_()``, a second optimizer that was not guarded) made
the checkpoint hold values from after ``save()`` or a mix of both, committed as if whole. The
capture now checks each chunk's tensors' version counters once the chunk is copied: a tensor
changed since ``save()`` fails that save everywhere with :class:`StateChanged` naming it and
``wait_captured()``, and looks at every tensor again once its copies are done (a write still
running while its chunk was copied moves the counter only when it ends), so any change before
the capture ends fails the save.

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
from tierckpt.snapshot import Watched


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


def test_a_change_after_its_copy_but_before_the_capture_ends_fails_the_save_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first layer's chunk is copied, the copy of the rest held, then the first layer is
    changed: its copy holds the old bytes, but a counter cannot tell a change that ended
    after the copy from one that was running during it (the next test), so the save fails;
    after ``wait_captured()`` the same change fails nothing."""
    model, opt = _model()
    gate, copied = _held_copies(monkeypatch, 1)
    # chunks of 256 KiB: each 256 x 256 fp32 weight is a chunk of its own, the first copied
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=256 << 10) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict()}, 1)
        assert copied.wait(30)
        with torch.no_grad():
            model[0].weight.add_(1.0)  # its chunk is in the arena already
        gate.set()
        with pytest.raises(CheckpointFailed) as info:
            h.wait(timeout=30)
        assert isinstance(info.value.errors["local"], StateChanged), info.value.errors
        assert ck.steps() == []
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        h = ck.save({"model": model.state_dict()}, 2)
        h.wait_captured(timeout=30)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        h.wait(timeout=30)
        got = ck.load()["model"]
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_write_still_running_while_its_chunk_was_copied_fails_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An in-place operation moves a tensor's version counter when it ends. One that ran
    while the tensor's chunk was copied (an EMA swap's ``copy_`` right after ``save()``) and
    ended after that chunk was checked passed the check: the checkpoint was committed torn
    (the helper's field test: 8 of 150 unreadable, their checksum taken before the write
    landed, and 1 loading the swapped-in values without an error). Here the write lands
    during the copy and its counter moves after the chunk's check, as such an operation's
    does; the capture's last look sees it and the save fails everywhere."""
    model, opt = _model()
    w = model[0].weight
    real_copy, real_changed = _capture.copy_chunk, Watched.changed
    seen: list[int] = []

    def copy_chunk(*args: Any, **kwargs: Any) -> Any:
        if not seen:
            w.data.fill_(7.0)  # the write lands on the bytes being copied; no counter yet
        return real_copy(*args, **kwargs)

    def changed(self: Watched, *args: Any, **kwargs: Any) -> Any:
        out = real_changed(self, *args, **kwargs)
        if not seen:
            seen.append(1)
            with torch.no_grad():
                w.add_(0.0)  # ... and the operation ends after the chunk was checked
        return out

    monkeypatch.setattr(_capture, "copy_chunk", copy_chunk)
    monkeypatch.setattr(Watched, "changed", changed)
    tiers = [MemoryTier(namespace=f"inflight-{tmp_path.name}"), LocalTier(tmp_path / "nvme")]
    with Checkpointer(tiers, chunk_bytes=256 << 10) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict()}, 1)
        with pytest.raises(CheckpointFailed) as info:  # committed with 7.0s before
            h.wait(timeout=30)
        assert set(info.value.errors) == {"memory", "local"}, info.value.errors
        assert all(isinstance(e, StateChanged) for e in info.value.errors.values())
        assert "['model']['0.weight']" in str(info.value)
        assert ck.steps() == []


def test_parameters_of_an_unguarded_module_in_the_state_are_copied_at_save(
    tmp_path: Path,
) -> None:
    """``ema.state_dict(keep_vars=True)`` puts the EMA's ``nn.Parameter`` objects in the
    state. Every Parameter was taken for a guarded one and captured lazily: an EMA updated
    right after ``save()`` failed every save with StateChanged (or, missed, was committed
    torn). A Parameter of a module that is not guarded is copied at ``save()``, as its
    ``keep_vars=False`` tensors are."""
    model, opt = _model()
    ema = torch.optim.swa_utils.AveragedModel(model)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.guard(opt, model)
        for step in range(1, 4):
            model(torch.randn(4, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
            expected = {k: v.detach().clone() for k, v in ema.state_dict().items()}
            h = ck.save({"model": model.state_dict(), "ema": ema.state_dict(keep_vars=True)}, step)
            ema.update_parameters(model)  # right after save(): the EMA's own habit
            h.wait(timeout=30)
            assert h.eager_bytes >= sum(v.numel() * v.element_size() for v in expected.values())
            got = ck.load(step=step)["ema"]
            assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_load_into_the_tensors_a_save_is_capturing_waits_for_that_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save()`` then at once ``load(step=1, into=...)`` (an in-process rollback) wrote into
    tensors the save had not copied yet: the save failed with StateChanged (or committed the
    loaded values). ``load(into=)`` now waits for this writer's captures first."""
    model, opt = _model()
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.guard(opt, model)
        ck.save({"model": model.state_dict()}, 1).wait(timeout=30)
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        gate, _ = _held_copies(monkeypatch, 0)
        threading.Timer(0.3, gate.set).start()  # the copy is held while load() is called
        h = ck.save({"model": model.state_dict()}, 2)
        ck.load(step=1, into={"model": model})
        h.wait(timeout=30)  # raised StateChanged before
        got = ck.load(step=2)["model"]
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
