"""A process forked from a training process: DataLoader workers, multiprocessing's fork.

On Linux a ``DataLoader(num_workers=N)`` forks its workers at every epoch (unless
``persistent_workers``), and they exit at its end through ``multiprocessing``, which runs
threading's exit hooks. The workers inherit the training process's Checkpointer as a copy
without its threads. Before, each worker's exit ran tierckpt's exit drain on that copy and gave
the *parent's* writer lease back (its file deleted): every later save of the parent failed
("this writer lost rank 0's lease"), nothing durable was written from the first epoch on, and
with an S3 tier each epoch took 10 s longer (each worker waiting to release the S3 lease). A
forked child that used the inherited Checkpointer hung (a save) or gave the lease back too (a
load). Now a child leaves the parent's pipelines, leases and connections alone, and refuses to
use the copy (``InheritedThroughFork``, at once); a new Checkpointer made in the child works.

Each case runs in a fresh process (a script), as a training job would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

PRELUDE = """
import json, os, sys, time, multiprocessing as mp
import torch
from tierckpt import Checkpointer, LocalTier, MemoryTier, InheritedThroughFork

folder = sys.argv[1]
out = {}

class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor(i)

def epoch():
    t0 = time.monotonic()
    loader = torch.utils.data.DataLoader(
        Items(), batch_size=2, num_workers=2, multiprocessing_context="fork"
    )
    got = sorted(int(x) for batch in loader for x in batch)
    assert got == list(range(8)), got
    return time.monotonic() - t0
"""

DATALOADER = """
ck = Checkpointer([LocalTier(folder, keep_last=None)])
ck.save({"w": torch.full((4,), 1.0)}, 1).wait()
epoch()                                             # workers exit after a committed save
h2 = ck.save({"w": torch.full((1 << 20,), 2.0)}, 2)  # and while a save is in flight
epoch()
h2.wait()
ck.save({"w": torch.full((4,), 3.0)}, 3).wait()     # failed before: the lease was gone
out["leases"] = sorted(os.listdir(os.path.join(folder, "leases")))
ck.close()
with Checkpointer([LocalTier(folder, keep_last=None)]) as again:
    out["steps"] = again.steps()
    out["w3"] = again.load(step=3)["w"].tolist()
print(json.dumps(out))
"""

CHILD_USES_COPY = """
ck = Checkpointer([MemoryTier(namespace="fork-copy"), LocalTier(folder, keep_last=None)])
ck.save({"w": torch.ones(3)}, 1).wait()

def child(what, q):
    t0 = time.monotonic()
    try:
        if what == "save":
            ck.save({"w": torch.zeros(3)}, 2).wait(timeout=30)
        elif what == "load":
            ck.load()
        else:
            ck.steps()
        q.put((what, "used", time.monotonic() - t0))
    except InheritedThroughFork as exc:
        q.put((what, "refused: " + str(exc)[:60], time.monotonic() - t0))
    ck.close()  # and letting go of the copy touches nothing of the parent's

ctx = mp.get_context("fork")
for what in ("save", "load", "steps"):
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(what, q))
    p.start()
    p.join(60)
    alive = p.is_alive()
    if alive:
        p.kill()
    out[what] = [*q.get(timeout=5)[1:2], p.exitcode, alive] if not alive else ["hung"]
ck.save({"w": torch.full((3,), 3.0)}, 3).wait(timeout=60)
out["tier_steps"] = ck.tier_steps()
ck.close()
print(json.dumps(out))
"""

NEW_IN_CHILD = """
# the parent has used the planes codec's helper pool before the fork
ck = Checkpointer([LocalTier(folder + "/parent", keep_last=None, codec="planes")])
state = {"w": torch.randn(1 << 18), "h": torch.randn(1 << 18).to(torch.bfloat16)}
ck.save(state, 1).wait()

def child(q):
    torch.set_num_threads(1)  # as a DataLoader worker: torch's own pool is not fork-safe
    with Checkpointer([LocalTier(folder + "/child", codec="planes")]) as mine:
        mine.save(state, 7).wait(timeout=60)
        back = mine.load()
        q.put(all(torch.equal(back[k], state[k]) for k in state))

ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
p.join(120)
out["child_alive"] = p.is_alive()
if p.is_alive():
    p.kill()
out["child_exit"] = p.exitcode
out["child_equal"] = q.get(timeout=5) if not out["child_alive"] else None
ck.save(state, 2).wait()
out["parent_steps"] = ck.steps()
ck.close()
print(json.dumps(out))
"""


def _run(body: str, folder: Path) -> dict[str, Any]:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    done = subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


def test_dataloader_workers_leave_the_parents_lease_and_saves_alone(tmp_path: Path) -> None:
    got = _run(DATALOADER, tmp_path / "run")
    assert got["steps"] == [1, 2, 3]
    assert got["w3"] == [3.0] * 4
    assert "rank-000000.json" in got["leases"]  # the lease was still the parent's to give
    assert "lost rank 0's lease" not in got["stderr"]
    # the workers' exits did not drain the parent's in-flight save
    assert "interpreter exit with" not in got["stderr"], got["stderr"][-2000:]


def test_a_forked_child_refuses_the_inherited_checkpointer_at_once(tmp_path: Path) -> None:
    got = _run(CHILD_USES_COPY, tmp_path / "run")
    for what in ("save", "load", "steps"):
        assert got[what] != ["hung"], f"the child's {what} hung"
        outcome, exitcode, _alive = got[what]
        assert outcome.startswith("refused: this Checkpointer was made in process"), got[what]
        assert exitcode == 0
    assert got["tier_steps"] == {"memory": [3], "local": [1, 3]}


def test_a_new_checkpointer_in_a_forked_child_saves_and_loads(tmp_path: Path) -> None:
    got = _run(NEW_IN_CHILD, tmp_path)
    assert got["child_alive"] is False and got["child_exit"] == 0
    assert got["child_equal"] is True
    assert got["parent_steps"] == [1, 2]


@pytest.mark.parametrize("method", ["wait_captured", "wait", "pinned", "tier_steps"])
def test_every_io_method_of_an_inherited_copy_refuses(method: str, tmp_path: Path) -> None:
    body = f"""
ck = Checkpointer([LocalTier(folder)])
ck.save({{"w": torch.ones(2)}}, 1).wait()

def child(q):
    try:
        getattr(ck, {method!r})()
        q.put("used")
    except InheritedThroughFork:
        q.put("refused")

ctx = mp.get_context("fork")
q = ctx.Queue()
p = ctx.Process(target=child, args=(q,))
p.start()
p.join(60)
out["child"] = q.get(timeout=5) if p.exitcode == 0 else p.exitcode
ck.save({{"w": torch.ones(2)}}, 2).wait()
out["steps"] = ck.steps()
ck.close()
print(json.dumps(out))
"""
    got = _run(body, tmp_path / "run")
    assert got["child"] == "refused"
    assert got["steps"] == [1, 2]
