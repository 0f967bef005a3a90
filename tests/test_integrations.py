"""Integrations: plain loop, PyTorch Lightning CheckpointIO, Hugging Face TrainerCallback."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import OrderedDict, defaultdict, namedtuple
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.integrations import sanitize_state
from tierckpt.integrations._common import closure_guard_hook

# Lightning's own deprecation noise (torch.utils._pytree) under filterwarnings=error
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- shared helpers ----------------------------------------------------------------------------
def test_sanitize_state() -> None:
    Point = namedtuple("Point", "x y")

    class Color:
        def __repr__(self) -> str:
            return "Color(red)"

    t = torch.ones(2)
    dd: defaultdict[str, int] = defaultdict(int, a=1)
    out = sanitize_state(
        {
            "dd": dd,
            "od": OrderedDict(b=2),
            "p": Point(1, 2),
            "path": Path("/x"),
            "s": {3},
            "t": t,
            "obj": Color(),
            "i": True,
        }
    )
    assert type(out["dd"]) is dict and out["dd"] == {"a": 1}
    assert type(out["od"]) is OrderedDict
    assert type(out["p"]) is tuple and out["p"] == (1, 2)
    assert out["path"] == "/x" and out["s"] == [3] and out["t"] is t
    assert out["obj"] == "Color(red)" and out["i"] is True
    with (
        pytest.raises(tierckpt.UnsupportedObject),
        tierckpt.Checkpointer([tierckpt.MemoryTier(namespace="sanitize")]) as ck,
    ):
        state = sanitize_state({"obj": Color()}, unsupported="error")
        ck.save(state, 1)


def test_closure_guard_hook_waits_after_the_closure() -> None:
    calls: list[str] = []
    hook = closure_guard_hook(lambda: calls.append("wait"))
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.1)
    handle = opt.register_step_pre_hook(hook)

    def closure() -> torch.Tensor:
        calls.append("closure")
        opt.zero_grad()
        loss = (param - 1).pow(2).sum()
        loss.backward()
        return loss

    assert opt.step(closure) is not None  # positional
    opt.step(closure=closure)
    param.grad = torch.ones(1)
    opt.step()  # no closure: waits at once
    handle.remove()
    assert calls == ["closure", "wait", "closure", "wait", "wait"]


# -- plain loop --------------------------------------------------------------------------------
def test_plain_loop_example_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    example = load_example("plain_loop")
    tierckpt.backends.MemoryBackend.clear_namespace("default")
    assert example.main(["--dir", str(tmp_path), "--steps", "40", "--every", "20"]) == 0
    tierckpt.backends.MemoryBackend.clear_namespace("default")  # a new process: RAM is empty
    assert example.main(["--dir", str(tmp_path), "--steps", "60", "--every", "20"]) == 0
    out = capsys.readouterr().out
    assert "resumed at step 40" in out
    assert tierckpt.Checkpointer([tierckpt.LocalTier(tmp_path)]).steps() == [20, 40, 60]


# -- PyTorch Lightning -------------------------------------------------------------------------
def test_lightning_fit_and_resume_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    example = load_example("lightning_fit")
    assert example.main(["--dir", str(tmp_path)]) == 0
    pointer = tmp_path / "run1" / "ckpts" / "epoch=1-step=8.ckpt"
    doc = json.loads(pointer.read_text())
    assert doc["format"] == "tierckpt-lightning-pointer" and doc["step"] == 8
    assert (tmp_path / "run1" / "ckpts" / "last.ckpt").exists()
    steps = tierckpt.Checkpointer([tierckpt.LocalTier(tmp_path / "tier")]).steps()
    assert steps == [4, 8, 12, 16]


def test_lightning_plugin_loads_torch_files_and_stores_hparams(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.fabric.utilities.data import AttributeDict

    from tierckpt.integrations.lightning import TierCkptIO, read_pointer

    io = TierCkptIO([tierckpt.LocalTier(tmp_path / "tier")])
    ckpt = {
        "global_step": 3,
        "epoch": 0,
        "state_dict": {"w": torch.arange(4.0)},
        "hyper_parameters": AttributeDict(lr=0.1, sizes=(1, 2)),
        "callbacks": {},
    }
    io.save_checkpoint(ckpt, str(tmp_path / "c" / "a.ckpt"))
    io.save_checkpoint(ckpt, str(tmp_path / "c" / "last.ckpt"))  # same step: one checkpoint
    loaded = io.load_checkpoint(str(tmp_path / "c" / "last.ckpt"))
    assert torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))
    assert loaded["hyper_parameters"] == {"lr": 0.1, "sizes": (1, 2)}
    assert io.checkpointer.steps() == [3]
    # an ordinary torch.save checkpoint still loads
    torch.save({"global_step": 1, "state_dict": {"w": torch.zeros(2)}}, tmp_path / "old.ckpt")
    assert read_pointer(str(tmp_path / "old.ckpt")) is None
    old = io.load_checkpoint(str(tmp_path / "old.ckpt"), weights_only=True)
    assert old["global_step"] == 1
    io.remove_checkpoint(str(tmp_path / "c" / "a.ckpt"))
    assert not (tmp_path / "c" / "a.ckpt").exists()
    io.close()


# -- Hugging Face ------------------------------------------------------------------------------
def test_hf_trainer_callback_resume_bit_identical(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    example = load_example("hf_trainer")
    assert example.main(["--dir", str(tmp_path)]) == 0
    # the Trainer's own blocking save was replaced: no checkpoint-N folders from it
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path / "out1"))
    folder = tmp_path / "resume" / "checkpoint-4"
    for name in (
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "trainer_state.json",
    ):
        assert (folder / name).exists(), name
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 4
    with tierckpt.Checkpointer([tierckpt.LocalTier(tmp_path / "tier")]) as ck:
        assert ck.steps() == [2, 4, 6]
        state: Any = ck.load(6)
    assert set(state) == {
        "model",
        "optimizer",
        "lr_scheduler",
        "trainer_state",
        "rng",
        "global_step",
    }


def test_hf_rng_states_round_trip() -> None:
    pytest.importorskip("transformers")
    import random

    import numpy as np

    from tierckpt.integrations.hf import rng_states, set_rng_states

    saved = rng_states()
    ck = tierckpt.Checkpointer([tierckpt.MemoryTier(namespace="hf-rng")])
    ck.save(saved, 1).result()
    a = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_states(ck.load(1))
    assert (random.random(), np.random.rand(), torch.rand(1)) == a
    ck.close()


def teardown_module() -> None:
    sys.modules.pop("example_plain_loop", None)
