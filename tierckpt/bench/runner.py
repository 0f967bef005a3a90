"""Orchestration: one fresh interpreter per size and contender (and one for the training
loop), results back through JSON files, plus what the machine and versions were."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.config import LABELS, BenchConfig
from tierckpt.bench.probes import default_bench_dir, filesystem_of
from tierckpt.bench.report import summarize_size, summarize_train
from tierckpt.bench.save import save_worker
from tierckpt.bench.train import train_worker

#: judges a finished run against goals: ``result -> [{"target", "value", "limit", "met",
#: "detail"}, ...]`` (the repository's ``benchmarks/targets.py`` holds the project's own)
TargetsFn = Callable[[dict[str, Any]], list[dict[str, Any]]]


def _spawn(kind: str, name: str, gib: float, directory: str, cfg: BenchConfig) -> dict[str, Any]:
    """Run one worker in a fresh interpreter; its result comes back through a JSON file."""
    fd, result = tempfile.mkstemp(prefix="tierckpt-bench-", suffix=".json", dir=directory)
    os.close(fd)
    spec = {
        "kind": kind,
        "name": name,
        "gib": gib,
        "dir": directory,
        "result": result,
        "cfg": cfg_to_json(cfg),
    }
    cmd = [sys.executable, "-m", "tierckpt.bench", "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, timeout=cfg.worker_timeout_s, check=False)
        if proc.returncode != 0:
            return {"error": f"worker exited with status {proc.returncode}", "contender": name}
        with open(result) as f:
            out: dict[str, Any] = json.load(f)
        return out
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {cfg.worker_timeout_s:.0f} s", "contender": name}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result)


def cfg_to_json(cfg: BenchConfig) -> dict[str, Any]:
    return asdict(cfg)


def cfg_from_json(d: dict[str, Any]) -> BenchConfig:
    d = dict(d)
    for k in ("sizes_gib", "contenders", "train_variants"):
        d[k] = tuple(d[k])
    return BenchConfig(**d)


def worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    cfg = cfg_from_json(spec["cfg"])
    load0 = _loadavg()
    if spec["kind"] == "save":
        res = save_worker(spec["name"], float(spec["gib"]), spec["dir"], cfg)
    else:
        res = train_worker(spec["dir"], cfg)
    res["loadavg"] = {"start": load0, "end": _loadavg()}
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    return 0


def _available(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if name == "tc_async":
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError:
            return "torch-checkpointing is not installed (pip install torch-checkpointing)"
    return None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import tierckpt

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tierckpt": tierckpt.__version__,
    }
    for pkg in ("torch-checkpointing", "psutil", "xxhash"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_revision() -> str | None:
    """The repository's commit (+ "-dirty" with uncommitted changes), when run from a clone."""
    root = Path(__file__).resolve().parents[2]  # tierckpt/bench/runner.py -> the clone
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() or None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def _machine() -> dict[str, Any]:
    import psutil

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpus": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpu": gpu,
        "platform": platform.platform(),
    }


def run_bench(
    cfg: BenchConfig,
    *,
    log: Callable[[str], None] = print,
    argv: Sequence[str] | None = None,
    targets: TargetsFn | None = None,
) -> dict[str, Any]:
    """Run every contender for every size, then the training loop; return the results.

    ``targets``, when given, judges the results; its verdicts go under ``"targets"`` (the
    installed package holds no goals of its own: ``benchmarks/bench_save.py`` passes the
    project's).
    """
    base = cfg.directory or default_bench_dir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tierckpt-bench-", dir=base)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m tierckpt.bench", *(argv or [])]),
            "machine": _machine(),
            "versions": _versions(),
            "git": _git_revision(),
            "loadavg_start": _loadavg(),
            "directory": work,
            "filesystem": filesystem_of(work),
            "config": cfg_to_json(cfg),
        },
        "sizes": [],
        "train": None,
    }
    try:
        for gib in cfg.sizes_gib:
            entry: dict[str, Any] = {"gib": gib, "contenders": {}, "skipped": {}}
            for name in cfg.contenders:
                why = _available(name)
                if why:
                    entry["skipped"][name] = why
                    log(f"[{gib:g} GiB] {name}: skipped ({why})")
                    continue
                t0 = time.perf_counter()
                log(f"[{gib:g} GiB] {LABELS[name]} ...")
                res = _spawn("save", name, gib, work, cfg)
                if "error" in res:
                    log(f"[{gib:g} GiB] {name}: FAILED: {res['error']}")
                else:
                    log(f"[{gib:g} GiB] {name}: done in {time.perf_counter() - t0:.0f} s")
                entry["contenders"][name] = res
            entry["summary"] = summarize_size(entry)
            result["sizes"].append(entry)
        if cfg.train_variants:
            log(f"[train] {', '.join(cfg.train_variants)}, interleaved ...")
            train: dict[str, Any] = _spawn("train", "train", 0.0, work, cfg)
            if "error" not in train:
                train["summary"] = summarize_train(train)
            result["train"] = train
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    result["meta"]["loadavg_end"] = _loadavg()
    if targets is not None:
        result["targets"] = targets(result)
    return result
