"""Every rank of a job ends a load alike.

A multi-rank reader beside a trainer with ``keep_last`` (an evaluator) could see retention
delete one rank's shard of the chosen step after the ranks had agreed on it: that rank raised
``CheckpointNotFound`` while the others returned the state (118 of ~3,360 loads in a field
test), so the ranks went on with different states, and one took a path the others did not (a
different collective: a hang until the process group's timeout). The single-rank retry
(list again, load the newest) did not apply to several ranks.

Now the ranks agree on the load's outcome (one all-reduce): where any rank's read found the
checkpoint gone, every rank lists again and loads the newest together; any other failure makes
the load fail on every rank. Two ranks over gloo; rank 1's first read fails as a deleted
shard's would.
"""

from __future__ import annotations

from pathlib import Path

import dist_workers
from rel_util import Recorder


def test_a_shard_vanishing_on_one_rank_is_loaded_again_by_every_rank(
    tmp_path: Path, record: Recorder
) -> None:
    root = str(tmp_path / "run")
    dist_workers.run("w_load_one_rank_vanishes", 2, root=root, save=True, timeout=180)
    res = dist_workers.run("w_load_one_rank_vanishes", 2, root=root, save=False, timeout=180)
    assert all("error" not in r for r in res), res  # no rank raised while another returned
    assert [r["step"] for r in res] == [3, 3], res
    assert [r["w"] for r in res] == [3.0, 13.0], res  # each rank its own shard of step 3
    record(
        "distributed",
        "rank 1's shard of the agreed step vanished while read (2 ranks)",
        "every rank listed again and loaded step 3 together; none returned alone",
    )


def test_load_into_writes_nothing_on_a_rank_when_another_ranks_load_failed(
    tmp_path: Path, record: Recorder
) -> None:
    """``load(into=...)`` copied the checkpoint into this rank's tensors before the ranks
    agreed on the outcome: where rank 1's shard was corrupt, rank 0's model was overwritten
    and then its load raised anyway (a model half restored across ranks, which a job that
    catches the error trains on). The copy now waits for the agreement."""
    root = str(tmp_path / "run")
    dist_workers.run("w_load_into_one_rank_fails", 2, root=root, save=True, timeout=180)
    res = dist_workers.run("w_load_into_one_rank_fails", 2, root=root, save=False, timeout=180)
    assert [r["error"] for r in res] == ["TierCkptError", "CorruptCheckpoint"], res
    assert [r["written"] for r in res] == [False, False], res
    record(
        "distributed",
        "load(into=...) while another rank's shard is corrupt (2 ranks)",
        "every rank raised; no rank's into tensors were written",
    )
