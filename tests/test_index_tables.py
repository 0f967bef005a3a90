"""The index's storage and tensor tables are checked a column at a time (a table of a
thousand entries in well under a ms) and, where that finds something wrong, record by record,
so that the error still names the first bad record. Every table here is refused or accepted
as the record-by-record check decides."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import FormatError
from tierckpt.format import decode_index, encode_index
from tierckpt.restore import parse_tensor_entry, read_index, read_manifest


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], int]:
    """A real index (three tensors of one storage each) and its file's size."""
    root: Path = tmp_path_factory.mktemp("idx")
    state = {
        "a": torch.arange(6.0),
        "b": torch.ones(2, 3, dtype=torch.bfloat16),
        "c": torch.zeros(0),
    }
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save(state, step=1).result()
    backend = LocalBackend(root)
    ref = read_manifest(backend, 1, "t").shard_for(0)
    _index, blob, _footer = read_index(backend, ref, "t")
    return json.loads(bytes(blob)), ref.size


def _decode(index: dict[str, Any], size: int) -> dict[str, Any]:
    # the file's size as if the index were where it was (an edit may lengthen it)
    return decode_index(encode_index(index), file_size=size + (1 << 20), where="f")


def test_the_saved_tables_pass(saved: tuple[dict[str, Any], int]) -> None:
    index, size = saved
    got = _decode(json.loads(json.dumps(index)), size)
    assert got["storages"] == index["storages"]


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda st, n: st.__setitem__(0, [0, True]), r"storage 0 size must be an int"),
        (lambda st, n: st.__setitem__(0, [0.0, st[0][1]]), r"storage 0 offset must be an int"),
        (lambda st, n: st.__setitem__(0, [-8, st[0][1] + 8]), r"storage 0 offset must be an int"),
        (lambda st, n: st.__setitem__(0, [0, 2**62]), r"storage 0 overlaps another or lies out"),
        (lambda st, n: st.__setitem__(0, [0, 2**62 + 1]), r"storage 0 size must be an int"),
        (lambda st, n: st.__setitem__(1, [0, st[1][1]]), r"storage 1 overlaps another"),
        (lambda st, n: st.__setitem__(1, [st[1][0], 1 << 40]), r"storage 1 overlaps another"),
        (lambda st, n: st.__setitem__(1, [st[1][0]]), r"storage 1 record malformed"),
        (lambda st, n: st.__setitem__(1, (st[1][0], st[1][1], 0)), r"storage 1 record malformed"),
        (lambda st, n: st.__setitem__(1, {"a": 1}), r"storage 1 record malformed"),
        (lambda st, n: st.__setitem__(1, None), r"storage 1 record malformed"),
        (lambda st, n: st.pop(), r"storages cover \d+ of \d+ data bytes"),
        (lambda st, n: st.clear(), r"storages cover 0 of \d+ data bytes"),
    ],
)
def test_bad_storage_tables_are_refused_naming_the_record(
    saved: tuple[dict[str, Any], int], edit: Any, error: str
) -> None:
    index, size = saved
    index = json.loads(json.dumps(index))
    edit(index["storages"], index["data_bytes"])
    with pytest.raises(FormatError, match=error):
        _decode(index, size)


def test_storages_apart_are_accepted(saved: tuple[dict[str, Any], int]) -> None:
    """Bytes no storage holds (between two storages) are allowed, as they always were."""
    index, size = saved
    index = json.loads(json.dumps(index))
    st = index["storages"]
    assert len(st) >= 2 and st[0][1] > 8
    st[0][1] -= 8  # the first storage ends 8 bytes before the next begins
    assert _decode(index, size)["storages"][0] == st[0]


_SIZES = [48, 12]


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ([0, 0, "float32", [6], [1], "cpu"], None),
        ([0, 0, "float32", [2, 3], [3, 1], "cpu"], None),
        ([1, 0, "bfloat16", [2, 3], [3, 1], "cpu"], None),
        ([0, 0, "float32", [], [], "cpu"], None),
        ([-1, 0, "float32", [0], [1], "cpu"], None),
        ([0, 0, "float32", [True], [1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [6.0], [1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [-1], [1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [1 << 48], [1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [6], [1, 1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", (6,), [1], "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [6], "1", "cpu"], r"malformed shape/stride"),
        ([0, 0, "float32", [1] * 65, [1] * 65, "cpu"], r"malformed shape/stride"),
        ([0, 0, "float99", [6], [1], "cpu"], r"unknown dtype"),
        ([0, 0, 7, [6], [1], "cpu"], r"unknown dtype"),
        ([0, 0, "float32", [13], [1], "cpu"], r"does not fit its storage"),
        ([0, 4, "float32", [11], [1], "cpu"], None),
        ([0, 4, "float32", [4, 2], [4, 1], "cpu"], r"does not fit its storage"),
        ([0, 2, "float32", [2], [1], "cpu"], r"does not fit its storage"),
        ([0, 0, "float32", [0], [1], "cpu"], r"does not fit its storage"),
        ([2, 0, "float32", [1], [1], "cpu"], r"outside the storage table"),
        ([True, 0, "float32", [1], [1], "cpu"], r"outside the storage table"),
        ([-1.0, 0, "float32", [0], [1], "cpu"], r"outside the storage table"),
        ([0, -4, "float32", [1], [1], "cpu"], r"outside the storage table"),
        ([-1, 0, "float32", [2], [1], "cpu"], r"has elements but no storage"),
        ([0, 0, "float32", [6], [1]], r"record malformed"),
        ((0, 0, "float32", [6], [1], "cpu"), r"record malformed"),
    ],
)
def test_tensor_records(entry: Any, error: str | None) -> None:
    if error is None:
        rec = parse_tensor_entry(entry, 3, "f", _SIZES)
        assert rec.shape == entry[3] and rec.stride == entry[4]
    else:
        with pytest.raises(FormatError, match=error):
            parse_tensor_entry(entry, 3, "f", _SIZES)
