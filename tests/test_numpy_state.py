"""NumPy arrays and scalars in a checkpointed state (sampler permutations, NumPy RNG states,
metric buffers, ``np.float64`` losses): stored without pickle, given back bit for bit as the
NumPy type they were; the rest refused at ``save()`` naming the key path; malformed records in
an untrusted file refused with FormatError."""

from __future__ import annotations

import base64
import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from golden_state import golden_state
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier, NodeRamTier, StateMismatch, UnsupportedObject
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import FormatError
from tierckpt.integrations import sanitize_state
from tierckpt.noderam_map import live_mappings
from tierckpt.offline import inspect_checkpoint, verify_checkpoint
from tierckpt.tree import decode_tree, encode_tree, tree_side_table

pytestmark = pytest.mark.filterwarnings(
    "ignore::UserWarning",
    "ignore::PendingDeprecationWarning",  # np.matrix
)

DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


def _random(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray[Any, Any]:
    """Random bytes of ``dtype`` (every float bit pattern: NaN payloads, -0.0, subnormals)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape)) * dt.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    if dtype == "bool":
        raw &= 1
    return raw.view(dt).reshape(shape)


def _round_trip(root: Path, state: Any, *, guard: bool = False) -> Any:
    with Checkpointer([LocalTier(root)]) as ck:
        if guard:
            ck.guard(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        ck.save(state, 1).wait(timeout=120)
        ck.wait(retention=True)
    with Checkpointer([LocalTier(root)]) as ck:
        return ck.load(step=1)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# -- what is stored -----------------------------------------------------------------------------


def test_every_numeric_dtype_round_trips_bit_exact(tmp_path: Path) -> None:
    state = {
        f"{d}-{i}": _random(d, shape, i) for i, shape in enumerate([(7,), (3, 5)]) for d in DTYPES
    }
    out = _round_trip(tmp_path, state)
    assert_same(state, out)
    for k, v in out.items():
        assert type(v) is np.ndarray and v.flags.writeable and v.flags.c_contiguous, k
        v[...] = v  # writable for real


def test_scalars_come_back_as_the_same_numpy_type(tmp_path: Path) -> None:
    nan_payload = np.frombuffer(b"\x01\x00\x00\x00\x00\x00\xf8\x7f", "<f8")[0]
    state: dict[str, Any] = {d: _random(d, (1,), 3)[0] for d in DTYPES}
    state |= {
        "loss": np.float64(1.5),
        "count": np.int64(3),
        "flag": np.bool_(True),
        "neg_zero": np.float32(-0.0),
        "nan": nan_payload,
        "max": np.uint64(2**64 - 1),
        "z": np.complex128(1 - 2j),
        "in_tuple": (np.int32(-7), np.float16(0.5)),
    }
    out = _round_trip(tmp_path, state)
    assert_same(state, out)
    assert type(out["loss"]) is np.float64 and type(out["flag"]) is np.bool_
    assert out["nan"].tobytes() == nan_payload.tobytes()
    # np.longlong is an int64 of another Python type on Linux: it comes back as np.int64
    if np.longlong is not np.int64:
        back = _round_trip(tmp_path / "ll", {"x": np.longlong(5)})["x"]
        assert type(back) is np.int64 and back == 5


def test_shapes_views_and_strides(tmp_path: Path) -> None:
    base = np.arange(60, dtype=np.float32).reshape(3, 4, 5)
    state = {
        "zero_d": np.array(2.5),
        "empty": np.zeros((0, 3), np.int16),
        "empty_3d": np.zeros((2, 0, 4), np.complex64),
        "view": base[1:, ::2, 1::3],
        "negative": base[::-1, :, ::-2],
        "fortran": np.asfortranarray(base),
        "broadcast": np.broadcast_to(np.arange(3), (4, 3)),  # zero strides, read-only
        "base": base,
    }
    out = _round_trip(tmp_path, state)
    for k, v in state.items():
        assert type(out[k]) is np.ndarray, k
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert np.array_equal(out[k], v), k
        assert out[k].flags.c_contiguous and out[k].flags.writeable, k
    assert out["zero_d"].ndim == 0 and out["zero_d"][()] == 2.5


@pytest.mark.parametrize("guard", [False, True], ids=["unguarded", "guarded"])
def test_array_is_the_one_at_save(tmp_path: Path, guard: bool) -> None:
    """Training code may change an array in place right after save(): the checkpoint holds
    the array as it was at save(), guarded or not."""
    perm = np.arange(1 << 16, dtype=np.int64)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        if guard:
            ck.guard(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
        h = ck.save({"perm": perm, "w": torch.ones(4)}, 1)
        perm[:] = -1  # before the capture has even started
        h.wait(timeout=120)
        loaded = ck.load(step=1)
    assert np.array_equal(loaded["perm"], np.arange(1 << 16))


def test_arrays_are_copied_once(tmp_path: Path) -> None:
    """A guarded save copies an array in save() once (its own snapshot), not again as an
    unguarded tensor: the eager copies count only the loose tensor."""
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict(), "perm": np.arange(1000), "t": torch.ones(8)}, 1)
        h.wait(timeout=120)
    assert h.eager_bytes == 8 * 4


def test_node_ram_load_gives_writable_arrays_that_keep_the_segment(shm: Path) -> None:
    """From node RAM a load maps the segment copy-on-write: an array of it is writable and a
    write stays private to the process."""
    state = {"perm": np.arange(20_000, dtype=np.int64), "loss": np.float64(2.0)}
    with Checkpointer([NodeRamTier(path=shm, namespace="run", stale_after_s=None)]) as ck:
        ck.save(state, 1).wait(timeout=120)
        ck.wait(retention=True)
    (seg,) = [p for p in shm.rglob("*") if p.is_file() and p.stat().st_size > 40_000]
    before = seg.read_bytes()
    with Checkpointer([NodeRamTier(path=shm, namespace="run", stale_after_s=None)]) as ck:
        got = ck.load(step=1)
        assert live_mappings([str(shm)]), "the load did not map the segment"
        assert_same(state, got)
        got["perm"][:] = -1
        assert seg.read_bytes() == before
        assert_same(state, ck.load(step=1))


# -- NumPy random states ----------------------------------------------------------------------


def test_legacy_numpy_rng_state_reproduces_the_stream(tmp_path: Path) -> None:
    np.random.seed(1234)
    np.random.rand(17)
    np.random.randn()  # leaves a cached gaussian in the state
    state = {"rng": np.random.get_state()}
    expected = np.random.rand(100)
    loaded = _round_trip(tmp_path, state)
    assert_same(state, loaded)
    np.random.seed(0)
    np.random.set_state(loaded["rng"])
    assert np.array_equal(np.random.rand(100), expected)


@pytest.mark.parametrize("bit_generator", [np.random.PCG64, np.random.MT19937, np.random.Philox])
def test_generator_state_reproduces_the_stream(tmp_path: Path, bit_generator: Any) -> None:
    gen = np.random.Generator(bit_generator(7))
    gen.random(5)
    state = {"gen": gen.bit_generator.state}
    expected = gen.random(50)
    loaded = _round_trip(tmp_path, state)
    fresh = np.random.Generator(bit_generator(0))
    fresh.bit_generator.state = loaded["gen"]
    assert np.array_equal(fresh.random(50), expected)


def test_load_into_restores_arrays_in_place_and_the_rng_tuple(tmp_path: Path) -> None:
    np.random.seed(5)
    perm = np.random.permutation(100)
    saved = {"perm": perm.copy(), "rng": np.random.get_state(), "loss": np.float64(0.25)}
    expected = np.random.rand(10)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(saved, 1).wait(timeout=120)
        np.random.seed(99)
        target = {"perm": perm, "rng": np.random.get_state(), "loss": np.float64(9.0)}
        perm[:] = 0
        out = ck.load(step=1, into=target)
        assert out is target and target["perm"] is perm  # the caller's array, restored
        assert np.array_equal(perm, saved["perm"]) and target["loss"] == 0.25
        np.random.set_state(target["rng"])  # the whole tuple, its ints too
        assert np.array_equal(np.random.rand(10), expected)
        with pytest.raises(StateMismatch, match="int32"):
            ck.load(step=1, into={**target, "perm": np.zeros(100, np.int32)})
        with pytest.raises(StateMismatch, match=r"\(3,\)"):
            ck.load(step=1, into={**target, "perm": np.zeros(3, np.int64)})
        ro = np.zeros(100, np.int64)
        ro.flags.writeable = False
        with pytest.raises(StateMismatch, match="read-only"):
            ck.load(step=1, into={**target, "perm": ro})
        with pytest.raises(StateMismatch, match="NumPy array"):
            ck.load(step=1, into={**target, "loss": np.zeros(1)})


def test_load_into_rebuilds_tuples(tmp_path: Path) -> None:
    """A tuple cannot change in place: load(into=) used to keep the target's tuple, its
    tensors restored but its ints and floats the target's (an RNG state tuple half restored).
    It is rebuilt now, its tensors still restored in place."""
    t = torch.zeros(3)
    target = {"p": (t, 0, 0.0), "l": [(1, 2)]}
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"p": (torch.ones(3), 7, 0.5), "l": [(3, 4)]}, 1).wait(timeout=120)
        assert ck.load(step=1, into=target) is target
    assert target["p"][0] is t and torch.equal(t, torch.ones(3))
    assert target["p"][1:] == (7, 0.5) and target["l"] == [(3, 4)]


# -- what is refused at save ------------------------------------------------------------------


def _memmap(tmp_path: Path) -> np.ndarray[Any, Any]:
    return np.memmap(tmp_path / "mm.bin", dtype=np.float32, mode="w+", shape=(4,))


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda _p: np.array([object()]), "x.tolist()"),
        (lambda _p: np.array(["a", "bc"]), "<U2"),
        (lambda _p: np.array([b"a"]), "|S1"),
        (lambda _p: np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "one array per field"),
        (lambda _p: np.array(["2026-01-01"], dtype="datetime64[D]"), "view('int64')"),
        (lambda _p: np.zeros(2, dtype="timedelta64[s]"), "view('int64')"),
        (lambda _p: np.zeros(2, dtype=np.longdouble), "float128"),
        (lambda _p: np.zeros(3, dtype=">f8"), "newbyteorder('=')"),
        (lambda _p: np.zeros(3, dtype=">i4"), "byte-swapped"),
        (lambda _p: np.ma.masked_array([1, 2], mask=[0, 1]), "np.asarray"),
        (lambda _p: np.matrix([[1, 2]]), "np.asarray"),
        (_memmap, "np.asarray"),
        (lambda _p: np.str_("text"), "<U4"),
        (lambda _p: np.datetime64("2026-01-01"), "datetime64"),
        (lambda _p: np.longdouble(1.5), "float128"),
        (lambda _p: np.void(b"\x00\x01"), "V2"),
    ],
)
def test_other_numpy_values_are_refused_naming_the_path(
    tmp_path: Path, make: Any, says: str
) -> None:
    if says == "float128" and np.dtype(np.longdouble).name != "float128":
        pytest.skip("longdouble is float128 on Linux x86-64")
    root = tmp_path / "ckpt"
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save({"ok": np.ones(2)}, 0).wait(timeout=60)
        ck.wait(retention=True)
        before = _files(root)
        with pytest.raises(UnsupportedObject) as info:
            ck.save({"sampler": {"state": [make(tmp_path)]}}, 1)
        ck.wait(retention=True)
        assert _files(root) == before and ck.steps() == [0]
    msg = str(info.value)
    assert "['sampler']['state'][0]" in msg and says in msg, msg


def test_array_in_odict_metadata_is_refused() -> None:
    od: OrderedDict[str, Any] = OrderedDict(a=1)
    od._metadata = {"v": np.ones(2)}  # type: ignore[attr-defined]
    with pytest.raises(UnsupportedObject, match="NumPy array in the _metadata"):
        encode_tree({"sd": od}, lambda t, p: 0)
    od._metadata = {"v": np.int64(2)}  # type: ignore[attr-defined]
    enc = encode_tree({"sd": od}, lambda t, p: 0)
    back = decode_tree(json.loads(json.dumps(enc)), [], odict_metadata=tree_side_table(enc))
    assert type(back["sd"]._metadata["v"]) is np.int64


# -- limits: the encoder counts what the decoder counts ---------------------------------------


@pytest.mark.parametrize("kind", ["array", "scalar"])
def test_node_limit_counts_numpy_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import tierckpt.limits

    monkeypatch.setattr(tierckpt.limits, "MAX_NODES", 1000)

    def make(i: int) -> Any:
        return np.array([i], np.int32) if kind == "array" else np.int32(i)

    # dict 1 + key 1 + list 1 + 332 records of 3 values = 999 values: loads
    state = {"xs": [make(i) for i in range(332)]}
    assert_same(state, _round_trip(tmp_path / "ok", state))
    with pytest.raises(UnsupportedObject, match="more than 1,000 values"):
        encode_tree({"xs": [make(i) for i in range(334)]}, lambda t, p: 0)


def test_index_size_counts_array_records(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tierckpt.limits

    monkeypatch.setattr(tierckpt.limits, "MAX_INDEX_BYTES", (1 << 20) + 200_000)
    few = {"a": [np.zeros(2, np.float32) for _ in range(200)]}
    assert_same(few, _round_trip(tmp_path, few))
    with pytest.raises(UnsupportedObject, match="index"):
        encode_tree({"a": [np.zeros(2, np.float32) for _ in range(1000)]}, lambda t, p: 0)


# -- an untrusted file ------------------------------------------------------------------------


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


@pytest.mark.parametrize(
    ("node", "says"),
    [
        ({"$ndarray": 0}, r"\$ndarray needs"),
        ({"$ndarray": [0]}, r"\$ndarray needs"),
        ({"$ndarray": [0, "float32", [4]]}, r"\$ndarray needs"),
        ({"$ndarray": [0, "object"]}, "unknown NumPy dtype 'object'"),
        ({"$ndarray": [0, "<f4"]}, "unknown NumPy dtype"),
        ({"$ndarray": [0, "longdouble"]}, "unknown NumPy dtype"),
        ({"$ndarray": [0, 7]}, "unknown NumPy dtype"),
        ({"$ndarray": [0, "float64"]}, "tensor is torch.float32, not torch.float64"),
        ({"$ndarray": [0, "int32"]}, "tensor is torch.float32"),
        ({"$ndarray": [5, "float32"]}, "out of range"),
        ({"$ndarray": [-1, "float32"]}, "bad tensor reference"),
        ({"$ndarray": ["0", "float32"]}, "bad tensor reference"),
        ({"$npscalar": ["float64"]}, r"\$npscalar needs"),
        ({"$npscalar": "AAAA"}, r"\$npscalar needs"),
        ({"$npscalar": ["object", _b64(b"\0" * 8)]}, "unknown NumPy dtype"),
        ({"$npscalar": ["float64", _b64(b"\0" * 4)]}, "takes 8 bytes, not 4"),
        ({"$npscalar": ["float64", "!!not base64!!"]}, "bad base64"),
        ({"$npscalar": ["float64", 1.5]}, "base64 string"),
        ({"$npscalar": ["int8", "A" * 4000]}, "base64 string"),
        ({"$npscalar": ["bool", _b64(b"\x02")]}, "neither 0 nor 1"),
    ],
)
def test_malformed_records_are_format_errors(node: Any, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        decode_tree({"$dict": [["x", node]]}, [torch.zeros(4)])


def test_placeholder_readers_check_the_record_too() -> None:
    """verify and inspect decode with placeholders (no bytes): the dtype is still checked."""
    assert decode_tree({"$ndarray": [0, "uint16"]}, lambda i: ("ref", i)) == ("ref", 0)
    with pytest.raises(FormatError, match="unknown NumPy dtype"):
        decode_tree({"$ndarray": [0, "str"]}, lambda i: None)


def test_unknown_tag_says_to_upgrade() -> None:
    with pytest.raises(FormatError, match=r"unknown tag '\$nd2'.*newer tierckpt\? upgrade"):
        decode_tree({"$nd2": [0, "float32"]}, [torch.zeros(1)])


# -- the rest of the library sees them ----------------------------------------------------------


def test_verify_inspect_and_export(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("huggingface_hub")
    from safetensors.numpy import load_file

    from tierckpt.export import export_safetensors

    root = tmp_path / "ckpt"
    state = {
        "model": {"w": torch.ones(2, 2)},
        "sampler": {"perm": np.arange(10, dtype=np.int32)[::-1], "epoch": np.int64(3)},
        "loss": np.float32(0.5),
    }
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save(state, 3).wait(timeout=120)
        ck.wait(retention=True)
    backend = LocalBackend(str(root))
    assert verify_checkpoint(backend, 3).chunks >= 1
    info = inspect_checkpoint(backend, 3)
    assert {(t.path, t.dtype, t.shape) for t in info.tensors} == {
        ("model.w", "float32", (2, 2)),
        ("sampler.perm", "int32", (10,)),
    }
    (res,) = export_safetensors(backend, 3, str(tmp_path / "out"))
    assert res.tensors == 2 and not res.skipped
    doc = json.loads((tmp_path / "out" / "state.json").read_text())
    ref = doc["state"]["sampler"]["perm"]
    assert ref["numpy"] == "int32" and doc["state"]["sampler"]["epoch"] == 3
    assert doc["state"]["loss"] == 0.5
    arrays = load_file(str(tmp_path / "out" / ref["$safetensors"]))
    assert np.array_equal(arrays[ref["name"]], np.arange(10, dtype=np.int32)[::-1])


def test_dcp_planner_data_keeps_scalars_and_refuses_arrays() -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    from tierckpt.dcp._metadata import decode_metadata, encode_metadata

    md = Metadata(state_dict_metadata={}, planner_data={"epoch": np.int64(4)})
    back = decode_metadata(encode_metadata(md), where="t")
    assert type(back.planner_data["epoch"]) is np.int64 and back.planner_data["epoch"] == 4
    md.planner_data = {"perm": np.arange(3)}
    with pytest.raises(UnsupportedObject, match=r"NumPy array at \['perm'\]"):
        encode_metadata(md)


def test_sanitize_state_keeps_numpy_values() -> None:
    perm = np.arange(4)
    out = sanitize_state({"perm": perm, "loss": np.float64(1.5), "names": np.array(["a"])})
    assert out["perm"] is perm and type(out["loss"]) is np.float64
    assert isinstance(out["names"], str)  # not storable: its repr, as before


# -- no format change for states without NumPy values ----------------------------------------


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_states_without_numpy_write_the_golden_bytes(tmp_path: Path, codec: str) -> None:
    """The v2 golden shard file, written again today, is byte for byte the checked-in one."""
    fixture = Path(__file__).parent / "fixtures" / "format_v2" / codec
    out = tmp_path / codec
    with Checkpointer([LocalTier(out, codec=codec, prefixes=16)], chunk_bytes=4096) as ck:
        ck.save(golden_state(), step=42, metadata={"note": "golden v2"}).wait(timeout=120)
        ck.wait(retention=True)
    (written,) = list(out.rglob("*.tck"))
    assert written.read_bytes() == (fixture / written.relative_to(out)).read_bytes()
    shutil.rmtree(out)
