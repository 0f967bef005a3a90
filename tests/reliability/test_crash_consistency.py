"""Crash consistency: SIGKILL a training process at named points and at random moments.

A child process (``crash_child.py``) trains a small model and checkpoints every step to a local
tier and an S3 tier (moto, served by this test process so it survives the kill). It is killed
mid-capture, mid-write, mid-upload, between data and manifest, inside the manifest put, during
retention, or at a random moment. The next child is a fresh process: its ``load()`` must return
exactly the state of the newest step committed on any tier: the newest whose commit (on every
tier) the log recorded, or a newer one that committed before its log line was written (the
save in flight, or an earlier run's save that committed on the local tier but was killed
during its S3 upload), or the one before it — never a torn state, never an error while an
older committed checkpoint exists. Training resumed from a
restored state must reproduce the same states (so every restore was bit-exact), saves after a
kill must commit, and leftovers of killed saves must be gone after the next saves plus gc.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from rel_util import Recorder, local_leftovers, s3_leftovers, state_hash

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.retention import gc_tier

pytestmark = pytest.mark.s3

HERE = Path(__file__).parent
CHILD = HERE / "crash_child.py"
ROOT = HERE.parent.parent

#: kill point -> range of N for "the N-th hit" (hits per save: ~13 chunks, ~15 pwrites,
#: 2 S3 parts, 1 manifest per tier, 2 retention deletes per tier once 3 steps exist)
POINTS: dict[str, tuple[int, int]] = {
    "capture": (1, 30),
    "local_write": (1, 30),
    "local_commit": (1, 3),
    "local_manifest": (1, 3),
    "local_link": (1, 3),
    "local_linked": (1, 3),
    "s3_part": (1, 6),
    "s3_complete": (1, 3),
    "s3_manifest": (1, 3),
    "after_commit": (1, 3),
    "gc_manifest": (1, 3),
    "gc_data": (1, 4),
    "random": (0, 0),
}


@dataclass
class Log:
    """The child's fsync'd log, parsed."""

    intents: dict[int, list[str]] = field(default_factory=dict)
    last_intent: int | None = None
    last_commit: int | None = None
    failed: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Log:
        log = cls()
        if not path.exists():
            return log
        for line in path.read_text().splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "intent":
                s, h = rest.split()
                log.intents.setdefault(int(s), []).append(h)
                log.last_intent = int(s)
            elif kind == "commit":
                log.last_commit = int(rest)
            elif kind == "failed":
                log.failed.append(rest)
        return log


class Zygote:
    """``crash_child.py --zygote``: a warm process (torch imported) that forks each child."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), "--zygote"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self.lines.get(timeout=120).get("ready")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def start(self, argv: list[str], env: dict[str, str], stderr: Path) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "stderr": str(stderr)}) + "\n")
        self.proc.stdin.flush()
        return int(self.lines.get(timeout=30)["pid"])

    def kill(self, pid: int) -> None:
        """SIGKILL ``pid`` through the zygote (its parent), unless it already ended."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"kill": pid}) + "\n")
        self.proc.stdin.flush()

    def wait(self, pid: int, timeout: float) -> int:
        try:
            msg = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.kill(pid)
            msg = self.lines.get(timeout=30)
        assert msg["pid"] == pid
        return int(msg["exitcode"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Harness:
    """Runs children (forked from a zygote, or a plain new interpreter) and kills them."""

    def __init__(self, tmp: Path, server: Any, bucket: str) -> None:
        self.tmp = tmp
        self.server = server
        self.bucket = bucket
        self.local = tmp / "nvme"
        self.log = tmp / "commits.log"
        self.env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
        self.env.pop("TIERCKPT_CRASH_AT", None)
        self.zygote = Zygote(self.env)

    def close(self) -> None:
        self.zygote.close()

    def args(self, result: Path, *extra: str) -> list[str]:
        return [
            "--local",
            str(self.local),
            "--endpoint",
            self.server.endpoint_url,
            "--bucket",
            self.bucket,
            "--log",
            str(self.log),
            "--result",
            str(result),
            *extra,
        ]

    def run(
        self,
        n: int,
        point: str | None,
        nth: int = 1,
        *,
        mode: str = "kill",
        delay: float = 0.0,
        saves: int = 3,
        fresh_interpreter: bool = False,
    ) -> tuple[int, list[dict[str, Any]]]:
        """One child; returns its exit code (-9: killed) and its result events."""
        result = self.tmp / f"result-{n}.jsonl"
        stderr = self.tmp / f"stderr-{n}.txt"
        crash: dict[str, str] = {}
        if point and point != "random":
            crash = {"TIERCKPT_CRASH_AT": f"{point}:{nth}", "TIERCKPT_CRASH_MODE": mode}
        argv = self.args(result, "--saves", str(saves))
        proc: subprocess.Popen[bytes] | None = None
        if fresh_interpreter:
            with open(stderr, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, str(CHILD), *argv],
                    env={**self.env, **crash},
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            pid = proc.pid
        else:
            pid = self.zygote.start(argv, crash, stderr)
        deadline = time.monotonic() + 240
        ended = (lambda: proc.poll() is not None) if proc else (lambda: not _alive(pid))
        # proc.kill() and the zygote skip a child that already ended: no stray pid is hit
        kill = proc.kill if proc else (lambda: self.zygote.kill(pid))
        try:
            if point == "random":
                _wait_for(lambda: bool(_events(result, "ready")) or ended(), deadline)
                time.sleep(delay)
                kill()
            elif point and mode == "pause":
                paused = Path(str(result) + ".paused")
                _wait_for(lambda: paused.exists() or ended(), deadline)
                if paused.exists():
                    kill()
        finally:
            left = max(1.0, deadline - time.monotonic())
            if proc is not None:
                try:
                    rc = proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    rc = proc.wait()
            else:
                rc = self.zygote.wait(pid, left)
        return rc, _read_events(result)

    def stderr(self, n: int) -> str:
        p = self.tmp / f"stderr-{n}.txt"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie awaiting the zygote's waitpid counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(cond: Any, deadline: float) -> None:
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("child did not reach the expected point")
        time.sleep(0.01)


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _events(path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in _read_events(path) if e["event"] == kind]


def check_restore(events: list[dict[str, Any]], log: Log, stderr: str) -> tuple[int | None, str]:
    """The restore of a fresh process after a kill: which step, and is it an allowed one.

    The log's ``commit`` lines mean "committed on every tier". A step committed on the local
    tier only (the kill came during its S3 upload) is still a committed checkpoint, so the
    restore may be newer than the last ``commit`` line: any step that was saved (has an
    ``intent`` line) and is not older than the last fully committed one (or the one before
    it). It must be the newest step committed on any tier, and exactly the state saved.
    """
    loaded = [e for e in events if e["event"] in ("loaded", "empty", "load_error")]
    assert loaded, f"child did not get through load():\n{stderr}"
    ev = loaded[0]
    assert ev["event"] != "load_error", f"load() failed after a kill: {ev['error']}"
    if ev["event"] == "empty":
        assert log.last_commit is None, (
            f"nothing restored although step {log.last_commit} committed"
        )
        return None, "nothing committed yet"
    step, got = int(ev["step"]), ev["hash"]
    c, i = log.last_commit, log.last_intent
    newest = max(s for steps in ev["tier_steps"].values() for s in steps)
    assert step == newest, f"restored step {step}, but step {newest} is committed ({ev})"
    assert step in log.intents, f"restored step {step} that was never saved"
    assert c is None or step >= c - 1, f"restored step {step}, older than committed {c}"
    assert got == log.intents[step][-1], f"step {step} restored torn/different state"
    if step == c:
        kind = "newest logged commit"
    elif step == i:
        kind = "in-flight save that committed (some tier) before its log line"
    elif c is not None and step > c:
        kind = "an earlier run's save committed on the local tier only"
    else:
        kind = "the step before the newest logged commit"
    return step, kind


def crash_trials(
    tmp_path: Path,
    server: Any,
    bucket: str,
    schedule: list[tuple[str, int, str, float]],
    record: Recorder,
    budget_s: float,
) -> dict[str, Any]:
    h = Harness(tmp_path, server, bucket)
    try:
        return _crash_trials(h, server, bucket, schedule, record, budget_s)
    finally:
        h.close()


def _crash_trials(
    h: Harness,
    server: Any,
    bucket: str,
    schedule: list[tuple[str, int, str, float]],
    record: Recorder,
    budget_s: float,
) -> dict[str, Any]:
    t_start = time.monotonic()
    stats: dict[str, Any] = {
        "trials": 0,
        "killed": 0,
        "points": {},
        "restored": {},
        "leftovers_after_kill": {},
    }
    label = ""

    def restored(events: list[dict[str, Any]], log: Log, n: int) -> None:
        step, kind = check_restore(events, log, h.stderr(n))
        stats["restored"][kind] = stats["restored"].get(kind, 0) + 1
        record("crash", f"kill {n - 1}: {label}", f"fresh process restored step {step} ({kind})")

    for n, (point, nth, mode, delay) in enumerate(schedule):
        if time.monotonic() - t_start > budget_s:
            break
        log_before = Log.read(h.log)
        rc, events = h.run(n, point, nth, mode=mode, delay=delay)
        if n > 0:  # this child's load() is the restore after the previous kill
            restored(events, log_before, n)
        assert rc in (0, -signal.SIGKILL), f"child {n} exited {rc}:\n{h.stderr(n)}"
        stats["trials"] += 1
        stats["killed"] += rc == -signal.SIGKILL
        stats["points"][point] = stats["points"].get(point, 0) + 1
        log_after = Log.read(h.log)
        assert not log_after.failed, f"a save failed after a kill: {log_after.failed}"
        left = {**local_leftovers(h.local), **s3_leftovers(server.admin, bucket, "run/")}
        for k, v in left.items():
            stats["leftovers_after_kill"][k] = stats["leftovers_after_kill"].get(k, 0) + len(v)
        label = f"{point}#{nth} ({mode})" if point != "random" else f"random at {delay:.2f}s"
    # a clean run in a brand-new interpreter: it restores, saves, and its saves commit
    n = stats["trials"]
    log_before = Log.read(h.log)
    rc, events = h.run(n, None, saves=3, fresh_interpreter=True)
    assert rc == 0, h.stderr(n)
    restored(events, log_before, n)
    final = Log.read(h.log)
    assert final.last_commit == final.last_intent and not final.failed
    # restarts replayed training from restored states: every re-save of a step is identical
    for s, hashes in final.intents.items():
        assert len(set(hashes)) == 1, f"step {s} differs between runs: a restore was not exact"
    stats["replayed_steps"] = sum(len(v) > 1 for v in final.intents.values())
    # a new node with only S3 restores the newest S3 checkpoint
    s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url)
    with Checkpointer([s3]) as ck:
        newest = ck.steps()[-1]
        assert state_hash(ck.load()) == final.intents[newest][-1]
    # leftovers: what the saves' own retention left, then gc + cleanup with no writer active
    stats["leftovers_after_saves"] = {
        k: len(v)
        for k, v in {
            **local_leftovers(h.local),
            **s3_leftovers(server.admin, bucket, "run/"),
        }.items()
        if v
    }
    with Checkpointer([LocalTier(h.local, keep_last=2), s3]) as ck:
        for t in ck.tier_names:
            b = ck.backend(t)
            gc_tier(b, 2)
            b.cleanup_incomplete("")
    left = {**local_leftovers(h.local), **s3_leftovers(server.admin, bucket, "run/")}
    assert not any(left.values()), f"leftovers after gc: {left}"
    stats["seconds"] = round(time.monotonic() - t_start, 1)
    return stats


def _schedule(seed: int, trials: int) -> list[tuple[str, int, str, float]]:
    rng = random.Random(seed)
    names = list(POINTS)
    out = []
    for i in range(trials):
        # every point once, then random moments (40%) and random named points
        if i < len(names):
            point = names[i]
        else:
            point = "random" if rng.random() < 0.4 else rng.choice(names)
        lo, hi = POINTS[point]
        nth = rng.randint(lo, hi) if hi else 0
        mode = "pause" if rng.random() < 0.3 else "kill"
        delay = rng.uniform(0.0, 1.2) if point == "random" else 0.0  # a child lives ~1-2 s
        out.append((point, nth, mode, delay))
    return out


def _kill_trials(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    record: Recorder,
    *,
    seed: int,
    planned: int,
    budget_s: float,
    at_least: int,
) -> None:
    bucket = s3_bucket(moto_server)
    stats = crash_trials(
        tmp_path, moto_server, bucket, _schedule(seed, planned), record, budget_s=budget_s
    )
    print(f"crash consistency ({planned} planned):", json.dumps(stats))
    assert stats["trials"] >= at_least, stats
    record("crash", "summary", "all kills recovered", stats=stats)


def test_kill_at_named_points_and_random_moments(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    _kill_trials(
        tmp_path, moto_server, s3_bucket, record, seed=1, planned=13, budget_s=120, at_least=10
    )


@pytest.mark.slow
def test_kill_50_trials_slow(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    _kill_trials(
        tmp_path, moto_server, s3_bucket, record, seed=7, planned=60, budget_s=900, at_least=50
    )
