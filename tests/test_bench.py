"""`make bench` (benchmarks/bench_save.py over tierckpt.bench) end to end at a tiny size: the
per-stage breakdown of tierckpt's save has real numbers for every stage, and the project's
targets are judged by the repository's benchmarks/targets.py, not by the installed package."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_save_reports_a_per_stage_breakdown_and_the_targets(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_save.py"),
            "--sizes",
            "0.01",
            "--runs",
            "1",
            "--warmup",
            "0",
            "--compute-s",
            "0.05",
            "--contenders",
            "tierckpt_256m",
            "--train",
            "",
            "--dir",
            str(tmp_path),
            "--json",
            str(out_json),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads(out_json.read_text())
    entry = result["sizes"][0]["contenders"]["tierckpt_256m"]
    rows = {(r["stage"], r["tier"]): r for r in entry["breakdown"]["stages"]}
    raw = entry["state"]["nbytes"]
    for key in [
        ("capture", None),
        ("checksum", None),
        ("write", "local"),
        ("sync", "local"),
        ("commit", "local"),
    ]:
        assert key in rows, f"no {key} in the breakdown: {sorted(rows, key=str)}"
        assert rows[key]["seconds"] > 0 and rows[key]["events"] >= 1
    assert rows[("capture", None)]["nbytes"] == raw
    assert rows[("write", "local")]["nbytes"] >= raw
    # printed as a table, and the project's targets judged after it
    assert "Per-stage breakdown of one immediate save" in proc.stdout
    assert "| capture | all |" in proc.stdout and "| write | local |" in proc.stdout
    assert "### Targets" in proc.stdout
    assert any("lazy blocked" in t["target"] for t in result["targets"])


def test_the_installed_package_holds_no_targets() -> None:
    import tierckpt.bench as bench
    import tierckpt.bench.report as report

    assert not hasattr(bench, "evaluate_targets") and not hasattr(report, "evaluate_targets")
    table = report.format_table({"meta": {"config": {}}, "sizes": [], "train": None})
    assert "Targets" not in table
