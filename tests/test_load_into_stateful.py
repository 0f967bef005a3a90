"""``load(into=)`` with modules and optimizers: restored, or refused before anything changes.

Found by a field test: ``ck.load(into=model)`` (and ``into=optimizer``) returned the state dict
and left the model and optimizer as they were, without an error — a resume that went on from
random weights. With ``into={"model": m, ...}``, ``strict=False`` was ignored, a mismatch in
another key was found after the model had been overwritten, and a shape mismatch inside the
module came as torch's ``RuntimeError`` after some layers were copied. Now a bare module or
optimizer is loaded through ``load_state_dict()``, everything is checked first (a
``StateMismatch`` naming the key; nothing overwritten), and ``strict`` applies throughout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tierckpt import Checkpointer, LocalTier, StateMismatch


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = _model(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(16, 4)).sum().backward()
    opt.step()
    return m, opt


def test_a_bare_module_and_optimizer_are_restored(tmp_path: Path) -> None:
    m, opt = _trained(0)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(m.state_dict(), 1).wait(timeout=60)
        ck.save(opt.state_dict(), 2).wait(timeout=60)
        fresh = _model(1)
        assert not _same_params(fresh, m)
        assert ck.load(1, into=fresh) is fresh
        assert _same_params(fresh, m)
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.5)
        assert ck.load(2, into=opt2) is opt2
        assert opt2.param_groups[0]["lr"] == 0.1 and opt2.param_groups[0]["momentum"] == 0.9
        bufs = [opt2.state[p]["momentum_buffer"] for p in fresh.parameters()]
        want = [opt.state[p]["momentum_buffer"] for p in m.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(bufs, want, strict=True))


def test_a_bare_module_of_another_shape_is_refused_untouched(tmp_path: Path) -> None:
    m, _ = _trained(0)
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(m.state_dict(), 1).wait(timeout=60)
        with pytest.raises(StateMismatch, match=r"'2.weight'"):
            ck.load(into=other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())


def test_a_mismatch_elsewhere_leaves_the_model_untouched(tmp_path: Path) -> None:
    m, opt = _trained(0)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"model": m, "optim": opt, "arr": np.ones(4), "step": 7}, 7).wait(timeout=60)
        fresh = _model(1)
        before = {k: v.clone() for k, v in fresh.state_dict().items()}
        target = {"model": fresh, "optim": opt, "arr": np.zeros(5), "step": 0}
        with pytest.raises(StateMismatch, match=r"\['arr'\]"):
            ck.load(into=target)
        assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
        # a shape mismatch inside the module: StateMismatch naming the key, nothing copied
        wide = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        before = {k: v.clone() for k, v in wide.state_dict().items()}
        target = {"model": wide, "optim": opt, "arr": np.zeros(4), "step": 0}
        with pytest.raises(StateMismatch, match=r"\['model'\]\['2.weight'\]"):
            ck.load(into=target)
        assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())


def test_strict_false_applies_to_stateful_targets(tmp_path: Path) -> None:
    m, opt = _trained(0)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"model": m, "optim": opt, "arr": np.ones(4), "step": 7}, 7).wait(timeout=60)
        fresh = _model(1)
        with pytest.raises(StateMismatch, match="strict=False"):
            ck.load(into={"model": fresh})
        got = ck.load(into={"model": fresh}, strict=False)
        assert got["model"] is fresh and _same_params(fresh, m)
        # a module with a layer the checkpoint lacks: strict=False loads the rest
        bigger = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2), nn.ReLU())
        bigger.register_buffer("extra", torch.zeros(3))
        ck.load(into={"model": bigger}, strict=False)
        assert torch.equal(bigger[0].weight, m[0].weight)


def test_a_module_or_optimizer_saved_as_the_whole_state(tmp_path: Path) -> None:
    """``save(model, step)`` saves ``model.state_dict()``, as ``load(into=model)`` takes it
    (it raised AttributeError: 'Linear' object has no attribute 'items')."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with Checkpointer([LocalTier(tmp_path / "m", keep_last=None)]) as ck:
        ck.guard(opt, model)
        ck.save(model, 1).wait(timeout=60)
        ck.save(opt, 2).wait(timeout=60)
        plain = ck.load(step=1)
        assert set(plain) == {"weight", "bias"} and torch.equal(plain["weight"], model.weight)
        fresh = torch.nn.Linear(4, 3)
        assert ck.load(step=1, into=fresh) is fresh
        assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        ck.load(step=2, into=fresh_opt)
        assert fresh_opt.param_groups[0]["lr"] == 0.1
        state = fresh_opt.state_dict()["state"][0]
        assert torch.equal(state["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
