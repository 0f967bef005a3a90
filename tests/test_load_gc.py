"""The cyclic garbage collector is paused while a load parses its index and rebuilds its
tensors (``tierckpt.restore._gc``), and its state is what it was after every load: one that
succeeds, one that raises, with the collector on or off before, from several threads at once.
Tensor records are validated as before (same fields, same refusals)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, zoo_state

import tierckpt.format._index as format_index
import tierckpt.restore._shard as shard_mod
from tierckpt import Checkpointer, LocalTier, TierCkptError
from tierckpt.errors import FormatError
from tierckpt.restore import parse_tensor_entry
from tierckpt.restore._gc import gc_paused


@pytest.fixture(autouse=True)
def _gc_on() -> Iterator[None]:
    """Each test starts and ends with the collector on (as pytest runs)."""
    gc.enable()
    yield
    assert gc.isenabled(), "a test left the collector off"
    gc.enable()


def _saved(tmp_path: Path) -> Checkpointer:
    ck = Checkpointer([LocalTier(tmp_path / "t")])
    ck.save(zoo_state(), step=1).result()
    ck.wait(retention=True)
    return ck


def test_collector_off_while_index_parsed_and_tensors_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, bool] = {}
    parse, tree = format_index._parse_index, shard_mod.decode_tree

    def spy_parse(*a: Any, **k: Any) -> Any:
        seen["parse"] = gc.isenabled()
        return parse(*a, **k)

    def spy_tree(*a: Any, **k: Any) -> Any:
        seen["tree"] = gc.isenabled()
        return tree(*a, **k)

    monkeypatch.setattr(format_index, "_parse_index", spy_parse)
    monkeypatch.setattr(shard_mod, "decode_tree", spy_tree)
    with _saved(tmp_path) as ck:
        assert_same(ck.load(), zoo_state())
    assert seen == {"parse": False, "tree": False}
    assert gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_restored_after_a_load_that_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool
) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        assert not gc.isenabled()  # inside the pause
        raise FormatError("tree damaged (test)")

    with _saved(tmp_path) as ck:
        monkeypatch.setattr(shard_mod, "decode_tree", broken)
        if not enabled:
            gc.disable()
        try:
            with pytest.raises(TierCkptError, match="tree damaged"):
                ck.load()
            assert gc.isenabled() is enabled
            monkeypatch.undo()
            assert_same(ck.load(), zoo_state())
            assert gc.isenabled() is enabled
        finally:
            gc.enable()


def test_pause_nests_across_threads_and_survives_errors() -> None:
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        assert not gc.isenabled()
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's section still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("x")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_tensor_records_as_before() -> None:
    sizes = [64, 4096, 0]
    rec = parse_tensor_entry([1, 8, "float32", [3, 4], [8, 1], "cpu"], 0, "w", sizes)
    assert (rec.storage, rec.offset, rec.dtype, rec.shape, rec.stride) == (
        1,
        8,
        torch.float32,
        [3, 4],
        [8, 1],
    )
    assert rec.extent == ((3 - 1) * 8 + (4 - 1) * 1 + 1) * 4
    zero_stride = parse_tensor_entry([0, 0, "int16", [5, 7], [0, 1], "cpu"], 1, "w", sizes)
    assert zero_stride.extent == 7 * 2
    empty = parse_tensor_entry([-1, 0, "bfloat16", [0, 3], [3, 1], "cpu"], 2, "w", sizes)
    assert (empty.storage, empty.extent, empty.shape) == (-1, 0, [0, 3])
    scalar = parse_tensor_entry([0, 8, "float64", [], [], "cpu"], 3, "w", [16])
    assert (scalar.extent, scalar.shape) == (8, [])
    for bad, why in [
        ([0, 0, "float32", [2], [1]], "record malformed"),
        ([0, 0, "float32", [2, 2], [1], "cpu"], "malformed shape/stride"),
        ([0, 0, "float32", [2, True], [2, 1], "cpu"], "malformed shape/stride"),
        ([0, 0, "float32", [2, -1], [2, 1], "cpu"], "malformed shape/stride"),
        ([0, 0, "float32", [1 << 48], [1], "cpu"], "malformed shape/stride"),
        ([0, 0, "float32", [1 << 40, 1 << 40], [0, 0], "cpu"], "declares"),
        ([-1, 0, "float32", [2], [1], "cpu"], "elements but no storage"),
        ([3, 0, "float32", [2], [1], "cpu"], "outside the storage table"),
        ([0, 2, "float32", [2], [1], "cpu"], "does not fit"),
        ([0, 0, "float32", [17], [1], "cpu"], "does not fit"),
        ([0, 0, "float32", [0], [1], "cpu"], "does not fit"),
        ([0, 0, "nonsense", [2], [1], "cpu"], "unknown dtype"),
    ]:
        with pytest.raises(FormatError, match=why):
            parse_tensor_entry(bad, 0, "w", [64])
