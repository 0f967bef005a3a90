"""``Checkpointer.load()`` of a checkpoint ``tierckpt.dcp.TierWriter`` wrote: a clear error.

A DCP shard holds DCP's items (``'0'``, ``'1'``…, non-tensor values as ``torch.save`` bytes),
not the state that was saved: the native load refuses it, before reading any of its bytes,
and says to load it with ``tierckpt.dcp.TierReader`` through ``torch.distributed.checkpoint``.
The marker is the manifest's ``dcp`` entry naming DCP's metadata file (what ``TierReader``
reads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tierckpt import Checkpointer, LocalTier
from tierckpt.dcp import TierReader, TierWriter
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.format import shard_name

# DCP warns that it runs in a single process when no process group is initialized
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)},
        "step": seed,  # a non-tensor value: torch.save bytes in DCP's shard
    }


def _dcp_save(folder: Path, step: int) -> dict[str, object]:
    saved = _state(step)
    with TierWriter([LocalTier(folder)], step) as w:
        dcp.save(saved, storage_writer=w, no_dist=True)
    return saved


def _assert_dcp_error(exc: pytest.ExceptionInfo[FormatError], step: int) -> None:
    msg = str(exc.value)
    assert not isinstance(exc.value, CorruptCheckpoint), msg
    assert f"step {step} is a DCP checkpoint" in msg, msg
    assert "tierckpt.dcp.TierReader" in msg and "torch.distributed.checkpoint.load" in msg, msg


def test_native_load_of_a_dcp_checkpoint_says_to_use_the_dcp_reader(tmp_path: Path) -> None:
    saved = _dcp_save(tmp_path, 3)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(FormatError) as exc:
            ck.load()
        _assert_dcp_error(exc, 3)
        with pytest.raises(FormatError) as exc:
            ck.load(3)
        _assert_dcp_error(exc, 3)
    # the DCP reader still loads it, every value as saved
    target = _state(0)
    dcp.load(target, storage_reader=TierReader([LocalTier(tmp_path)], 3), no_dist=True)
    assert target["step"] == 3
    for k in ("w", "b"):
        assert torch.equal(target["model"][k], saved["model"][k])  # type: ignore[index]


def test_refused_before_any_byte_of_the_shard_is_read(tmp_path: Path) -> None:
    _dcp_save(tmp_path, 4)
    (tmp_path / shard_name(4, 0)).write_bytes(b"")  # a read of it would fail otherwise
    with Checkpointer([LocalTier(tmp_path)]) as ck, pytest.raises(FormatError) as exc:
        ck.load()
    _assert_dcp_error(exc, 4)


def test_native_checkpoints_beside_it_still_load(tmp_path: Path) -> None:
    native = {"w": torch.arange(6.0)}
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        # user metadata with a "dcp" key of its own is not DCP's marker
        ck.save(native, 1, metadata={"dcp": {"file": "mine.json", "note": "user data"}})
        ck.wait()
    _dcp_save(tmp_path, 2)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert torch.equal(ck.load(1)["w"], native["w"])
        with pytest.raises(FormatError) as exc:
            ck.load()  # the newest is step 2, DCP's
        _assert_dcp_error(exc, 2)
