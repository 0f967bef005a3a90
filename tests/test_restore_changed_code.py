"""``load(into=)`` after the training code changed between the save and the restart.

Found by a field test of users' habits:
- ``into={"model": m, "optimizer": o}`` where the optimizer was built otherwise than the one
  saved (another number of parameter groups, a layer frozen, SGD's state into AdamW): the
  model was overwritten, then the optimizer's ``load_state_dict()`` raised torch's error, so a
  resume that caught it trained from the checkpoint's weights and a fresh (or half-loaded)
  optimizer. Now the optimizer goes first, whatever it refuses puts every part back, and the
  error is a ``StateMismatch`` naming the part.
- The hint "strict=False restores the keys both hold" was given where no key was shared
  (``into=model`` for a checkpoint of ``{model, optimizer, step}``, a ``torch.compile``d
  model's ``_orig_mod.`` keys), and ``strict=False`` then restored nothing without an error.
- ``into={"optimizer": fresh_opt.state_dict()}`` with ``strict=False`` restored none of the
  optimizer's state, silently.
- A module's keys skipped by ``strict=False`` were not logged.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tierckpt import Checkpointer, LocalTier, StateMismatch


class _Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(20, 8)
        self.l1 = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.l1(self.emb(x)))


class _Wrapped(nn.Module):
    """What ``torch.compile`` gives: the model under ``_orig_mod``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def _train(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.arange(10) % 20).sum().backward()
    opt.step()
    opt.zero_grad()


def _snap(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(m: nn.Module, snap: dict[str, torch.Tensor]) -> bool:
    now = m.state_dict()
    return now.keys() == snap.keys() and all(torch.equal(now[k], snap[k]) for k in snap)


def _saved(tmp_path: Path, opt_kind: str = "adamw") -> Path:
    m = _Net(0)
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(m.parameters(), lr=0.01)
        if opt_kind == "adamw"
        else torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    )
    _train(m, opt)
    with Checkpointer([LocalTier(tmp_path / "ck")]) as ck:
        ck.save({"model": m, "optimizer": opt, "step": 1}, step=1).wait()
    return tmp_path / "ck"


@pytest.mark.parametrize("change", ["two-groups", "frozen-layer", "sgd-into-adamw"])
def test_an_optimizer_built_otherwise_refuses_and_nothing_changes(
    tmp_path: Path, change: str
) -> None:
    folder = _saved(tmp_path, "sgd" if change == "sgd-into-adamw" else "adamw")
    m = _Net(1)
    if change == "two-groups":
        opt = torch.optim.AdamW(
            [{"params": m.emb.parameters()}, {"params": [*m.l1.parameters(), *m.head.parameters()]}]
        )
    elif change == "frozen-layer":
        m.emb.weight.requires_grad_(False)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad])
    else:
        opt = torch.optim.AdamW(m.parameters())
    _train(m, opt)  # the optimizer holds state of its own
    model_before = _snap(m)
    opt_before = {
        i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()
    }
    groups_before = [{k: v for k, v in g.items()} for g in opt.state_dict()["param_groups"]]
    refused = r"\['optimizer'\].*AdamW.load_state_dict"
    with Checkpointer([LocalTier(folder)]) as ck, pytest.raises(StateMismatch, match=refused):
        ck.load(into={"model": m, "optimizer": opt, "step": 0})
    assert _same(m, model_before)  # before: the checkpoint's weights
    sd = opt.state_dict()
    assert sd["param_groups"] == groups_before
    assert sd["state"].keys() == opt_before.keys()
    for i, s in opt_before.items():
        assert all(torch.equal(sd["state"][i][k], v) for k, v in s.items()), i
    _train(m, opt)  # the optimizer still works


def test_a_part_refused_after_the_optimizer_took_its_own_puts_the_optimizer_back(
    tmp_path: Path,
) -> None:
    class Refuses:
        def state_dict(self) -> dict[str, Any]:
            return {"x": 1}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            raise RuntimeError("this version cannot read it")

    m = _Net(0)
    opt = torch.optim.AdamW(m.parameters())
    _train(m, opt)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"model": m, "optimizer": opt, "extra": Refuses()}, step=1).wait()
        m2 = _Net(1)
        opt2 = torch.optim.AdamW(m2.parameters())
        model_before = _snap(m2)
        with pytest.raises(StateMismatch, match=r"\['extra'\].*this version cannot read it"):
            ck.load(into={"model": m2, "optimizer": opt2, "extra": Refuses()})
    assert _same(m2, model_before)
    assert opt2.state_dict()["state"] == {}  # the checkpoint's state was taken, then put back


def test_into_a_model_for_a_checkpoint_of_model_and_optimizer_says_so(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    m = _Net(1)
    before = _snap(m)
    with Checkpointer([LocalTier(folder)]) as ck:
        for strict in (True, False):  # strict=False restored nothing, without a word
            with pytest.raises(StateMismatch, match="no key in common") as err:
                ck.load(into=m, strict=strict)
            assert "restores the keys both hold" not in str(err.value)
    assert _same(m, before)


@pytest.mark.parametrize("side", ["saved-compiled", "loading-compiled"])
def test_a_compiled_model_s_prefix_is_named(tmp_path: Path, side: str) -> None:
    m = _Net(0)
    saved: nn.Module = _Wrapped(m) if side == "saved-compiled" else m
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"model": saved.state_dict()}, step=1).wait()
        target = _Net(1)
        into: nn.Module = target if side == "saved-compiled" else _Wrapped(target)
        for strict in (True, False):
            with pytest.raises(StateMismatch, match="prefix '_orig_mod.'"):
                ck.load(into={"model": into}, strict=strict)
        with pytest.raises(StateMismatch, match="prefix '_orig_mod.'"):
            ck.load(into={"model": into.state_dict()})


def test_a_fresh_optimizer_s_state_dict_as_target_is_refused(tmp_path: Path) -> None:
    folder = _saved(tmp_path)
    m = _Net(1)
    opt = torch.optim.AdamW(m.parameters())
    with Checkpointer([LocalTier(folder)]) as ck:
        for strict in (True, False):
            with pytest.raises(StateMismatch, match="pass the optimizer itself"):
                ck.load(
                    into={"model": m.state_dict(), "optimizer": opt.state_dict(), "step": 0},
                    strict=strict,
                )
        # the optimizer itself takes it
        ck.load(into={"model": m, "optimizer": opt, "step": 0})
    assert len(opt.state_dict()["state"]) == 3 * 2 - 1  # emb, l1 (w, b), head (w, b)


def test_keys_a_module_leaves_with_strict_false_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _saved(tmp_path)
    m = _Net(1)
    m.proj = m.l1  # a renamed layer: the checkpoint's l1 is not in it under that name
    del m.l1
    with Checkpointer([LocalTier(folder)]) as ck, caplog.at_level(logging.INFO, "tierckpt"):
        ck.load(into={"model": m, "step": 0}, strict=False)
    said = " ".join(r.getMessage() for r in caplog.records if "not restored" in r.getMessage())
    assert "proj.weight" in said and "l1.weight" in said and "'optimizer'" in said, said
