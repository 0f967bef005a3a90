"""The Python a save pays per step, cut without going stale: str keys are encoded inline
(``tree._encode``). What these tests hold: error messages still name the key path, the limits
still hold, and many saves with structure changes in between load back bit-exact."""

from __future__ import annotations

import copy
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, zoo_state

from tierckpt import Checkpointer, LocalTier, limits
from tierckpt.errors import UnsupportedObject
from tierckpt.tree import decode_tree, encode_tree


def _model_state(width: int = 8, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width))
    model.to(dtype)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4, dtype=dtype)).sum().backward()
    opt.step()
    params = dict(model.named_parameters())  # Parameters in the state: a "parameters" field
    return {"model": model.state_dict(), "optim": opt.state_dict(), "p": params, "step": 1}


def _variants() -> list[Any]:
    """States that differ from the first in one way each: what a stale text would miss."""
    base = _model_state()
    grown = _model_state(width=9)  # shapes
    half = _model_state(dtype=torch.float64)  # dtypes
    extra = copy.copy(base)
    extra["new"] = torch.zeros(3)  # a new key (and tensor)
    shared = copy.copy(base)
    w = base["model"]["0.weight"]
    shared["view"] = w[1:]  # a view of an existing storage: same tables but one more entry
    strided = copy.copy(base)
    strided["t"] = w.t()  # another stride
    meta = copy.copy(base)
    od: OrderedDict[str, Any] = OrderedDict(a=1)
    od._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    meta["od"] = od  # an OrderedDict side table
    return [base, grown, base, half, extra, shared, strided, meta, base, zoo_state()]


def test_str_keys_inline_keep_the_messages_and_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Key paths are formatted only for a message; what is refused, and where, is as before."""
    with pytest.raises(UnsupportedObject, match=r"at \['a'\]\['<key frozenset\(\{1\}\)>'\]:"):
        encode_tree({"a": {frozenset({1}): 1}}, lambda t, p: 0)
    with pytest.raises(UnsupportedObject, match=r"at \['a'\]\['b'\]"):
        encode_tree({"a": {"b": object()}}, lambda t, p: 0)
    # the node limit reached exactly at a str key: refused there, with that key's path
    monkeypatch.setattr(limits, "MAX_NODES", 1001)  # read at each encode: a small tree hits it
    n = limits.MAX_NODES
    flat = {f"k{i}": None for i in range((n - 1) // 2)}
    encode_tree(flat, lambda t, p: 0)  # 1 + 2 * len nodes: within the limit
    flat["last"] = None  # its key is node n + 1
    with pytest.raises(
        UnsupportedObject, match=r"more than 1,001 values .*at \[\"<key 'last'>\"\]"
    ):
        encode_tree(flat, lambda t, p: 0)
    monkeypatch.undo()
    # the depth limit at a key
    deep: Any = 1
    for _ in range(limits.MAX_DEPTH):
        deep = {"d": deep}
    encode_tree(deep, lambda t, p: 0)  # the innermost value at the deepest depth allowed
    deep = {"d": deep}
    with pytest.raises(UnsupportedObject, match="deeper"):
        encode_tree(deep, lambda t, p: 0)
    # and what comes back is what went in
    state = zoo_state()
    tensors: list[torch.Tensor] = []
    tree = encode_tree(state, lambda t, p: tensors.append(t) or len(tensors) - 1)
    assert_same(decode_tree(tree, tensors), state)


def test_many_saves_with_structure_changes_load_bit_exact(tmp_path: Path) -> None:
    """A loop whose state changes shape, dtype, keys and sharing between saves: every
    checkpoint loads back as it was saved (a stale table or tree would not)."""
    ck = Checkpointer([LocalTier(tmp_path, keep_last=None)])
    saved: dict[int, Any] = {}
    try:
        step = 0
        for round_ in range(3):
            for state in _variants():
                state = copy.copy(state)
                state["step"] = step  # a changing scalar in the tree, as training has
                state["round"] = torch.full((2,), float(round_))
                ck.save(state, step).wait()
                saved[step] = copy.deepcopy(state)
                step += 1
        ck.wait(retention=True)
        for s, state in saved.items():
            assert_same(ck.load(s), state)
    finally:
        ck.close()
