"""benchmarks/bench_load_rtt.py runs end to end (SeaweedFS on 127.0.0.1, the fault proxy
delaying every request) and shows what a load sends: a LIST, then the manifest's GET and the
shard file's tail GET together (the tail sent before the manifest's answer came: they
overlap), then the data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("obstore")
pytestmark = pytest.mark.s3

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import bench_load_rtt  # noqa: E402


def test_bench_load_rtt_shows_the_tail_read_beside_the_manifest(tmp_path: Path) -> None:
    out = tmp_path / "rtt.json"
    rc = bench_load_rtt.main(
        ["--rtt", "0.2", "--runs", "1", "--mib", "0.05", "--tensors", "3", "--json", str(out)]
    )
    assert rc == 0
    got = json.loads(out.read_text())
    assert set(got["loads"]) == {"this rtt=0.2"}
    assert got["loads"]["this rtt=0.2"]["median_s"] >= 0.2 * 3  # LIST, manifest+tail, data
    reqs = got["requests"]["this"]
    assert [r["kind"] for r in reqs] == ["LIST", "GET", "GET", "GET"], reqs
    manifest = next(r for r in reqs if r["kind"] == "GET" and r["object"].startswith("manifests/"))
    tails = [r for r in reqs if r["object"].endswith(".tck")]
    assert manifest["answered_ms"] is not None
    # the tail GET went out before the manifest's answer (which waited 200 ms) came back
    assert tails[0]["sent_ms"] < manifest["answered_ms"], reqs
    assert tails[1]["sent_ms"] > manifest["answered_ms"], reqs  # the data: after both
