"""A committed newest checkpoint that cannot be read is not "nothing to resume".

``CheckpointNotFound`` tells a training script that nothing is committed, and the usual idiom
(``except CheckpointNotFound: start = 0``, as in ``examples/torchrun_train.py``) then starts
from scratch: its saves go on a new timeline, whose retention deletes the run's checkpoints.
A load whose newest checkpoint is committed but has a shard file missing (one rank's, in a
multi-rank job) raised exactly that, and the example restarted from step 0, deleting steps 4
and 8 although step 4 was readable on every rank. Now such a load raises
``CorruptCheckpoint``, naming the older committed steps and ``fallback="previous"``."""

from __future__ import annotations

import os
from pathlib import Path

import dist_workers
import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint


def _shard(root: Path, step: int, rank: int) -> Path:
    (found,) = root.glob(f"**/steps/{step:012d}/rank-{rank:06d}.tck")
    return found


def test_a_missing_shard_of_the_newest_is_damage_not_an_empty_tier(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for step in (1, 2):
            ck.save({"w": torch.full((64,), float(step))}, step).wait()
    os.remove(_shard(root, 2, 0))
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        with pytest.raises(CorruptCheckpoint, match=r"Older committed steps: \[1\]") as err:
            ck.load()
        assert not isinstance(err.value, CheckpointNotFound)
        assert "fallback='previous'" in str(err.value)
        assert ck.load(fallback="previous")["w"][0] == 1.0
        with pytest.raises(CheckpointNotFound):  # a step never committed is still not found
            ck.load(7)


def test_one_ranks_unreadable_shard_of_the_newest_is_damage_on_every_rank(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "run")
    dist_workers.run("damaged_newest_workers:w_damaged_newest", 2, root=root, phase="save")
    os.remove(_shard(Path(root), 2, 1))
    res = dist_workers.run(
        "damaged_newest_workers:w_damaged_newest", 2, root=root, phase="load", timeout=240
    )
    assert [r["error"] for r in res] == ["CorruptCheckpoint", "CorruptCheckpoint"], res
    assert all("fallback='previous'" in r["says"] for r in res), res
    assert [r["previous"] for r in res] == [[1, 1.0], [1, 11.0]], res
