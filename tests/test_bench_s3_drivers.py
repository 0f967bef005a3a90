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


def test_each_round_runs_every_case_once_in_its_own_order() -> None:
    """No case always follows the same one (an upload's aftermath slows the next case)."""

    def record(order: list[str], name: str) -> float:
        order.append(name)
        return 1.0

    names = [f"raw {c}" for c in "abcdef"]

    def rounds() -> list[list[str]]:
        order: list[str] = []
        cases = {"save": {n: (lambda n=n: record(order, n)) for n in names}}
        load_benchmark("bench_s3_drivers").run_rounds(cases, ["save"], warmup=1, runs=7)
        return [order[i : i + len(names)] for i in range(0, len(order), len(names))]

    got = rounds()
    assert len(got) == 8 and all(sorted(r) == names for r in got)
    follows = {(r[i - 1], r[i]) for r in got for i in range(1, len(r))}
    predecessors = {b: {a for a, c in follows if c == b} for b in names}
    assert all(len(p) >= 2 for p in predecessors.values()), predecessors
    assert rounds() == got  # seeded: the same orders in every run


def test_timeline_says_what_overlaps_the_parts_and_what_follows_them() -> None:
    """``--count-requests``' timeline: the parts' first send and last answer, every other
    request of the timed span with its times (ms from the call), and which of them were sent
    only once the last part was answered; a request sent after the span is left out."""
    from tierckpt.testing.faultproxy import RequestRecord

    bench = load_benchmark("bench_s3_drivers")
    t0 = 100.0
    key = "/b/k"

    def rec(method: str, query: str, sent_ms: float, answered_ms: float | None) -> RequestRecord:
        answered = None if answered_ms is None else t0 + answered_ms / 1e3
        return RequestRecord(method, f"{key}{query}", None, t0 + sent_ms / 1e3, answered)

    records = [
        rec("POST", "?uploads", 17, 19),
        rec("HEAD", "", 5, 8),
        rec("PUT", "?partNumber=2&uploadId=u", 40, 900),
        rec("PUT", "?partNumber=1&uploadId=u", 36, 2000),
        rec("GET", "", 1500, 1560),  # overlaps the parts
        rec("POST", "?uploadId=u", 2005, 2012),
        rec("PUT", "", 2013, None),  # no answer came
        rec("POST", "?delete", 2300, 2310),  # after the timed span: retention
    ]
    tl = bench.timeline(records, t0, span=2.1)
    assert tl["span_ms"] == 2100.0
    assert tl["parts"] == 2
    assert tl["first_part_sent_ms"] == 36.0
    assert tl["last_part_answered_ms"] == 2000.0
    assert tl["others"] == [
        ["HEAD object", 5.0, 8.0],
        ["POST create-upload", 17.0, 19.0],
        ["GET object", 1500.0, 1560.0],
        ["POST complete", 2005.0, 2012.0],
        ["PUT object", 2013.0, None],
    ]
    assert tl["after_parts"] == [["POST complete", 2005.0, 2012.0], ["PUT object", 2013.0, None]]
