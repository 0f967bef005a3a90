"""A DCP load beside a trainer whose retention deletes the step it reads (an evaluator).

An evaluator that ``dcp.load``s the newest checkpoint while a trainer saves with
``keep_last=1`` may read a step the trainer's retention deletes halfway through. Measured with
two processes (a trainer saving DCP steps through a ``keep_last=1`` writer, an evaluator
loading the newest in a loop): 19 of 1,441 loads failed with ``CorruptCheckpoint: no readable
copy of rank 0's shard ... does not exist``, an error that says the stored checkpoint is
damaged when nothing is. Now such a load says what happened (``CheckpointNotFound``: deleted
while it was read; load again), and one whose step is deleted before its metadata is read
lists again and reads the newest, as ``Checkpointer.load`` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner

from tierckpt import LocalTier
from tierckpt.dcp import TierReader, TierWriter


def _w(step: int) -> torch.Tensor:
    return torch.full((4096,), float(step))


def _save(writer: TierWriter, step: int) -> None:
    """Save ``step``; return once its retention pass (keep_last) deleted the older step."""
    writer.reset(str(step))
    dcp.save({"w": _w(step)}, storage_writer=writer, no_dist=True)
    assert writer._pipeline is not None and writer._pipeline.wait_retention(timeout=60)


class _SavesMeanwhile(DefaultLoadPlanner):
    """Saves the next step through ``writer`` (keep_last=1) once the metadata is read."""

    def __init__(self, writer: TierWriter, step: int) -> None:
        super().__init__()
        self.writer, self.step = writer, step

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        super().set_up_planner(*args, **kwargs)
        _save(self.writer, self.step)


def test_a_step_deleted_while_it_is_read_is_not_called_corrupt(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "ck", keep_last=1)
    with TierWriter([tier]) as w:
        _save(w, 1)
        got = {"w": torch.empty(4096)}
        with pytest.raises(BaseException) as ei:  # DCP wraps it in CheckpointException
            dcp.load(
                got, storage_reader=TierReader([tier]), planner=_SavesMeanwhile(w, 2), no_dist=True
            )
        text = str(ei.value)
        assert "was deleted from tier(s) 'local' while it was being read" in text, text
        assert "CorruptCheckpoint" not in text, text
        reader = TierReader([tier])  # loading again reads the newest
        dcp.load(got, storage_reader=reader, no_dist=True)
        assert reader.loaded_step == 2 and torch.equal(got["w"], _w(2))


def test_a_newest_step_deleted_before_its_metadata_is_read_is_listed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = LocalTier(tmp_path / "ck", keep_last=1)
    with TierWriter([tier]) as w:
        _save(w, 1)
        reader = TierReader([tier])
        listing = reader._listing
        calls = []

        def list_then_save() -> Any:  # the trainer commits step 2 right after the listing
            out = listing()
            if not calls:
                _save(w, 2)
            calls.append(out)
            return out

        monkeypatch.setattr(reader, "_listing", list_then_save)
        got = {"w": torch.empty(4096)}
        dcp.load(got, storage_reader=reader, no_dist=True)
    assert [c[0].step for c in calls] == [1, 2]  # listed again after step 1 vanished
    assert reader.loaded_step == 2 and torch.equal(got["w"], _w(2))
