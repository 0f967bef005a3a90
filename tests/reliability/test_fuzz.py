"""Fuzzing the parsers of untrusted bytes with Hypothesis: only tierckpt errors may come out.

``format.decode_index``, ``format.decode_manifest`` and ``objects.decode_tree`` get random
bytes, random JSON, and valid documents with random fields replaced by random JSON values;
the whole load path (``Checkpointer.load`` on a RAM tier, with index, footer and manifest
re-sealed after each mutation so the parsers see it) gets mutated indexes. Any exception
outside the :class:`~tierckpt.errors.TierCkptError` family is a bug. The default run is short;
the ``slow`` variant runs many more examples with a fixed seed.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from rel_util import Recorder, replace_object, reseal, seal_manifest

from tierckpt import Checkpointer, MemoryTier, TierCkptError
from tierckpt.backends.memory import MemoryBackend
from tierckpt.format import decode_index, decode_manifest, manifest_name, shard_name
from tierckpt.tree import decode_tree

TAGS = [
    "$tensor",
    "$tuple",
    "$dict",
    "$odict",
    "$int",
    "$float",
    "$bytes",
    "$size",
    "$dtype",
    "$device",
    "$pickle",
    "$class",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 2**62, 2**63, 2**64, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "raw",
            "zstd",
            "planes",
            "float32",
            "uint8",
            "../x",
            "/etc",
            "nan",
            "inf",
            "cuda:0",
            "steps/000000000007/rank-000000.tck",
            "0" * 16,
        ]
    ),
)


def _tagged(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(TAGS), st.text(max_size=6)), children, max_size=3
        ),
    )


json_values = st.recursive(scalars, _tagged, max_leaves=20)

SETTINGS = settings(
    max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck)
)
SLOW = settings(
    max_examples=4000,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def _index_doc() -> dict[str, Any]:
    return {
        "format": "tierckpt-shard",
        "version": 1,
        "step": 7,
        "rank": 0,
        "world_size": 1,
        "checksum_algo": "xxh3_64",
        "codecs": [{"id": "raw"}, {"id": "zstd", "level": 1}],
        "chunks": [
            [0, 65536, 65536, 0, 0, "b5e7986685148b3c"],
            [65536, 3432, 3432, 65536, 0, "a224604d334375e0"],
        ],
        "tree": {
            "$dict": [
                ["w", {"$tensor": 0}],
                ["b", {"$tensor": 1}],
                ["m", {"$tuple": [1, {"$int": "99"}]}],
            ]
        },
        "tensors": [[0, 0, "float32", [16384], [1], "cpu"], [1, 0, "float32", [10], [1], "cpu"]],
        "storages": [[0, 65536], [65536, 3432]],
        "data_bytes": 68968,
    }


def _manifest_doc() -> dict[str, Any]:
    return json.loads(
        seal_manifest(
            {
                "format": "tierckpt-manifest",
                "version": 1,
                "step": 7,
                "world_size": 1,
                "created": 1.5,
                "library_version": "0.1.0",
                "tier": "local",
                "raw_bytes": 10,
                "stored_bytes": 10,
                "codecs": ["raw"],
                "metadata": {},
                "shards": [
                    {
                        "rank": 0,
                        "file": "steps/000000000007/rank-000000.tck",
                        "size": 69000,
                        "index_checksum": "0123456789abcdef",
                    }
                ],
            }
        )
    )


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(doc: Any, data: st.DataObject) -> Any:
    doc = copy.deepcopy(doc)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = [p for p in _paths(doc) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = data.draw(json_values)
    return doc


#: what the examples of this module produced, for the report: "parser:outcome" -> count
OUTCOMES: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report_outcomes() -> Iterator[None]:
    yield
    rec = Recorder("tests/reliability/test_fuzz.py")
    for what in ("parsers", "load path"):
        mine = Counter(
            {k.split(":", 1)[1]: v for k, v in OUTCOMES.items() if k.startswith(what + ":")}
        )
        if mine:
            rec(
                "fuzz",
                what,
                f"{sum(mine.values())} {'parser calls' if what == 'parsers' else 'loads'}; "
                "outcomes: " + ", ".join(f"{k} {v}" for k, v in mine.most_common()),
                outcomes=mine,
            )
    OUTCOMES.clear()


def _only_family(fn: Any, *args: Any, **kw: Any) -> str:
    try:
        fn(*args, **kw)
    except TierCkptError as exc:
        OUTCOMES[f"parsers:{fn.__name__} {type(exc).__name__}"] += 1
        return type(exc).__name__
    OUTCOMES[f"parsers:{fn.__name__} accepted"] += 1
    return "accepted"


def _check_parsers(data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from(["bytes", "json", "index", "manifest", "tree"]))
    if kind == "bytes":
        blob = data.draw(st.binary(max_size=200))
        _only_family(decode_index, blob, file_size=10**6, where="fuzz")
        _only_family(decode_manifest, blob, where="fuzz")
    elif kind == "json":
        blob = json.dumps(data.draw(json_values)).encode()
        _only_family(decode_index, blob, file_size=10**6, where="fuzz")
        _only_family(decode_manifest, blob, where="fuzz")
    elif kind == "index":
        doc = _mutate(_index_doc(), data)
        blob = json.dumps(doc).encode()
        _only_family(decode_index, blob, file_size=data.draw(st.integers(0, 2**40)), where="f")
    elif kind == "manifest":
        doc = _mutate(_manifest_doc(), data)
        try:
            blob = seal_manifest(doc)  # sealed: the fields, not the checksum, are tested
        except (ValueError, TypeError):
            blob = json.dumps(doc).encode()
        _only_family(decode_manifest, blob, where="fuzz")
    else:
        tree = data.draw(json_values)
        tensors = [torch.zeros(1), torch.ones(2)]
        _only_family(decode_tree, tree, tensors)


@SETTINGS
@given(st.data())
def test_fuzz_parsers(data: st.DataObject) -> None:
    _check_parsers(data)


@pytest.mark.slow
@SLOW
@seed(20240601)
@given(st.data())
def test_fuzz_parsers_long(data: st.DataObject) -> None:
    _check_parsers(data)


# -- the whole load path on a RAM tier ------------------------------------------------------


@pytest.fixture(scope="module")
def ram_checkpoint() -> Any:
    ns = f"fuzz-{uuid.uuid4().hex}"
    state = {
        "w": torch.arange(20_000, dtype=torch.float32),
        "b": torch.ones(10),
        "i": torch.arange(7, dtype=torch.int64)[::2],
        "m": {"k": (1, "x")},
    }
    with Checkpointer([MemoryTier(namespace=ns, keep_last=None)], chunk_bytes=16 << 10) as ck:
        ck.save(state, 7).wait()
    b = MemoryBackend(ns)
    originals = {n: bytes(b.get(n)) for n in (shard_name(7, 0), manifest_name(7))}
    yield ns, b, originals
    MemoryBackend.clear_namespace(ns)


def _check_load_path(ram_checkpoint: Any, data: st.DataObject) -> str:
    """Mutate the index or the manifest (re-sealed), then load: loaded or a tierckpt error."""
    ns, b, originals = ram_checkpoint
    for n, blob in originals.items():
        replace_object(b, n, blob)
    if data.draw(st.booleans()):
        reseal(b, 7, index=lambda idx: _mutate(idx, data))
    else:
        doc = _mutate(json.loads(originals[manifest_name(7)]), data)
        try:
            blob = seal_manifest(doc)
        except (ValueError, TypeError):  # NaN / inf: sealing refuses them, the reader must too
            blob = json.dumps(doc).encode()
        replace_object(b, manifest_name(7), blob)
    with Checkpointer([MemoryTier(namespace=ns)]) as ck:
        try:
            ck.load(step=7)
        except TierCkptError as exc:
            OUTCOMES[f"load path:{type(exc).__name__}"] += 1
            return type(exc).__name__
    OUTCOMES["load path:loaded"] += 1
    return "loaded"


@SETTINGS
@given(st.data())
def test_fuzz_load_path(ram_checkpoint: Any, data: st.DataObject) -> None:
    _check_load_path(ram_checkpoint, data)


@pytest.mark.slow
@SLOW
@seed(20240602)
@given(st.data())
def test_fuzz_load_path_long(ram_checkpoint: Any, data: st.DataObject) -> None:
    _check_load_path(ram_checkpoint, data)
