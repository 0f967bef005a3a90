"""A step saved twice by every rank of a job (a "final" save of the step just saved
periodically, a save after ``ck.wait()``): no rank replaces its shard file of a checkpoint
that is committed, or that rank 0 may still commit, and every rank gets the same answer. A
retry after a failed save still writes again. Real processes with gloo (``dist_workers``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends import local as local_backend
from tierckpt.errors import CheckpointExists, CheckpointFailed


def test_one_process_refuses_alike_a_step_in_flight_and_a_committed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the ranks of a job now agree on is what one process does: a second save of a
    step in flight raises ValueError at save(), one of a committed step fails on the handle
    with CheckpointExists, and the first save's checkpoint stays as it was."""
    real = local_backend._LocalWriter.write

    def slow(self: Any, offset: int, data: Any) -> None:
        time.sleep(0.5)
        real(self, offset, data)

    monkeypatch.setattr(local_backend._LocalWriter, "write", slow)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        first = ck.save({"w": torch.ones(4)}, 10)
        with pytest.raises(ValueError, match="step 10 is already being saved: wait for"):
            ck.save({"w": torch.zeros(4)}, 10)
        first.wait(timeout=60)
        with pytest.raises(CheckpointFailed, match="already committed") as ei:
            ck.save({"w": torch.zeros(4)}, 10).wait(timeout=60)
        assert isinstance(ei.value.errors["local"], CheckpointExists)
        assert torch.equal(ck.load()["w"], torch.ones(4))


@pytest.mark.distributed
@pytest.mark.parametrize("memory", [False, True], ids=["local", "ram+local"])
def test_saving_a_committed_step_again_is_refused_on_every_rank(
    tmp_path: Path, memory: bool
) -> None:
    """Rank 1's ``wait()`` returns once its shard is durable, before rank 0 (slow) commits:
    its second save of the step must not replace that shard, which the manifest names."""
    res = dist_workers.run(
        "double_save_workers:w_save_twice",
        2,
        root=str(tmp_path),
        when="committed",
        memory=memory,
        timeout=180,
    )
    for rank, r in enumerate(res):
        assert r["first"] == "ok", (rank, r)
        assert r["second"].startswith("CheckpointFailed") and "already committed" in r["second"], (
            rank,
            r,
        )
        assert "refusing to overwrite" in r["second"], (rank, r)
        assert r["replaced"] == [], (rank, r)
        assert r["steps"] == [5, 10], (rank, r)
        assert r["loaded_diff"] == [], (rank, r)


@pytest.mark.distributed
def test_saving_a_step_in_flight_on_rank_0_again_is_refused_on_every_rank(
    tmp_path: Path,
) -> None:
    """Rank 0 is still writing step 10 when every rank saves step 10 again: every rank raises
    the same ValueError at ``save()`` (not rank 0 alone while rank 1 replaces its shard, and
    rank 0 then commits rank 1's first record over its second file)."""
    res = dist_workers.run(
        "double_save_workers:w_save_twice", 2, root=str(tmp_path), when="in_flight", timeout=180
    )
    for rank, r in enumerate(res):
        assert r["second"].startswith("ValueError: step 10 is already being saved"), (rank, r)
        assert r["first"] == "ok", (rank, r)
        assert r["replaced"] == [], (rank, r)
        assert r["steps"] == [5, 10], (rank, r)
        assert r["loaded_diff"] == [], (rank, r)
    assert "another rank" in res[1]["second"] and "another rank" not in res[0]["second"]


@pytest.mark.distributed
def test_a_retry_after_a_failed_save_writes_again_on_every_rank(tmp_path: Path) -> None:
    """Rank 2's disk is full at step 2; ranks 0 and 1 wrote their shards (rank 1's is durable
    and its wait() returned ok), but nothing was committed: a retry of step 2 writes on every
    rank and commits; a third save of step 2, now committed, is refused everywhere."""
    res = dist_workers.run(
        "double_save_workers:w_retry_after_a_failure",
        3,
        root=str(tmp_path),
        victim=2,
        timeout=240,
    )
    assert res[0]["first"].startswith("CheckpointFailed") and "rank(s) 2" in res[0]["first"]
    assert res[1]["first"] == "ok"  # its own shard was durable: all it knows
    assert "No space left" in res[2]["first"]
    for rank, r in enumerate(res):
        assert r["retry"] == "ok", (rank, r)
        assert "already committed" in r["third"], (rank, r)
        assert r["loaded_diff"] == [], (rank, r)
        assert r["steps"] == [1, 2], (rank, r)
