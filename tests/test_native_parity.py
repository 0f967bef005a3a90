"""The native API against what ``torch.load`` and ``load_state_dict`` users expect (torch's
serialization cases and torchsnapshot's fidelity cases): ``nn.Parameter`` comes back as a
Parameter with its ``requires_grad``; ``load(into=..., strict=False)`` restores the keys both
sides hold; loading into a tensor of another floating-point dtype casts."""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, StateMismatch
from tierckpt.errors import FormatError

FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _round_trip(tmp_path: Path, state: Any, **load: Any) -> Any:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(state, step=1).wait()
    with Checkpointer([LocalTier(tmp_path)]) as ck:  # a fresh reader
        return ck.load(**load)


def _torch_round_trip(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_parameters_come_back_as_parameters_with_requires_grad(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    shared = torch.nn.Parameter(torch.randn(5))
    state = {
        "params": dict(model.named_parameters()),
        "plain": torch.randn(2),
        "buffer": torch.nn.Buffer(torch.ones(3)),
        "twice": [shared, shared],
        "int_param": torch.nn.Parameter(torch.arange(3), requires_grad=False),
    }
    expected = _torch_round_trip(state)
    for load in ({}, {"map_location": "cpu"}):
        got = _round_trip(tmp_path / str(len(load)), state, **load)
        for path, ours, theirs in (
            ("weight", got["params"]["weight"], expected["params"]["weight"]),
            ("bias", got["params"]["bias"], expected["params"]["bias"]),
            ("plain", got["plain"], expected["plain"]),
            ("twice0", got["twice"][0], expected["twice"][0]),
            ("int_param", got["int_param"], expected["int_param"]),
        ):
            assert type(ours) is type(theirs), path
            assert ours.requires_grad == theirs.requires_grad, path
            assert torch.equal(ours.detach(), theirs.detach()), path
    assert type(got["params"]["weight"]) is torch.nn.Parameter
    assert got["params"]["weight"].requires_grad and not got["params"]["bias"].requires_grad
    assert type(got["plain"]) is torch.Tensor and not got["plain"].requires_grad
    # a restored Parameter is a leaf an optimizer can train
    opt = torch.optim.SGD([got["params"]["weight"]], lr=0.1)
    got["params"]["weight"].sum().backward()
    opt.step()


def test_load_into_a_module_keeps_its_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Linear(3, 2)
    target = torch.nn.Linear(3, 2)
    weight = target.weight
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"m": dict(saved.named_parameters())}, step=1).wait()
        ck.load(into={"m": dict(target.named_parameters())})
    assert target.weight is weight and isinstance(target.weight, torch.nn.Parameter)
    assert torch.equal(target.weight, saved.weight) and target.weight.requires_grad


def test_strict_false_restores_the_keys_both_sides_hold(tmp_path: Path) -> None:
    saved = {
        "a": torch.arange(4.0),
        "only_saved": torch.ones(2),
        "nested": {"x": torch.full((3,), 7.0), "gone": 1},
        "step": 12,
    }
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(saved, step=1).wait()
        target = {
            "a": torch.zeros(4),
            "only_target": torch.full((2,), 5.0),
            "nested": {"x": torch.zeros(3), "new": torch.zeros(1)},
            "step": 0,
        }
        # strict=True stays the default and says which keys differ
        with pytest.raises(StateMismatch, match="only_saved"):
            ck.load(into=target)
        assert torch.equal(target["a"], torch.zeros(4))  # nothing copied on refusal
        out = ck.load(into=target, strict=False)
        assert out is target
        assert torch.equal(target["a"], torch.arange(4.0))
        assert torch.equal(target["nested"]["x"], torch.full((3,), 7.0))
        assert target["step"] == 12
        assert torch.equal(target["only_target"], torch.full((2,), 5.0))  # left as it was
        assert torch.equal(target["nested"]["new"], torch.zeros(1))
        assert "only_saved" not in target and "gone" not in target["nested"]
        # shapes must still match, as with load_state_dict(strict=False)
        with pytest.raises(StateMismatch, match=r"\(4,\)"):
            ck.load(into={"a": torch.zeros(5)}, strict=False)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(FLOATS, FLOATS)))
def test_load_into_another_float_dtype_casts(
    tmp_path: Path, src: torch.dtype, dst: torch.dtype
) -> None:
    values = torch.linspace(-3, 3, 37, dtype=torch.float64).to(src)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": values}, step=1).wait()
        target = {"w": torch.zeros(37, dtype=dst)}
        ptr = target["w"].data_ptr()
        ck.load(into=target)
    assert target["w"].dtype == dst and target["w"].data_ptr() == ptr
    assert torch.equal(target["w"], values.to(dst))


@pytest.mark.parametrize(
    ("src", "dst"),
    [(torch.int64, torch.float32), (torch.float32, torch.int32), (torch.bool, torch.uint8)],
)
def test_other_dtype_differences_are_refused(
    tmp_path: Path, src: torch.dtype, dst: torch.dtype
) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.ones(3, dtype=src)}, step=1).wait()
        with pytest.raises(StateMismatch, match="floating-point"):
            ck.load(into={"w": torch.zeros(3, dtype=dst)})


@pytest.mark.parametrize(
    "table", ["x", [6], [-1], [1.0], [0, 2, 4, 0], [3], [0, 1]], ids=lambda t: repr(t)
)
def test_a_malformed_parameter_table_is_refused(table: Any) -> None:
    from tierckpt.restore import as_parameters

    tensors = [torch.zeros(2), torch.arange(2), torch.zeros(1)]
    with pytest.raises(FormatError, match="parameters"):
        as_parameters(tensors, {"parameters": table}, "test")


@pytest.mark.parametrize(
    "index",
    [
        {"requires_grad": "x"},
        {"requires_grad": [3]},
        {"requires_grad": [1]},  # an integer tensor cannot require grad
        {"requires_grad": [0, 0]},
        {"parameters": [1], "requires_grad": [0]},  # tensor 0 twice
    ],
    ids=lambda t: repr(t),
)
def test_a_malformed_requires_grad_table_is_refused(index: Any) -> None:
    from tierckpt.restore import as_parameters

    tensors = [torch.zeros(2), torch.arange(2), torch.zeros(1)]
    with pytest.raises(FormatError, match="requires_grad"):
        as_parameters(tensors, index, "test")


def test_plain_tensors_that_require_grad_come_back_so(tmp_path: Path) -> None:
    """A plain leaf that requires grad (SAC's ``log_alpha``, a learned temperature kept
    outside any module) came back with ``requires_grad=False``, unlike ``torch.load``: an
    optimizer built over the loaded tensor never stepped it (its grad stays None), silently.
    Now it requires grad again, on every load path."""
    from tierckpt import MemoryTier

    log_alpha = torch.zeros(1, requires_grad=True)
    base = torch.randn(3, requires_grad=True)
    state = {
        "log_alpha": log_alpha,
        "computed": base * 2,  # a non-leaf: torch.load gives a leaf that requires grad
        "frozen": torch.ones(2),
        "ints": torch.arange(3),
        "twice": [log_alpha, log_alpha],
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    expected = _torch_round_trip(state)
    assert expected["log_alpha"].requires_grad and expected["computed"].requires_grad
    tiers: list[Any] = [LocalTier(tmp_path / "local"), MemoryTier(namespace="grad-leaves")]
    with Checkpointer(tiers) as ck:
        ck.save(state, step=1).wait()
        for load in ({"tier": "local"}, {"tier": "memory"}, {"map_location": "cpu"}):
            got = ck.load(**load)
            for key in ("log_alpha", "computed", "frozen", "ints", "param"):
                ours, theirs = got[key], expected[key]
                assert type(ours) is type(theirs), (load, key)
                assert ours.requires_grad == theirs.requires_grad, (load, key)
                assert ours.is_leaf, (load, key)
                assert torch.equal(ours.detach(), theirs.detach()), (load, key)
            assert all(t.requires_grad and t.is_leaf for t in got["twice"]), load
            ptrs = {t.data_ptr() for t in (*got["twice"], got["log_alpha"])}
            assert len(ptrs) == 1, load  # one storage, as saved
            # the loaded leaf trains: an optimizer over it steps it
            opt = torch.optim.SGD([got["log_alpha"]], lr=1.0)
            (got["log_alpha"] * 3).sum().backward()
            opt.step()
            assert torch.equal(got["log_alpha"].detach(), torch.tensor([-3.0])), load
