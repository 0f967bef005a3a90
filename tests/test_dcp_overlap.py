"""``dcp.async_save`` calls that overlap on one reused ``TierWriter`` (each on its own process
group): every save keeps its own step, plan and commit, so a future that reports success means
that checkpoint is committed, with its own data (``tierckpt.dcp._saves``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dist_workers
import pytest

from tierckpt.format import manifest_name

pytestmark = pytest.mark.distributed


def _verify(root: Path) -> subprocess.CompletedProcess[str]:
    cli = [sys.executable, "-m", "tierckpt", "verify", str(root / "ck")]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120)


def test_two_async_saves_in_flight_on_one_writer_both_commit_their_own_data(
    tmp_path: Path,
) -> None:
    """Step 1's save begins first but plans after step 2's (on every rank): before, step 2's
    reset() overwrote the writer's step under step 1, and one save failed ("already exists")
    while the other committed a mix of both, or step 1 was lost and step 2 read step 1's data.
    Now both commit, on timeline 0 (step 1 is not a rollback of step 2 in flight beside it)."""
    res = dist_workers.run("dcp_overlap_workers:w_overlap", 2, root=str(tmp_path), timeout=240)
    for rank, r in enumerate(res):
        assert r["save1"] == "ok" and r["save2"] == "ok", r
        assert r["load1"] == {"x0": 10.0 + rank, "step": 1, "id": "step 1"}, r
        assert r["load2"] == {"x0": 20.0 + rank, "step": 2, "id": "step 2"}, r
    ck = tmp_path / "ck"
    assert (ck / manifest_name(1)).exists() and (ck / manifest_name(2)).exists()
    assert not (ck / manifest_name(1, timeline=1)).exists()
    done = _verify(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_two_async_saves_of_one_step_in_flight_commit_one_of_them_whole(tmp_path: Path) -> None:
    """The same step twice at once: one save is refused, and the checkpoint is the other's."""
    res = dist_workers.run(
        "dcp_overlap_workers:w_overlap", 2, root=str(tmp_path), same_step=True, timeout=240
    )
    for rank, r in enumerate(res):
        ok = [name for name in ("save1", "save2") if r[name] == "ok"]
        assert len(ok) == 1, r
        # save1 saves the values of step 1, save2 those of 101 (both as step 1)
        want = 1 if ok == ["save1"] else 101
        assert r["load1"]["x0"] == want * 10 + rank and r["load1"]["step"] == want, r
    done = _verify(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
