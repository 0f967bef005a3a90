"""A checkpoint is the state at ``save()``, also for what forward writes.

Module buffers (BatchNorm running stats and ``num_batches_tracked``, EMA buffers) and loose
tensors are copied at ``save()``; parameters — trained or frozen — and optimizer state are
captured lazily behind the guard. To make the race certain rather than likely, the tier's
writes are held by a gate that only the next forward pass opens: the capture, stuck behind a
small arena, cannot reach the buffers (laid out after ~256 MiB of parameters) before the
forward pass has written them.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, MemoryTier
from tierckpt.backends.local import LocalBackend
from tierckpt.policy import LocalTier as _LocalTier

MIB = 1 << 20
#: a small arena: the capture stalls after 4 chunks of 4 MiB while the tier is held
ARENA = dict(host_buffer_bytes=16 * MIB, chunk_bytes=4 * MIB)


class _Gate:
    """Holds every shard write of a tier until ``open()``; a test fails rather than hangs."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.event.set()

    def close(self) -> None:
        self.event.clear()

    def open(self, *_: Any) -> None:
        self.event.set()

    def wait(self) -> None:
        assert self.event.wait(120), "the gate was never opened"


class _GatedBackend(LocalBackend):
    gate: _Gate

    def open_writer(self, name: str):  # type: ignore[no-untyped-def]
        w = super().open_writer(name)
        orig = w.write
        gate = self.gate

        def write(offset: int, data: object) -> None:
            gate.wait()
            orig(offset, data)  # type: ignore[arg-type]

        w.write = write  # type: ignore[method-assign]
        return w


class _GatedTier(_LocalTier):
    def make_backend(self):  # type: ignore[no-untyped-def]
        b = _GatedBackend(self.path)
        b.gate = _GATES[self.path]
        return b


_GATES: dict[str, _Gate] = {}


def _gated(path: Path) -> tuple[_GatedTier, _Gate]:
    tier = _GatedTier(path)
    gate = _Gate()
    _GATES[tier.path] = gate
    return tier, gate


def _clone(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _assert_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert list(expected) == list(got)
    for k, v in expected.items():
        assert torch.equal(v, got[k]), (
            f"{k}: saved {got[k].flatten()[:4]}, at save() {v.flatten()[:4]}"
        )


# -- BatchNorm in a real training loop ------------------------------------------------------------
class _BigThenBN(torch.nn.Module):
    """256 MiB of parameters, then a BatchNorm: its stats come last in ``state_dict()``."""

    def __init__(self, width: int = 8192) -> None:
        super().__init__()
        self.big = torch.nn.Linear(width, width, bias=False)  # 256 MiB of float32
        self.bn = torch.nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.big(x))


def test_batchnorm_after_256mib_saves_the_stats_of_save_time(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _BigThenBN()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tier, gate = _gated(tmp_path)
    # the next forward pass opens the gate once BatchNorm has written its stats
    model.bn.register_forward_hook(gate.open)
    expected: dict[str, torch.Tensor] = {}
    with Checkpointer([tier], **ARENA) as ck:
        ck.guard(opt, model)
        for step in range(1, 4):
            x = torch.randn(8, 8192)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()  # the guard waits here for an unfinished capture
            if step == 2:
                expected = _clone(model.state_dict())
                gate.close()
                h = ck.save({"model": model.state_dict(), "step": step}, step)
                assert not h.captured  # held by the gate: the next forward runs first
        assert model.bn.num_batches_tracked.item() == 3
        h.wait()
        loaded = ck.load(2)
    _assert_equal(expected, loaded["model"])
    assert loaded["model"]["bn.num_batches_tracked"].item() == 2
    # only the buffers were copied at save(): 2 x 8192 floats and one int64 counter
    assert h.eager_bytes == 2 * 8192 * 4 + 8


# -- a buffer written in forward (EMA), a loose tensor ------------------------------------------
class _EMA(torch.nn.Module):
    def __init__(self, width: int = 4096) -> None:
        super().__init__()
        self.big = torch.nn.Linear(width, width // 4, bias=False)  # 16 MiB
        self.register_buffer("ema", torch.zeros(width // 4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.big(x)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(y.mean(0), alpha=0.1)
            self.calls += 1
        return y


def test_a_buffer_updated_in_forward_and_a_loose_tensor(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = _EMA()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    running = torch.zeros(3)  # a loose tensor: neither a parameter nor optimizer state
    tier, gate = _gated(tmp_path)
    model.register_forward_hook(gate.open)
    with Checkpointer([tier], **ARENA) as ck:
        ck.guard(opt, model)
        for step in range(1, 4):
            loss = model(torch.randn(4, 4096)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            running += loss.detach()
            if step == 2:
                want_model = _clone(model.state_dict())
                want_running = running.clone()
                gate.close()
                h = ck.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "running": running,
                        "running_tail": running[1:],  # a view of the same storage
                    },
                    step,
                )
                running.add_(100.0)  # the loop changes it at will, before any capture
        h.wait()
        loaded = ck.load(2)
    _assert_equal(want_model, loaded["model"])
    assert torch.equal(loaded["running"], want_running)
    assert torch.equal(loaded["running_tail"], want_running[1:])
    # views stay views of one storage after loading
    tail = loaded["running_tail"]
    assert tail.untyped_storage().data_ptr() == loaded["running"].untyped_storage().data_ptr()
    assert loaded["model"]["calls"].item() == 2
    # the 16 MiB weight and the AdamW moments (3 x 16 MiB) stayed lazy
    assert h.eager_bytes == 1024 * 4 + 8 + 3 * 4
    # the optimizer state was captured after the step of step 2, before that of step 3
    assert torch.equal(loaded["optimizer"]["state"][0]["step"], torch.tensor(2.0))


# -- a frozen large base (LoRA) stays lazy -----------------------------------------------------
class _LoRA(torch.nn.Module):
    def __init__(self, width: int = 8192, rank: int = 8) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width, bias=False)  # 256 MiB, frozen
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, width) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_loop(ck: Checkpointer, model: _LoRA, opt: torch.optim.Optimizer, steps: int = 2) -> Any:
    h = None
    for step in range(1, steps + 1):
        loss = model(torch.randn(2, model.base.in_features)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        h = ck.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, step)
    assert h is not None
    return h


def test_frozen_base_is_never_copied_eagerly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(2)
    model = _LoRA()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-3)
    with (
        caplog.at_level(logging.WARNING, "tierckpt"),
        Checkpointer([LocalTier(tmp_path)], **ARENA) as ck,
    ):
        ck.guard(opt, model)
        h = _lora_loop(ck, model, opt)
        assert h.eager_bytes == 0  # no buffers; the 256 MiB base is captured lazily
        h.wait()
        loaded = ck.load()
    assert torch.equal(loaded["model"]["base.weight"], model.base.weight)
    assert torch.equal(loaded["model"]["b"], model.b.detach())
    assert not [r for r in caplog.records if r.name == "tierckpt"], caplog.text


def test_frozen_base_with_guard_of_the_optimizer_only_is_copied_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(3)
    model = _LoRA(width=5120)  # a 100 MiB base
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-3)
    with (
        caplog.at_level(logging.WARNING, "tierckpt"),
        Checkpointer([MemoryTier(namespace="eager-optonly")], **ARENA) as ck,
    ):
        ck.guard(opt)
        h = _lora_loop(ck, model, opt, steps=3)
        # what the checkpointer cannot tell from a buffer is copied: correct, and said
        assert h.eager_bytes == 5120 * 5120 * 4
        h.wait()
        assert torch.equal(ck.load()["model"]["base.weight"], model.base.weight)
    warned = [r.getMessage() for r in caplog.records if r.name == "tierckpt"]
    assert len(warned) == 1, warned  # once, not at every save
    assert "frozen parameters are being copied eagerly" in warned[0]
    assert "guard(optimizer, model)" in warned[0]


# -- what the guard says when it cannot tell --------------------------------------------------
def _bn_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return model, opt


def _messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tierckpt"]


def test_no_guard_stays_lazy_and_says_what_to_pass(caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _bn_model()
    with (
        caplog.at_level(logging.WARNING, "tierckpt"),
        Checkpointer([MemoryTier(namespace="eager-noguard")]) as ck,
    ):
        for step in (1, 2):
            h = ck.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
            assert h.eager_bytes == 0
        ck.wait()
    (msg,) = _messages(caplog)
    assert "without guard()" in msg and "ck.guard(optimizer, model)" in msg
    assert "BatchNorm" in msg


def test_no_guard_warning_only_for_a_modules_state(caplog: pytest.LogCaptureFixture) -> None:
    """A plain dict of tensors (no module, so no buffers a forward pass writes) was told to
    call guard() for its "BatchNorm statistics"; a module's state_dict(), nested or given as
    the module, still is."""
    model, _opt = _bn_model()
    with caplog.at_level(logging.WARNING, "tierckpt"):
        with Checkpointer([MemoryTier(namespace="eager-plain")]) as ck:
            ck.save({"w": torch.ones(64), "runs": [{"b": torch.zeros(8)}]}, 1).wait()
        assert _messages(caplog) == []
        for i, state in enumerate(({"nets": [{"g": model.state_dict()}]}, model)):
            with Checkpointer([MemoryTier(namespace=f"eager-nested-{i}")]) as ck:
                ck.save(state, 1).wait()
            (msg,) = _messages(caplog)
            assert "without guard()" in msg
            caplog.clear()


def test_guard_of_the_optimizer_only_copies_buffers_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _bn_model()
    with (
        caplog.at_level(logging.WARNING, "tierckpt"),
        Checkpointer([MemoryTier(namespace="eager-opt")]) as ck,
    ):
        ck.guard(opt)
        for step in (1, 2):
            h = ck.save({"model": model.state_dict(), "opt": opt.state_dict()}, step)
            assert h.eager_bytes == 2 * 8 * 4 + 8  # the BatchNorm buffers, still copied
        ck.wait()
    (msg,) = _messages(caplog)
    assert "without the model" in msg and "ck.guard(optimizer, model)" in msg


def test_guard_with_the_model_is_silent_and_another_big_module_is_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, opt = _bn_model()
    other = torch.nn.Linear(4096, 4096 + 1024)  # 80 MiB of weights no guard names
    with (
        caplog.at_level(logging.WARNING, "tierckpt"),
        Checkpointer([MemoryTier(namespace="eager-model")]) as ck,
    ):
        ck.guard(opt, [model])
        ck.save({"model": model.state_dict(), "opt": opt.state_dict()}, 1).wait()
        assert _messages(caplog) == []
        h = ck.save({"model": model.state_dict(), "other": other.state_dict()}, 2)
        assert h.eager_bytes > 64 * MIB
        ck.wait()
        (msg,) = _messages(caplog)
        assert "ck.guard(optimizer, [model, other])" in msg
        # named too: lazy again
        ck.guard(opt, [model, other])
        h = ck.save({"model": model.state_dict(), "other": other.state_dict()}, 3)
        assert h.eager_bytes == 2 * 8 * 4 + 8
        ck.wait()


def test_guard_refuses_what_is_not_a_module() -> None:
    model, opt = _bn_model()
    with Checkpointer([MemoryTier(namespace="eager-bad")]) as ck:
        with pytest.raises(TypeError, match="not its parameters"):
            ck.guard(opt, model.parameters())  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="torch.nn.Module"):
            ck.guard(opt, "model")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="Optimizer"):
            ck.guard(model)  # type: ignore[arg-type]


# -- the integrations learn the module ---------------------------------------------------------
def test_lightning_hook_learns_the_optimizer_and_the_module(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning steps with ``optimizer.step(closure=partial(_wrap_closure, module, ...))``."""
    pytest.importorskip("lightning")
    from tierckpt.integrations.lightning import TierCkptIO

    torch.manual_seed(4)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    model[0].requires_grad_(False)  # a frozen part: not in the optimizer
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)

    def wrap_closure(module: torch.nn.Module, optimizer: Any, closure: Any) -> Any:
        return closure()

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        return loss

    with caplog.at_level(logging.WARNING, "tierckpt"):
        io = TierCkptIO([MemoryTier(namespace="eager-lightning")])
        try:
            opt.step(closure=functools.partial(wrap_closure, model, opt, closure))
            ckpt = {
                "global_step": 1,
                "state_dict": model.state_dict(),
                "optimizer_states": [opt.state_dict()],
            }
            io.save_checkpoint(ckpt, str(tmp_path / "a.ckpt"))
            h = io.checkpointer._last
            assert h is not None and h.eager_bytes == 2 * 8 * 4 + 8  # buffers only
            h.wait()
        finally:
            io.close()
    assert _messages(caplog) == []


def test_hf_callback_guards_with_the_model() -> None:
    pytest.importorskip("transformers")
    from tierckpt.integrations.hf import TierCkptCallback

    model, opt = _bn_model()
    model[0].requires_grad_(False)
    cb = TierCkptCallback([MemoryTier(namespace="eager-hf")])
    try:
        cb.on_train_begin(None, None, None, model=model, optimizer=opt)  # type: ignore[arg-type]
        h = cb.checkpointer.save({"model": model.state_dict(), "opt": opt.state_dict()}, 1)
        assert h.eager_bytes == 2 * 8 * 4 + 8  # the frozen Linear stays lazy
        h.wait()
    finally:
        cb.close()


# -- CUDA: the copy is queued on the current stream, in order ---------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_buffers_are_copied_in_stream_order() -> None:
    """A buffer write still queued at save() is in the checkpoint; the next forward's is not."""
    torch.manual_seed(5)
    model = _BigThenBN(width=4096).cuda()  # 64 MiB, then BatchNorm
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4096, device="cuda")
    with Checkpointer([MemoryTier(namespace="eager-cuda")], **ARENA) as ck:
        ck.guard(opt, model)
        model(x).pow(2).mean().backward()
        opt.step()
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            a = a @ a / 64.0  # keep the GPU busy: the write below is still queued at save()
        model.bn.running_mean.fill_(3.0)
        expected = _clone(model.state_dict())  # queued in the same order as save()'s copies
        h = ck.save({"model": model.state_dict()}, 1)
        model(x).pow(2).mean().backward()  # the next forward writes the stats again
        opt.step()
        h.wait()
        loaded = ck.load(map_location="cpu")
    _assert_equal({k: v.cpu() for k, v in expected.items()}, loaded["model"])
    assert loaded["model"]["bn.num_batches_tracked"].item() == 1
    assert h.eager_bytes == 2 * 4096 * 4 + 8
