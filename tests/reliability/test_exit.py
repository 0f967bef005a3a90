"""A script that ends with a save still in flight.

Training scripts often end right after their last ``save()``, without ``close()`` — normally,
or through an uncaught exception. The pipeline's threads are daemons: the interpreter used to
tear down around them, killing the S3 copy silently or aborting the process (SIGABRT, exit
status 134) while a thread was inside a tensor copy. Now an exit hook gives in-flight saves
``TIERCKPT_EXIT_TIMEOUT_S`` to finish and abandons the rest — never committed — with a log
line, and the exit status stays the script's own (0, or 1 after an uncaught exception).

Each case is a real process saving to a local folder and to S3 (moto behind the fault proxy,
which makes multipart parts slow): a small step 1 is committed first; a larger step 2 (more
than the host arena, so capture itself waits for the slow tier) is in flight at exit. A fresh
process then loads every committed step of each tier bit-exact, and the newest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from rel_util import Recorder, local_leftovers, s3_leftovers

from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys, torch
from tierckpt import Checkpointer, LocalTier, S3Tier

mode, local, endpoint, bucket = sys.argv[1:5]

def state(step):
    g = torch.Generator().manual_seed(step)
    n = (40 << 20) // 4 if step == 2 else 1000  # step 2: 40 MiB, 2.5x the host arena
    return {"w": torch.randn(n, generator=g), "step": step, "tag": ("t", step)}

def s3(url_endpoint):
    return S3Tier(f"s3://{bucket}/run", endpoint_url=url_endpoint, codec="raw",
                  part_size=5 << 20, max_attempts=3, connect_timeout=5, read_timeout=30)

if mode == "check":  # a fresh process: what is committed, and does it load bit-exact
    out = {}
    for name, tier in (("local", LocalTier(local)), ("s3", s3(endpoint))):
        with Checkpointer([tier]) as ck:
            out[name] = {}
            for s in ck.steps():
                got, want = ck.load(s), state(s)
                out[name][s] = bool(torch.equal(got["w"], want["w"])
                                    and got["step"] == s and got["tag"] == want["tag"])
    with Checkpointer([LocalTier(local), s3(endpoint)]) as ck:
        out["newest"] = ck.load()["step"]
    print(json.dumps(out))
    sys.exit(0)

ck = Checkpointer([LocalTier(local, keep_last=None), s3(endpoint)],
                  host_buffer_bytes=16 << 20, chunk_bytes=4 << 20)
ck.save(state(1), 1).wait(timeout=120)
h = ck.save(state(2), 2)
print("step 2 in flight", flush=True)
if mode == "raise":
    raise RuntimeError("the training loop crashed")
# mode "exit": the script just ends, without close()
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def _child(*args: str, script: str = CHILD, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=REPO,
        timeout=400,
    )


@pytest.mark.parametrize(
    ("ending", "outcome"),
    # the raising script abandons just like the ending one (checked by hand; 30 s a case)
    [("exit", "finish"), ("raise", "finish"), ("exit", "abandon")],
    ids=["exit-finish", "raise-finish", "exit-abandon"],
)
def test_exit_with_save_in_flight(
    ending: str,
    outcome: str,
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Any,
    record: Recorder,
) -> None:
    bucket = s3_bucket(moto_server)
    local = tmp_path / "local"
    # finish: parts are a little slow, the exit timeout generous; abandon: each part takes
    # 4 s and the exit timeout is 1 s, so step 2 cannot commit anywhere in time
    part_delay, timeout = (0.2, "300") if outcome == "finish" else (4.0, "1")
    faults = [Fault("delay", method="PUT", path_contains="partNumber=", seconds=part_delay)]
    with FaultProxy(moto_server.endpoint_url, faults, timeout=30) as proxy:
        p = _child(ending, str(local), proxy.endpoint_url, bucket, TIERCKPT_EXIT_TIMEOUT_S=timeout)
    expected_rc = 0 if ending == "exit" else 1
    err = p.stderr
    check = _child("check", str(local), moto_server.endpoint_url, bucket)
    assert check.returncode == 0, check.stderr[-3000:]
    got = json.loads(check.stdout.strip().splitlines()[-1])
    committed = {t: sorted(int(s) for s in got[t]) for t in ("local", "s3")}
    exact = all(all(v.values()) for t, v in got.items() if t in ("local", "s3"))
    record(
        "exit",
        f"script {'ends' if ending == 'exit' else 'raises'} with a 40 MiB save in flight to "
        f"local + slow S3; exit timeout {timeout} s",
        f"exit status {p.returncode}; committed {committed}; loads "
        f"{'bit-exact' if exact else 'WRONG'}, newest step {got['newest']}",
        p.returncode == expected_rc and exact,
    )
    assert p.returncode == expected_rc, f"exit status {p.returncode}\n{err[-3000:]}"
    if ending == "raise":
        assert "RuntimeError: the training loop crashed" in err
    assert "interpreter exit with 1 save(s) in flight (step 2)" in err, err[-3000:]
    assert exact, got  # nothing torn: every committed step loads bit-exact
    if outcome == "finish":
        assert "at exit: finished 1 in-flight save(s) (step 2)" in err, err[-3000:]
        assert committed == {"local": [1, 2], "s3": [1, 2]}
        assert got["newest"] == 2
        assert local_leftovers(local)["tmp_files"] == []
        assert s3_leftovers(moto_server.admin, bucket, "run/")["open_uploads"] == []
    else:
        assert "at exit: abandoned step 2 on tier(s)" in err, err[-3000:]
        assert 2 not in committed["s3"]  # abandoned: never committed
        assert 1 in committed["local"] and 1 in committed["s3"]
        assert got["newest"] in (1, 2)


DCP_CHILD = """
import sys, tempfile, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from tierckpt import LocalTier
from tierckpt.dcp import TierReader, TierWriter

mode, root = sys.argv[1:3]
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)

def state(step):
    return {"w": torch.randn(1 << 20, generator=torch.Generator().manual_seed(step))}

if mode == "check":  # a fresh process: which steps load, bit-exact
    exact = []
    for step in (1, 2):
        got = {"w": torch.zeros(1 << 20)}
        try:
            dcp.load(got, storage_reader=TierReader([LocalTier(root)]), checkpoint_id=step)
        except BaseException:
            continue
        exact.append(step if torch.equal(got["w"], state(step)["w"]) else -step)
    print(exact)
    sys.exit(0)
writer = TierWriter([LocalTier(root, keep_last=None)])
if mode == "idle":  # what a Ctrl-C inside DCP's submit leaves: its executor never shut down
    from concurrent.futures import ThreadPoolExecutor

    dcp.async_save(state(1), storage_writer=writer, checkpoint_id=1).result()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor")
    pool.submit(lambda: None).result()
    print("idle executor left", flush=True)
    sys.exit(0)
if mode == "second":  # a first save waited for, then one the script does not wait for
    dcp.async_save(state(1), storage_writer=writer, checkpoint_id=1).result()
fut = dcp.async_save(state(2), storage_writer=writer, checkpoint_id=2)
print("step 2 in flight", flush=True)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["second", "first"])
def test_a_script_ending_with_a_dcp_async_save_in_flight_commits_it(
    mode: str, tmp_path: Path, record: Recorder
) -> None:
    """``dcp.async_save`` through a TierWriter, then the script ends without waiting for the
    future (as it may with DCP's FileSystemWriter, whose save completes at exit): the exit
    waits for DCP's save thread (bounded by the exit timeout), so the step commits. Before,
    the exit drain closed the idle pipeline first and the save failed unseen ("the
    checkpointer is closed"), exit status 0. ``first``: the writer's first save, whose
    pipeline did not exist yet when the script ended."""
    root = tmp_path / "ck"
    p = _child(mode, str(root), script=DCP_CHILD)
    assert p.returncode == 0, p.stderr[-3000:]
    check = _child("check", str(root), script=DCP_CHILD)
    assert check.returncode == 0, check.stderr[-3000:]
    loaded = json.loads(check.stdout.strip().splitlines()[-1])
    want = [1, 2] if mode == "second" else [2]
    record(
        "exit",
        f"script ends with a dcp.async_save in flight ({mode} save of its TierWriter)",
        f"exit status {p.returncode}; steps that load bit-exact {loaded}",
        loaded == want,
    )
    assert loaded == want, p.stderr[-3000:]
    assert "waiting up to" in p.stderr and "AsyncCheckpointExecutor" in p.stderr, p.stderr


@pytest.mark.distributed
def test_exit_does_not_wait_for_an_idle_dcp_executor_thread(tmp_path: Path) -> None:
    """A Ctrl-C inside ``dcp.async_save``'s submit leaves DCP's executor thread waiting for
    work that never comes (the executor is shut down only by a submitted save's end). Exit
    waited the whole exit timeout (60 s) for that thread, calling it a running save; an idle
    executor thread is no longer waited for, while one running a save still is (the test
    above)."""
    root = tmp_path / "ck"
    p = _child("idle", str(root), script=DCP_CHILD, TIERCKPT_EXIT_TIMEOUT_S="30")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "idle executor left" in p.stdout
    assert "waiting up to" not in p.stderr, p.stderr[-3000:]


def test_an_executor_thread_running_a_task_is_waited_for_and_an_idle_one_is_not(
    tmp_path: Path,
) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tierckpt import LocalTier
    from tierckpt.dcp import TierWriter
    from tierckpt.dcp._writer import _async_save_threads

    gate = threading.Event()
    busy = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor-b")
    idle = ThreadPoolExecutor(max_workers=1, thread_name_prefix="AsyncCheckpointExecutor-i")
    with TierWriter([LocalTier(tmp_path)]):
        try:
            idle.submit(lambda: None).result()
            running = busy.submit(gate.wait)
            names = {th.name for th in _async_save_threads()}
            assert any(n.startswith("AsyncCheckpointExecutor-b") for n in names), names
            assert not any(n.startswith("AsyncCheckpointExecutor-i") for n in names), names
        finally:
            gate.set()
            running.result(10)
            busy.shutdown()
            idle.shutdown()
