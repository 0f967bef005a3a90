"""A quantized tensor is rebuilt only once its integers have arrived.

Rebuilding a quantized tensor (``torch._make_per_tensor_quantized_tensor`` and the per-channel
form) copies the integer representation. The load builds the tensors while the reader threads
still fill their storages, so a tree decoded at that point copied whatever the fresh memory held:
a quantized model's weights came back as garbage whenever the reads were slower than the tree
(seen as a flaky ``test_quantize_dynamic_state_dict_loads_into_a_fresh_model``). Here the reads
are held back on purpose, so the old order fails every time.
"""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.restore import _chunks


@pytest.fixture
def slow_reads(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every chunk read waits 0.3 s before it starts; returns the reads' end times."""
    ends: list[float] = []
    lock = threading.Lock()
    original = _chunks.ChunkReader.read

    def read(self: Any, ci: int) -> int:
        time.sleep(0.3)
        n = original(self, ci)
        with lock:
            ends.append(time.perf_counter())
        return n

    monkeypatch.setattr(_chunks.ChunkReader, "read", read)
    return ends


def _quantized_model(per_channel: bool) -> torch.nn.Module:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    spec: Any = (
        {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
        if per_channel
        else {torch.nn.Linear}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.eval(), spec, dtype=torch.qint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert b.is_quantized and a.qscheme() == b.qscheme()
    assert torch.equal(a.int_repr(), b.int_repr())
    assert torch.equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_quantized_model_loads_bit_exact_when_reads_are_slow(
    tmp_path: Path, slow_reads: list[float], per_channel: bool
) -> None:
    trained = _quantized_model(per_channel)
    state = trained.state_dict()
    x = torch.randn(9, 16)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save({"model": state}, 1).wait(timeout=120)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        back = ck.load(step=1)["model"]
    assert slow_reads, "the reads were not held back: the test checks nothing"
    for key in ("0._packed_params._packed_params", "2._packed_params._packed_params"):
        _same(state[key][0], back[key][0])
        assert torch.equal(state[key][1], back[key][1])
    fresh = _quantized_model(per_channel)
    fresh.load_state_dict(back)
    assert torch.equal(fresh(x), trained(x))


def test_plain_quantized_tensors_load_bit_exact_when_reads_are_slow(
    tmp_path: Path, slow_reads: list[float]
) -> None:
    x = torch.randn(64, 48)
    state = {
        "q8": torch.quantize_per_tensor(x, 0.05, 7, torch.quint8),
        "pc": torch.quantize_per_channel(
            x, torch.rand(64) / 10 + 0.01, torch.randint(-5, 5, (64,)), 0, torch.qint8
        ),
        "plain": x,
    }
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save(state, 1).wait(timeout=120)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        back = ck.load(step=1)
    assert slow_reads
    _same(state["q8"], back["q8"])
    _same(state["pc"], back["pc"])
    assert torch.equal(state["plain"], back["plain"])
