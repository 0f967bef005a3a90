"""A load on a Checkpointer that is saving at the same time: the checkpoint the load chose is
kept from this process's own retention while it is read (``Checkpointer.protect_steps``), so a
save that commits beside the load never deletes the step under it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.checkpointer._loading as loading
from tierckpt import Checkpointer, LocalTier, MemoryTier


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4096,), value + i) for i in range(8)}


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_step_read_while_this_process_commits_a_newer_one_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    tier = LocalTier(tmp_path / "ck", keep_last=1) if kind == "local" else MemoryTier(keep_last=1)
    ck = Checkpointer([tier])
    try:
        ck.save(_state(1.0), 1).wait()
        original = loading._load_from
        during: list[list[int]] = []

        def save_beside(ctx: Any, t: Any, cid: Any, target: Any = None) -> Any:
            if not during:  # step 2 commits, and its retention pass runs, mid-load
                ck.save(_state(2.0), 2).wait()
                ck.wait(retention=True)
                during.append([c.step for c in ck.checkpoints()])
            return original(ctx, t, cid, target)

        monkeypatch.setattr(loading, "_load_from", save_beside)
        got = ck.load(1)  # an explicit step: no second listing may hide a deletion
        assert during == [[1, 2]]  # step 1 was kept while it was read
        for k, v in _state(1.0).items():
            assert torch.equal(got[k], v)
        monkeypatch.setattr(loading, "_load_from", original)
        ck.save(_state(3.0), 3).wait()
        ck.wait(retention=True)
        assert [c.step for c in ck.checkpoints()] == [3]  # kept only while it was read
    finally:
        ck.close()
