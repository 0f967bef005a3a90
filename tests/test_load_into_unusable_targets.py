"""``load(into=...)`` into tensors that cannot hold the checkpoint's values is refused before
anything is copied (``StateMismatch``), as the docs promise for every check:

* a target on the meta device: ``copy_`` into it does nothing, so the load returned normally
  with the weights not restored (a model built under ``init_empty_weights``);
* a target whose elements share memory (``expand``): torch's error came from the copy, after
  the targets before it had been overwritten: a half-restored state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.errors import StateMismatch


def _saved(tmp_path: Path) -> Checkpointer:
    ck = Checkpointer([LocalTier(tmp_path / "ck")])
    ck.save({"a": torch.arange(4.0), "b": torch.ones(4), "z": torch.full((4,), 7.0)}, 1).wait()
    return ck


@pytest.mark.parametrize("bad", ["meta", "expanded"])
def test_a_target_that_cannot_hold_the_values_is_refused_before_any_copy(
    tmp_path: Path, bad: str
) -> None:
    z = torch.empty(4, device="meta") if bad == "meta" else torch.zeros(1).expand(4)
    into = {"a": torch.zeros(4), "b": torch.zeros(4), "z": z}
    with _saved(tmp_path) as ck, pytest.raises(StateMismatch, match=r"\['z'\]"):
        ck.load(into=into)
    assert torch.equal(into["a"], torch.zeros(4)) and torch.equal(into["b"], torch.zeros(4))


def test_transposed_and_strided_targets_still_load(tmp_path: Path) -> None:
    into = {
        "a": torch.zeros(2, 2).t().reshape(4) * 0,
        "b": torch.zeros(8)[::2],
        "z": torch.zeros(4),
    }
    with _saved(tmp_path) as ck:
        ck.load(into=into)
    assert torch.equal(into["b"], torch.ones(4)) and torch.equal(into["z"], torch.full((4,), 7.0))
