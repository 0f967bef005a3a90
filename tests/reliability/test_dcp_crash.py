"""Crash consistency of ``tierckpt.dcp``: SIGKILL a DCP training process at random moments.

A child process (``dcp_crash_child.py``) resumes with ``dcp.load`` from the newest committed
checkpoint of a local folder and an S3 prefix (moto, served by this test process so it
survives the kills), then saves every step with ``dcp.save`` through one ``TierWriter`` until
it is killed: mid-save, between the shards and DCP's metadata, between the metadata and the
manifests, during retention. Each restart must load exactly the state saved at the step it
names (its hash is the one logged before that save), never an older step than the last save
``dcp.save`` returned from, never a torn state, never an error while a committed checkpoint
exists; saves after a kill must commit; the leftovers of killed saves must be gone after gc.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from rel_util import Recorder, local_leftovers, s3_leftovers

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.retention import gc_tier

HERE = Path(__file__).parent
CHILD = HERE / "dcp_crash_child.py"
ROOT = HERE.parent.parent
#: kills, each after a random time in the child's save loop
TRIALS = 8


def _read_log(path: Path) -> list[tuple[str, ...]]:
    if not path.exists():
        return []
    return [tuple(line.split()) for line in path.read_text().splitlines() if line.strip()]


def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(CHILD), *args], env=env)


@pytest.mark.s3
def test_dcp_saves_killed_at_random_moments_resume_bit_exact(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = str(s3_bucket(moto_server))
    local = tmp_path / "nvme"
    log = tmp_path / "log.txt"
    args = [
        "--local",
        str(local),
        "--endpoint",
        moto_server.endpoint_url,
        "--bucket",
        bucket,
        "--log",
        str(log),
    ]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", TIERCKPT_LEASE_WAIT_S="2")
    rng = random.Random(22)
    intents: dict[int, set[str]] = {}
    loads: list[tuple[int, int | None]] = []  # (step loaded, last step committed before)
    last_commit: int | None = None
    for trial in range(TRIALS + 1):
        seen = len(_read_log(log))
        final = trial == TRIALS
        proc = _spawn(args + (["--steps", "3"] if final else []), env)
        # kill while it saves: after its load and at least one intent
        end = time.monotonic() + 120
        while not final:
            entries = _read_log(log)[seen:]
            if any(e[0] == "intent" for e in entries) or proc.poll() is not None:
                break
            assert time.monotonic() < end, "the child never started saving"
            time.sleep(0.05)
        if final:
            assert proc.wait(timeout=180) == 0
        else:
            time.sleep(rng.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        entries = _read_log(log)[seen:]
        assert entries and entries[0][0] in ("loaded", "fresh"), entries[:3]
        if entries[0][0] == "loaded":
            step, digest = int(entries[0][1]), entries[0][2]
            # exactly the state saved at that step, and not older than the last return
            assert digest in intents.get(step, set()), (trial, step, digest)
            assert last_commit is None or step >= last_commit, (trial, step, last_commit)
            loads.append((step, last_commit))
        else:
            assert last_commit is None, f"trial {trial} started fresh after step {last_commit}"
        for e in entries[1:]:
            if e[0] == "intent":
                intents.setdefault(int(e[1]), set()).add(e[2])
            elif e[0] == "commit":
                last_commit = int(e[1])
    assert len(loads) == TRIALS, loads
    assert last_commit is not None and last_commit > loads[-1][0]  # the final run saved
    # the leftovers of killed saves: gone after gc and cleanup with no writer active
    s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    with Checkpointer([LocalTier(local, keep_last=2), s3]) as ck:
        for t in ck.tier_names:
            b = ck.backend(t)
            gc_tier(b, 2)
            b.cleanup_incomplete("")
    left = {**local_leftovers(local), **s3_leftovers(moto_server.admin, bucket, "run/")}
    assert not any(left.values()), f"leftovers after gc: {left}"
    record(
        "crash",
        f"tierckpt.dcp: {TRIALS} SIGKILLs at random moments of a dcp.save loop (local + S3), "
        "each followed by a restart that resumes with dcp.load",
        f"every restart loaded the state saved at the step it named (steps "
        f"{[s for s, _ in loads]}), never older than the last save dcp.save returned from; "
        f"the final run saved to step {last_commit}; no leftovers after gc",
        loads=loads,
    )
