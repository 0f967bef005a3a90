"""benchmarks/bench_s3_drivers.py's rounds: a contender that fails (s3torchconnector timing
out under load) is reported with its error and left out of later rounds; the others finish."""

from __future__ import annotations

import pytest
from helpers import load_benchmark

pytest.importorskip("obstore", reason="the bench imports the tiers' drivers")


def test_a_failing_contender_is_reported_and_the_others_finish() -> None:
    calls = {"ok": 0, "flaky": 0}

    def ok() -> float:
        calls["ok"] += 1
        return 1.0

    def flaky() -> float:
        calls["flaky"] += 1
        if calls["flaky"] == 2:
            raise TimeoutError("S3 request timed out")  # as s3torchconnector's client did
        return 2.0

    cases = {"save": {"raw ok": ok, "raw flaky": flaky}}
    samples, failed = load_benchmark("bench_s3_drivers").run_rounds(
        cases, ["save"], warmup=1, runs=3
    )
    assert calls == {"ok": 4, "flaky": 2}  # never run again once it failed
    assert samples["wall"]["save"]["raw ok"] == [1.0, 1.0, 1.0]
    assert "TimeoutError: S3 request timed out" in failed["save"]["raw flaky"]
    assert len(samples["cpu"]["save"]["raw ok"]) == len(samples["server"]["save"]["raw ok"]) == 3
