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

import subprocess
import sys
from pathlib import Path

import dist_workers
from rel_util import Recorder

from tierckpt.format import manifest_name, shard_name


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


def _steps(folder: Path) -> list[int]:
    from tierckpt.backends.local import LocalBackend
    from tierckpt.catalog import committed_ids

    return [c.step for c in committed_ids(LocalBackend(folder, create=False))]


def test_node_private_copies_a_step_apart_load_the_newest_every_node_holds(
    tmp_path: Path, record: Recorder
) -> None:
    """Node-local folders (``TIERCKPT_PRIVATE_TIERS``): each node writes the job's manifest onto
    its own copy. Two ways left one node a step behind the other, both seen in a field test
    (2 ranks, gloo):

    - a clean finish: rank 0 hosts the process group's store (a job started from
      ``MASTER_ADDR``), and its process exited right after ``close()``, before rank 1 had
      fetched the last manifest (4 of 4 runs);
    - a crash between the two nodes' manifest writes.

    Then the default ``load()`` raised on every rank "checkpoint step 3 is committed but could
    not be read (damaged ...)": each rank offered only its own newest step. Now rank 0 waits
    (bounded) for the other nodes' copies before its commit ends, and a load without a
    fallback takes the newest step every rank lists; a damaged one still fails the load."""
    root = tmp_path / "run"
    env = {"TIERCKPT_PRIVATE_TIERS": "nvme"}
    res = dist_workers.run(
        "node_lag_workers:w_train_then_exit", 2, root=str(root), slow_fetch_s=1.5, env=env
    )
    assert [r["errors"] for r in res] == [[], []], res
    assert _steps(root / "nvme-0") == _steps(root / "nvme-1") == [1, 2, 3]
    # a node's folder holds its own ranks' files: verify and gc check those (they said every
    # checkpoint there was damaged: the other rank's file "does not exist")
    for node in ("nvme-0", "nvme-1"):
        cli = [sys.executable, "-m", "tierckpt"]
        got = subprocess.run([*cli, "verify", str(root / node)], capture_output=True, text=True)
        assert got.returncode == 0 and got.stdout.count("a node-local copy") == 3, got
        got = subprocess.run(
            [*cli, "gc", "--dry-run", "--keep-last", "1", str(root / node)],
            capture_output=True,
            text=True,
        )
        assert got.returncode == 0 and "DAMAGED" not in got.stdout + got.stderr, got
        assert "would delete 2 expired checkpoint(s): 1, 2" in got.stdout, got

    # a crash before node 1 wrote step 3's manifest: node 0 is a step ahead
    (root / "nvme-1" / manifest_name(3)).unlink()
    res = dist_workers.run(
        "node_lag_workers:w_load_newest", 2, root=str(root), fallback="error", env=env
    )
    assert [(r.get("step"), r.get("diff"), r.get("error")) for r in res] == [
        (2, [], None),
        (2, [], None),
    ], res

    # the newest step every node holds is damaged on node 1: no silent older step
    shard = root / "nvme-1" / shard_name(2, 1)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = dist_workers.run(
        "node_lag_workers:w_load_newest", 2, root=str(root), fallback="error", env=env
    )
    assert [r.get("error") for r in res] == ["TierCkptError", "CorruptCheckpoint"], res
    res = dist_workers.run(
        "node_lag_workers:w_load_newest", 2, root=str(root), fallback="previous", env=env
    )
    assert [(r.get("step"), r.get("diff")) for r in res] == [(1, []), (1, [])], res
    # the node's only rank's file gone: damage, not another node's rank
    (root / "nvme-1" / shard_name(1, 1)).unlink()
    got = subprocess.run(
        [sys.executable, "-m", "tierckpt", "verify", str(root / "nvme-1"), "--step", "1"],
        capture_output=True,
        text=True,
    )
    assert got.returncode == 1 and "holds none of its 2 ranks' shard files" in got.stderr, got
    record(
        "distributed",
        "node-private copies a step apart: rank 0 exits at once after close(), or a crash "
        "between the nodes' manifest writes (2 ranks)",
        "every node holds the last step; a node a step ahead loads the newest step every node "
        "holds; a damaged one still fails the load",
    )


def test_a_rank_whose_tier_fails_whole_is_heard_of_at_once(
    tmp_path: Path, record: Recorder
) -> None:
    """One rank's writes to a shared tier fail, its failure record too (a field test: one
    rank's S3 path answering 500s): rank 0 waited out the commit timeout on every step (89 s
    for 12 steps at a 30 s timeout). The rank now tells rank 0 through the process group's
    store."""
    res = dist_workers.run(
        "node_lag_workers:w_rank_store_fails", 2, root=str(tmp_path / "run"), timeout=240
    )
    assert res[0]["error"] and "reported through the process group's store" in res[0]["error"]
    assert "rank 1" in res[0]["error"], res[0]
    assert res[0]["seconds"] < 30, res  # not the 60 s commit timeout
    assert res[1]["error"], res[1]
    assert _steps(tmp_path / "run" / "shared") == [1]
    record(
        "distributed",
        "one rank's writes to a shared tier fail, its failure record too (2 ranks)",
        f"rank 0 heard of it through the store in {res[0]['seconds']:.1f} s, not the "
        "commit timeout; nothing committed",
    )


def test_a_rank_whose_listing_missed_the_newest_shared_step_lists_again(tmp_path: Path) -> None:
    """Ranks list a shared tier differently only by a race or a listing that failed: the
    ranks list again rather than load the newest every rank happened to list (an older
    step, on which the job would go on a new timeline)."""
    root = str(tmp_path / "run")
    dist_workers.run("node_lag_workers:w_racing_listing", 2, root=root, phase="save")
    res = dist_workers.run("node_lag_workers:w_racing_listing", 2, root=root, phase="load")
    assert [(r["step"], r["diff"]) for r in res] == [(3, []), (3, [])], res
    assert [r["load_once_calls"] for r in res] == [2, 2], res  # listed again, together


def test_a_state_mismatch_on_one_rank_walks_back_to_no_older_checkpoint(tmp_path: Path) -> None:
    root = str(tmp_path / "run")
    dist_workers.run("node_lag_workers:w_racing_listing", 2, root=root, phase="save")
    res = dist_workers.run("node_lag_workers:w_racing_listing", 2, root=root, phase="mismatch")
    assert [r["error"] for r in res] == ["TierCkptError", "StateMismatch"], res
    assert [r["load_once_calls"] for r in res] == [1, 1], res
