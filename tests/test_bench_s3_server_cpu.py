"""benchmarks/bench_s3_server_cpu.py's measurement: per run, the case's own seconds where it
returns them (a tier save's time to commit, not its retention's), the server's CPU read from a
quiet server to a quiet server."""

from __future__ import annotations

import pytest
from helpers import load_benchmark

pytest.importorskip("obstore", reason="the bench imports the tiers' drivers")


def test_measure_counts_per_run_and_waits_for_a_quiet_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    load_benchmark("bench_s3_drivers")
    bench = load_benchmark("bench_s3_server_cpu")
    # the server: 0.5 s of CPU per call of the case, and 0.2 s more after it answered, spent
    # 0.05 s per poll (a server deleting chunks after its answer)
    cpu = {"now": 0.0, "trail": 0.0}

    def server_cpu() -> float:
        step = min(0.05, cpu["trail"])
        cpu["now"] += step
        cpu["trail"] -= step
        return cpu["now"]

    def case() -> float:
        cpu["now"] += 0.5
        cpu["trail"] += 0.2
        return 0.25

    monkeypatch.setattr(bench, "children_cpu", server_cpu)
    monkeypatch.setattr(bench, "POLL_S", 0.0)
    got = bench.measure(case, 2)
    assert got["wall"] == pytest.approx(0.25)  # the case's own seconds, per run
    assert got["server"] == pytest.approx(0.7)  # the trailing work counted, per run
