"""benchmarks/bench_disk_reuse.py: each variant writes what it says (the reuse variant
overwrites the file two steps old, the fresh one writes new files), and a tiny run reports
every variant against the baseline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import load_benchmark


@pytest.mark.parametrize("variant,same_file", [("reuse", True), ("fresh", False)])
def test_the_writer_reuses_only_when_asked(tmp_path: Path, variant: str, same_file: bool) -> None:
    bench = load_benchmark("bench_disk_reuse")
    w = bench.Writer(str(tmp_path), 1)
    w.write(variant)
    fd = os.open(tmp_path / "f0", os.O_RDONLY)  # held: its inode number cannot be reused
    try:
        w.write(variant)
        w.write(variant)  # step 2: the file of step 0 goes
        assert sorted(os.listdir(tmp_path)) == ["f1", "f2"]
        assert ((tmp_path / "f2").stat().st_ino == os.fstat(fd).st_ino) is same_file
        assert (tmp_path / "f2").read_bytes() == bytes(w.buf)
    finally:
        os.close(fd)
        w.close()


def test_a_tiny_run_reports_every_variant(tmp_path: Path) -> None:
    argv = ["--dir", str(tmp_path), "--rounds", "1", "--block", "1", "--mib", "1"]
    res = load_benchmark("bench_disk_reuse").main(argv)
    assert set(res) == {"none", "fresh", "reuse", "buffered"}
    assert res["none"]["ratio_median"] == 1.0
    assert all(r["step_median_s"] > 0 and r["write_median_s"] >= 0 for r in res.values())
    assert res["reuse"]["write_median_s"] > 0 and os.listdir(tmp_path) == []
