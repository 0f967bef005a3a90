"""Running one demo child process and collecting what it reports (progress, commits, restores)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BUCKET = "tierckpt-demo"
#: a child that makes no progress for this long is killed (never hang)
CHILD_TIMEOUT_S = 600


# -- running a child ------------------------------------------------------------------------------
@dataclass
class ChildRun:
    """Everything one child process reported."""

    name: str
    log_path: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)
    blocked: dict[int, float] = field(default_factory=dict)
    torch_saves: list[dict[str, Any]] = field(default_factory=list)
    restored: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    killed_at: int | None = None
    returncode: int | None = None
    wall_seconds: float = 0.0


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None,
        leave=True,
        bar_format="{desc:<34} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
        "[{elapsed}<{remaining}]{postfix}",
    )


def _on_tier(commits: list[dict[str, Any]], tier: str, step: int) -> bool:
    return any(c.get("tier") == tier and int(c.get("step", -1)) >= step for c in commits)


def _on_s3(commits: list[dict[str, Any]], step: int) -> bool:
    return _on_tier(commits, "s3", step)


def start_child(
    argv: list[str], env: dict[str, str], log_path: str, *, wait_go: bool = False
) -> subprocess.Popen[str]:
    """Start ``python -m tierckpt.demo.train argv``, its stderr into ``log_path``. With
    ``wait_go`` it imports and builds its model, then waits for :func:`run_child` before it
    opens a tier (started early, its start-up overlaps the previous child's training)."""
    with open(log_path, "w"):
        pass  # the child and the parent both append (stderr, and stray stdout lines)
    with open(log_path, "a") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tierckpt.demo.train", *argv]
            + (["--wait-go"] if wait_go else []),
            stdin=subprocess.PIPE if wait_go else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            bufsize=1,
        )


def run_child(
    name: str,
    proc: subprocess.Popen[str],
    log_path: str,
    *,
    total: int,
    first_step: int = 1,
    kill_when: Callable[[int, list[dict[str, Any]]], bool] | None = None,
) -> ChildRun:
    """Let the child ``proc`` (:func:`start_child`) go and follow it to its end; SIGKILL it
    once ``kill_when(step, commits)`` (the commit events seen so far) holds."""
    run = ChildRun(name, log_path)
    t0 = time.perf_counter()
    if proc.stdin is not None:
        try:
            proc.stdin.write("go\n")
            proc.stdin.close()
        except OSError:
            pass  # it died already: its exit status and log say why
    with open(log_path, "a") as log:
        watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        bar = _bar(total, name)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    log.write(line)
                    continue
                kind = ev.pop("ev", "")
                if kind == "loss":
                    step = int(ev["step"])
                    run.losses[step] = float(ev["loss"])
                    bar.update(1)
                    bar.set_postfix_str(f"loss {ev['loss']:.4f}", refresh=False)
                    kill = kill_when is not None and run.killed_at is None
                    if kill and kill_when is not None and kill_when(step, run.commits):
                        os.kill(proc.pid, signal.SIGKILL)
                        run.killed_at = step
                elif kind == "commit":
                    run.commits.append(ev)
                elif kind == "blocked":
                    run.blocked[int(ev["step"])] = float(ev["seconds"])
                elif kind == "torch_save":
                    run.torch_saves.append(ev)
                elif kind == "restored":
                    run.restored = ev
                    bar.update(int(ev["step"]) - first_step + 1)
                elif kind == "done":
                    run.done = ev
            run.returncode = proc.wait()
        finally:
            watchdog.cancel()
            bar.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run.wall_seconds = time.perf_counter() - t0
    return run
