"""A rank that misses one save costs that step only.

Every rank must call ``save()`` with the same steps. A rank that skipped one (a bug in the
caller: a condition evaluated differently on one rank) used to break every later checkpoint:
the attempt id each rank wrote into its completion record counted the saves it had made, so
after the skip rank 1's records named attempt ``n - 1`` where rank 0 expected ``n``; rank 0
took them for a dead attempt's, and no later step committed until the job restarted, each
failing after the commit timeout (10 minutes by default) with a message blaming a dead rank.

Now the attempt id names the step and timeline and counts retries of that step only, so the
ranks' later saves name the same attempts: the skipped step is not committed (rank 0 times
out on it, and says a rank may not have saved it), and the next ones commit. Two ranks over gloo.
"""

from __future__ import annotations

from pathlib import Path

import dist_workers
from rel_util import Recorder

from tierckpt import Checkpointer, LocalTier


def test_a_rank_that_skipped_one_save_costs_that_step_only(
    tmp_path: Path, record: Recorder
) -> None:
    root = tmp_path / "run"
    res = dist_workers.run(
        "w_skip_one_save",
        2,
        root=str(root),
        env={"TIERCKPT_COMMIT_TIMEOUT_S": "5"},
        timeout=240,
    )
    rank0 = res[0]
    assert "did not call save() for this step" in rank0["3"], rank0["3"]
    assert all(rank0[s] == "ok" for s in ("1", "2", "4", "5")), rank0
    with Checkpointer([LocalTier(root)]) as ck:
        assert ck.steps() == [1, 2, 4, 5]
    with Checkpointer([LocalTier(root)], rank=1, world_size=2) as ck:
        for step in (4, 5):
            assert float(ck.load(step)["w"][0]) == 100 + step
    record(
        "distributed",
        "rank 1 skipped step 3 of 5 (2 ranks)",
        "step 3 not committed (rank 0 timed out on it, naming a missed save); 4 and 5 committed",
    )
