"""A short seeded run of ``benchmarks/chaos.py``: a training job killed (SIGKILL, SIGTERM) at
random moments and restarted, rolled back to an older step now and then, its local folder
deleted before some restarts, S3 failing or hanging meanwhile. Every restart's ``load()`` must
return a state the job saved, byte for byte, not older than the newest commit reported before
the kill (see the script's docstring); the job must raise nothing into its loop."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.s3
@pytest.mark.parametrize("seed", [7, 11])
def test_a_job_killed_rolled_back_and_cut_off_from_s3_loses_nothing_committed(
    tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import chaos

    rc = chaos.main(["--rounds", "6", "--seed", str(seed), "--dir", str(tmp_path)])
    assert rc == 0, (tmp_path / "log.jsonl").read_text()[-4000:]
    recs = chaos._records(tmp_path / "log.jsonl")
    loads = [r for r in recs if r["ev"] == "loaded"]
    assert len(loads) == 7  # each round's restart and the final one were checked
    assert any(r["ev"] == "committed" and r["tier"] == "s3" for r in recs)


def test_the_checks_catch_a_lost_commit_and_a_wrong_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules themselves, on made-up logs: a load older than a reported commit, a state
    saved by nobody, and a local commit lost with its deleted folder (allowed)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import chaos

    def saving(step: int, sha: str) -> dict[str, object]:
        return {"ev": "saving", "pid": 1, "step": step, "sha": sha}

    def committed(step: int, tier: str) -> dict[str, object]:
        return {"ev": "committed", "pid": 1, "step": step, "timeline": 0, "tier": tier}

    def loaded(step: int, sha: str) -> dict[str, object]:
        return {"ev": "loaded", "pid": 2, "step": step, "sha": sha, "rollback": False}

    log = [saving(1, "a"), committed(1, "local"), committed(1, "s3"), saving(2, "b")]
    log += [committed(2, "local")]
    assert chaos.check_load([*log, loaded(2, "b")]) is None
    assert "older than" in (chaos.check_load([*log, loaded(1, "a")]) or "")
    assert "no state" in (chaos.check_load([*log, loaded(2, "x")]) or "")
    # the folder holding step 2's only copy was deleted: step 1 from S3 is what is left
    assert chaos.check_load([*log, {"ev": "wiped"}, loaded(1, "a")]) is None
