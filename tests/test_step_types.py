"""A step may be given as training code holds it: an ``int``, a NumPy integer, or a
one-element integer tensor (as ``range`` and list indexing take them). Floats, bools,
negative numbers and strings are refused before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tierckpt import Checkpointer, LocalTier


@pytest.mark.parametrize(
    "given", [np.int64(3), np.uint16(3), torch.tensor(3), torch.tensor([3], dtype=torch.int32)]
)
def test_integer_scalars_are_steps(tmp_path: Path, given: Any) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        h = ck.save({"w": torch.ones(8)}, given)
        h.wait(timeout=60)
        assert type(h.step) is int and h.step == 3
        assert ck.steps() == [3]
        assert torch.equal(ck.load(step=given)["w"], torch.ones(8))
        ck.pin(given)
        assert [c.step for c in ck.pinned()] == [3]
        ck.unpin(given)
        assert ck.pinned() == []


@pytest.mark.parametrize(
    "bad", [3.0, True, -1, "3", torch.tensor(3.0), torch.tensor([1, 2]), np.float32(3)]
)
def test_other_steps_are_refused_before_writing(tmp_path: Path, bad: Any) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ck.save({"w": torch.ones(8)}, bad)
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ck.load(step=bad)
        assert ck.steps() == []
    assert not any(p.suffix == ".tck" for p in tmp_path.rglob("*"))


def test_a_state_given_where_the_step_goes_is_refused_in_a_few_words(tmp_path: Path) -> None:
    # Orbax's save(step, state) and DCP's load(state) habits: the message names the order, and
    # shows the state in a few words (it used to be the whole state's repr: ~100 KB)
    state = {"model": torch.nn.Linear(256, 256).state_dict()}
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(ValueError, match="takes the state first") as saved:
            ck.save(100, state)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"load\(into=state\)") as loaded:
            ck.load(state)  # type: ignore[arg-type]
        assert ck.steps() == []
    for info in (saved, loaded):
        assert len(str(info.value)) < 400, len(str(info.value))
        assert "got dict {'model'" in str(info.value)


def test_map_location_as_torch_load_takes_it(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.arange(4.0)}, 1).wait()
        # a dict whose values all name one device: that device (torch.load's remap habit)
        got = ck.load(map_location={"cuda:0": "cpu", "cuda:1": "cpu"})["w"]
        assert got.device.type == "cpu" and torch.equal(got, torch.arange(4.0))
        for bad in ({"cuda:0": "cpu", "cuda:1": "meta"}, lambda s, loc: s, 3):
            with pytest.raises(TypeError, match="takes one device for every tensor"):
                ck.load(map_location=bad)  # type: ignore[arg-type]
