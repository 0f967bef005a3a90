"""A job restarted with another number of ranks is told so, and the run's checkpoints stay.

The native format is one shard file per rank, so a 3-rank job cannot load a 2-rank job's
checkpoint. Its multi-rank load raised ``CheckpointNotFound`` ("no checkpoint step is committed
and readable on every rank"), which the resume idiom of ``examples/torchrun_train.py`` catches
(``except CheckpointNotFound: start = 0``): the job trained from step 0 without a word, its
saves started a new timeline, and ``keep_last`` retention deleted every checkpoint the 2-rank
run had committed. Where an older checkpoint of the job's own world size existed, the ranks
agreed on it and loaded it silently, abandoning the newer run.

Now a load whose newest checkpoint was saved by another world size raises
``WorldSizeMismatch`` (not a ``CheckpointNotFound``) on every rank, naming both sizes and what
to do, before anything is read; an older checkpoint of this world size is loaded only when
asked for by step. Real processes over gloo, a local folder.
"""

from __future__ import annotations

from pathlib import Path

import dist_workers
from rel_util import Recorder

from tierckpt import Checkpointer, LocalTier
from tierckpt.format import CheckpointId


def _ids(root: Path) -> list[CheckpointId]:
    with Checkpointer([LocalTier(root)]) as ck:
        return ck.checkpoints()


def test_a_restart_with_another_world_size_is_refused_and_keeps_the_run(
    tmp_path: Path, record: Recorder
) -> None:
    root = tmp_path / "run"
    first = dist_workers.run("w_world_size_resume", 2, root=str(root), steps=3, timeout=180)
    assert all(r["saved"] == [1, 3] for r in first), first
    before = _ids(root)
    assert before == [CheckpointId(2, 0), CheckpointId(3, 0)], before
    grown = dist_workers.run("w_world_size_resume", 3, root=str(root), steps=3, timeout=180)
    for r in grown:  # every rank: refused, not "not found" (which the resume idiom catches)
        assert "not_found" not in r and "saved" not in r, r
        msg = r["mismatch"]
        assert "step 3" in msg and "saved by 2 ranks" in msg, msg
        assert "this job has 3" in msg and "restart with 2 ranks" in msg, msg
    assert _ids(root) == before  # nothing of the run deleted, nothing new written
    again = dist_workers.run("w_world_size_resume", 2, root=str(root), steps=1, timeout=180)
    assert all(r["loaded"] == [3, 2] and r["exact"] and r["saved"] == [4, 4] for r in again)
    record(
        "distributed",
        "a 2-rank run restarted with 3 ranks (the example's resume idiom)",
        "WorldSizeMismatch on every rank naming both sizes; the run's checkpoints kept; "
        "restarted with 2 ranks it resumed from step 3 bit-exact",
    )


def test_an_older_checkpoint_of_this_world_size_is_loaded_when_asked_for(
    tmp_path: Path, record: Recorder
) -> None:
    root = tmp_path / "run"
    keep = {"keep_last": None, "timeout": 180}
    dist_workers.run("w_world_size_resume", 3, root=str(root), steps=2, **keep)
    # a 2-rank run started on the same folder without loading: timeline 1, newer
    dist_workers.run("w_world_size_resume", 2, root=str(root), steps=2, fresh=True, **keep)
    assert _ids(root)[-1] == CheckpointId(2, 1), _ids(root)
    res = dist_workers.run("w_world_size_resume", 3, root=str(root), steps=1, **keep)
    for r in res:  # the newest is the 2-rank run's: refused, whatever older steps exist
        assert "saved by 2 ranks" in r.get("mismatch", ""), r
    # the way out the message gives: this world size's own checkpoint, by step
    res = dist_workers.run(
        "w_world_size_resume", 3, root=str(root), steps=0, step=2, timeline=0, **keep
    )
    assert all(r["loaded"] == [2, 3] and r["exact"] for r in res), res
    record(
        "distributed",
        "a 3-rank job whose newest checkpoint is a 2-rank run's, its own older ones kept",
        "WorldSizeMismatch on every rank; load(step=2, timeline=0) then loaded its own step "
        "bit-exact",
    )
