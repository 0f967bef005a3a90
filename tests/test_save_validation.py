"""Anything save() accepts loads back exactly; anything it cannot store is refused at save().

Each case either round-trips through a real local tier (saved, committed, loaded in a fresh
Checkpointer, compared value and type exact), or is refused by ``save()`` itself with an
``UnsupportedObject`` that names the key path, with nothing written to the tier. The limits
are the reader's own (``tierckpt.limits``): a state at a limit loads back, one past it is
refused at save time, never committed and then unreadable.
"""

from __future__ import annotations

import datetime
import json
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier, UnsupportedObject
from tierckpt.backends.local import LocalBackend
from tierckpt.offline import list_checkpoints
from tierckpt.tree import DTYPES

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "ckpt"


def refused(root: Path, state: Any, *, names: str, metadata: Any = None) -> str:
    """Save ``state`` as step 1 after a good step 0: it must raise UnsupportedObject naming
    ``names`` (the key path) and write nothing; returns the message."""
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        ck.save({"ok": torch.ones(3)}, 0).wait(timeout=60)
        before = _files(root)
        with pytest.raises(UnsupportedObject) as info:
            ck.save(state, 1, metadata=metadata)
        ck.wait(timeout=60)
        assert _files(root) == before, "a refused save wrote to the tier"
        assert ck.steps() == [0]
    msg = str(info.value)
    assert names in msg, msg
    return msg


def round_trip(root: Path, state: Any, *, metadata: Any = None) -> Any:
    """Save, commit, and load ``state`` in a fresh Checkpointer; returns what loaded."""
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        ck.save(state, 1, metadata=metadata).wait(timeout=120)
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        return ck.load(step=1)


# -- the object tree's limits -----------------------------------------------------------------


def test_list_of_10_000_001_ints_is_refused_at_save(root: Path) -> None:
    # 10,000,002 values with the list itself: one more than a reader decodes
    refused(root, {"history": [0] * 10_000_001}, names="['history']")


def test_node_limit_is_the_readers_own(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At the limit it loads back; one value more is refused at save (the reader's limit,
    lowered here so the test stays small)."""
    import tierckpt.limits

    monkeypatch.setattr(tierckpt.limits, "MAX_NODES", 1000)
    # dict 1 + key 1 + list 1 + 997 ints = 1000 values
    state = {"xs": list(range(997))}
    assert_same(state, round_trip(root, state))
    refused(root / "more", {"xs": list(range(998))}, names="['xs']")


def test_depth_limit_is_the_readers_own(root: Path) -> None:
    ok: Any = 1
    for _ in range(200):
        ok = [ok]
    assert_same(ok, round_trip(root, ok))
    refused(root / "deeper", {"a": ok}, names="['a'][0]")


def test_ints_of_up_to_4300_digits_round_trip_longer_are_refused(root: Path) -> None:
    state = {"big": 10**4300 - 1, "neg": -(10**4300 - 1), "mid": 2**100}
    assert_same(state, round_trip(root, state))
    refused(root / "more", {"big": [1, 10**4300]}, names="['big'][1]")
    msg = refused(root / "huge", {"huge": 10**100_000}, names="['huge']")
    assert "digits" in msg


def test_negative_torch_size_is_refused(root: Path) -> None:
    refused(root, {"shape": torch.Size([2, -1])}, names="['shape']")


def test_index_a_reader_would_refuse_is_refused_at_save(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes that would make the index larger than a reader accepts (1 GiB; 8 MiB here)."""
    import tierckpt.limits

    monkeypatch.setattr(tierckpt.limits, "MAX_INDEX_BYTES", 8 << 20)
    small = {"blob": bytes(range(256)) * (16 << 10)}  # 4 MiB: 5.3 MiB of base64
    assert_same(small, round_trip(root, small))
    refused(root / "big", {"blob": b"\x01" * (6 << 20)}, names="index")


# -- tensors ----------------------------------------------------------------------------------


def test_nested_tensor_is_refused_at_save(root: Path) -> None:
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    msg = refused(root, {"batch": {"nt": nt}}, names="['batch']['nt']")
    assert "nested" in msg


def test_jagged_nested_tensor_is_refused_at_save(root: Path) -> None:
    njt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    refused(root, {"njt": njt}, names="['njt']")


def test_tensor_whose_storage_was_freed_is_refused_at_save(root: Path) -> None:
    """An FSDP-style freed storage: the tensor's bytes are not there to be read."""
    t = torch.ones(1000)
    t.untyped_storage().resize_(0)
    msg = refused(root, {"flat_param": t}, names="['flat_param']")
    assert "storage" in msg


def _same_quantized(a: torch.Tensor, b: torch.Tensor) -> None:
    assert b.is_quantized and a.dtype == b.dtype and a.shape == b.shape
    assert a.qscheme() == b.qscheme()
    assert torch.equal(a.int_repr(), b.int_repr())
    if a.qscheme() == torch.per_tensor_affine:
        assert a.q_scale() == b.q_scale() and a.q_zero_point() == b.q_zero_point()
    else:
        assert torch.equal(a.q_per_channel_scales(), b.q_per_channel_scales())
        assert torch.equal(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())
        assert a.q_per_channel_axis() == b.q_per_channel_axis()
    assert torch.equal(a.dequantize(), b.dequantize())


def test_quantized_tensors_round_trip_with_their_parameters(root: Path) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=g)
    state = {
        "q8": torch.quantize_per_tensor(x, 0.05, 7, torch.quint8),
        "qi8_t": torch.quantize_per_tensor(x, 0.02, -3, torch.qint8).t(),  # a strided view
        "q32": torch.quantize_per_tensor(x, 1e-4, 0, torch.qint32),
        "pc": torch.quantize_per_channel(
            x,
            torch.rand(6, dtype=torch.float64, generator=g) + 0.01,
            torch.randint(0, 20, (6,), generator=g),
            0,
            torch.quint8,
        ),
        "pc_axis1": torch.quantize_per_channel(
            x,
            torch.rand(5, dtype=torch.float64, generator=g) + 0.01,
            torch.zeros(5, dtype=torch.int64),
            1,
            torch.qint8,
        ),
        "float_qparams": torch.quantize_per_channel(
            x, torch.rand(6, generator=g) + 0.01, torch.randn(6, generator=g), 0, torch.quint8
        ),
        "plain": x,
    }
    back = round_trip(root, state)
    assert list(back) == list(state)
    for k, v in state.items():
        if v.is_quantized:
            _same_quantized(v, back[k])
        else:
            assert_same(v, back[k])


def test_sub_byte_quantized_tensor_is_refused_at_save(root: Path) -> None:
    q4 = torch.quantize_per_tensor(torch.randn(8), 0.1, 0, torch.quint4x2)
    refused(root, {"emb": [q4]}, names="['emb'][0]")


def _quantized_model(per_channel: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if per_channel:
            spec: Any = {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
            return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, torch.qint8)


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_tensor", "per_channel"])
def test_quantize_dynamic_state_dict_loads_into_a_fresh_model(
    root: Path, per_channel: bool
) -> None:
    """The state_dict of a quantize_dynamic model loads into a freshly built quantized model
    (other weights), which then gives the same outputs, bit for bit."""
    trained = _quantized_model(per_channel, seed=1)
    back = round_trip(root, {"model": trained.state_dict()})["model"]
    fresh = _quantized_model(per_channel, seed=2)
    x = torch.randn(9, 16)
    assert not torch.equal(fresh(x), trained(x))
    fresh.load_state_dict(back)
    assert torch.equal(fresh(x), trained(x))


def test_state_dict_metadata_comes_back(root: Path) -> None:
    """state_dict()'s ``_metadata`` (module versions, which quantized modules' loading needs)
    is kept; an OrderedDict with other attributes is refused, not silently stripped."""
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    back = round_trip(root, {"m": sd, "again": [sd]})
    assert_same({"m": sd, "again": [sd]}, back)
    assert back["m"]._metadata == sd._metadata
    assert back["again"][0]._metadata == sd._metadata
    odd = OrderedDict(a=1)
    odd.note = "x"  # type: ignore[attr-defined]
    refused(root / "odd", {"odd": odd}, names="['odd']")


def test_every_dtype_round_trips_or_is_refused(root: Path) -> None:
    """Each dtype this torch knows: a tensor of it loads back bit-exact (quantized ones with
    their parameters), or save() refuses it naming its key."""
    refused_names = []
    for i, (name, dtype) in enumerate(sorted(DTYPES.items())):
        try:
            t = torch.zeros(6, dtype=dtype)
        except (RuntimeError, TypeError):
            continue  # not constructible here: not in anyone's state
        where = root / name
        try:
            with Checkpointer([LocalTier(where)]) as ck:
                ck.save({name: t}, i).wait(timeout=60)
        except UnsupportedObject as exc:
            assert f"['{name}']" in str(exc)
            assert _files(where) == {}
            refused_names.append(name)
            continue
        with Checkpointer([LocalTier(where)]) as ck:
            back = ck.load()[name]
        if t.is_quantized:
            _same_quantized(t, back)
        else:
            assert back.dtype == dtype and back.shape == t.shape
            assert torch.equal(t.view(torch.uint8), back.view(torch.uint8)), name
    assert set(refused_names) <= {"quint4x2", "quint2x4"}, refused_names


# -- metadata ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "names"),
    [
        ({"when": datetime.datetime(2024, 1, 2)}, "metadata['when']"),
        ({"epochs": {3: "x"}}, "metadata['epochs']"),
        ({"lrs": (0.1, 0.01)}, "metadata['lrs']"),
        ({"loss": [1.0, math.nan]}, "metadata['loss'][1]"),
        ({"bad": {"inf": math.inf}}, "metadata['bad']['inf']"),
        ({"path": Path("/tmp/x")}, "metadata['path']"),
        ({"big": 10**5000}, "metadata['big']"),
        ({"blob": "x" * (300 << 10)}, "metadata is"),
        (["not", "a", "dict"], "metadata must be a dict"),
    ],
    ids=["datetime", "int-key", "tuple", "nan", "inf", "path", "huge-int", "too-big", "list"],
)
def test_metadata_json_cannot_carry_is_refused_at_save(
    root: Path, metadata: Any, names: str
) -> None:
    refused(root, {"w": torch.ones(2)}, metadata=metadata, names=names)


def test_metadata_round_trips_exactly(root: Path) -> None:
    md = {
        "note": "héllo \ud800",
        "epoch": 3,
        "big": 2**80,
        "lr": 1e-310,
        "neg_zero": -0.0,
        "flags": [True, None, {"nested": ["a", 1.5]}],
        "empty": {},
    }
    sent = json.loads(json.dumps(md))  # what save() received, before anything mutates md
    with Checkpointer([LocalTier(root)]) as ck:
        h = ck.save({"w": torch.ones(2)}, 1, metadata=md)
        md["flags"][2]["nested"].append("changed after save()")  # type: ignore[index]
        h.wait(timeout=60)
    (listed,) = list_checkpoints(LocalBackend(root))
    assert listed.manifest is not None
    got = listed.manifest.metadata
    assert got == sent
    assert type(got["big"]) is int and type(got["lr"]) is float  # type: ignore[index]
    assert math.copysign(1, got["neg_zero"]) == -1  # type: ignore[index]
