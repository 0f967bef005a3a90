"""The pickle-free object schema: property round trips and hostile trees."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierckpt.errors import FormatError, UnsupportedObject
from tierckpt.tree import decode_tree, encode_tree

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.binary(max_size=20),
)
keys = st.one_of(
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
    st.none(),
    st.tuples(st.integers(), st.text(max_size=3)),
)
trees = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.dictionaries(keys, inner, max_size=4),
        st.dictionaries(st.text(max_size=5), inner, max_size=4).map(OrderedDict),
    ),
    max_leaves=30,
)


def _same(a: object, b: object) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )  # type: ignore[arg-type]
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


@settings(max_examples=200, deadline=None)
@given(trees)
def test_round_trip_through_json(tree: object) -> None:
    enc = encode_tree(tree, lambda t, p: 0)
    text = json.dumps(enc, allow_nan=False)  # strictly valid JSON
    assert _same(decode_tree(json.loads(text), []), tree)


def test_torch_values() -> None:
    tree = {"s": torch.Size([1, 2]), "d": torch.bfloat16, "dev": torch.device("cuda:1")}
    assert decode_tree(json.loads(json.dumps(encode_tree(tree, lambda t, p: 0))), []) == tree


@pytest.mark.parametrize(
    "hostile",
    [
        {"$tensor": 5},
        {"$tensor": -1},
        {"$pickle": "gASV"},
        {"$int": "1e5"},
        {"$float": "1.0"},
        {"$bytes": "!!"},
        {"$dtype": "__class__"},
        {"$dict": [[[1], 2]]},
        {"a": 1, "b": 2},
        {"$size": [-1]},
    ],
)
def test_hostile_nodes_are_refused(hostile: object) -> None:
    with pytest.raises(FormatError):
        decode_tree(hostile, [])


def test_depth_is_bounded() -> None:
    deep: object = 1
    for _ in range(500):
        deep = [deep]
    with pytest.raises(FormatError, match="deeper"):
        decode_tree(deep, [])
    with pytest.raises(UnsupportedObject, match="deeper"):
        encode_tree(deep, lambda t, p: 0)


def test_subclasses_are_not_silently_flattened() -> None:
    class MyDict(dict):  # type: ignore[type-arg]
        pass

    with pytest.raises(UnsupportedObject, match="MyDict"):
        encode_tree({"x": MyDict()}, lambda t, p: 0)
