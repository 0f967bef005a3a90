"""SIGTERM in the middle of training: the job saves the step it is at and leaves, on every rank.

Real processes, real signals. Without :class:`tierckpt.Preemption` Python ends at SIGTERM at
once: the steps since the last checkpoint are lost (what was committed stays). With it:
- one rank: the step the loop was at when SIGTERM came is committed and loads bit-exact, the
  process exits 0 and its writer lease is gone (a job rescheduled on another node takes the
  location over at once, not after the lease's ttl);
- two ranks (gloo), SIGTERM to rank 1 only: both stop after the same step and save it together;
- a second SIGTERM ends the process as before; the previous handler is back after ``close()``;
- the Hugging Face callback's ``preemption=True``, and Lightning's own ``OnExceptionCheckpoint``
  through the ``TierCkptIO`` plugin: the step SIGTERM found the trainer at is committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, Preemption

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _trainer(argv: str) -> None:
    """A training loop: ``w`` is ``step + 1`` after each step; a checkpoint every ``every``
    steps; stops where :class:`Preemption` says, saving that step. Resumes from the newest."""
    a = json.loads(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if a.get("world", 1) > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=a["rank"], world_size=a["world"])
    ck = Checkpointer(
        [LocalTier(a["dir"], codec="raw")], chunk_bytes=64 << 10, host_buffer_bytes=8 << 20
    )
    state: dict[str, Any] = {"w": torch.zeros(1 << 16), "step": -1}
    if ck.steps():
        state = ck.load()
    out: dict[str, Any] = {"resumed_from": state["step"]}
    with Preemption() as stop:
        step = state["step"] + 1
        while True:
            state = {"w": state["w"] + 1, "step": step}  # a step: new tensors, nothing in place
            Path(a["progress"]).write_text(str(step))
            time.sleep(0.02)
            if stop.check():
                ck.save(state, step).wait(timeout=120)
                out["stopped_at"] = step
                break
            if step % a["every"] == 0:
                ck.save(state, step)
            step += 1
    ck.close()
    Path(a["result"]).write_text(json.dumps(out))


def _ignorer(argv: str) -> None:
    """Installs Preemption and never checks it; says when it noticed the first signal."""
    a = json.loads(argv)
    stop = Preemption()
    Path(a["ready"]).touch()
    while True:
        if stop.requested and not os.path.exists(a["noticed"]):
            Path(a["noticed"]).touch()
        time.sleep(0.01)


def _hf_trainer(argv: str) -> None:
    """A Hugging Face Trainer (tiny GPT-2, ``examples/hf_trainer.py``'s) with the callback's
    ``preemption=True``, saving every 50 steps of 10,000; writes each step to ``progress``."""
    from transformers import TrainerCallback

    sys.path.insert(0, str(ROOT / "examples"))
    import hf_trainer as ex

    from tierckpt.integrations.hf import TierCkptCallback

    a = json.loads(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    class Progress(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            Path(a["progress"]).write_text(str(state.global_step))

    cb = TierCkptCallback([LocalTier(a["dir"], codec="raw")], preemption=True)
    trainer = ex.trainer(a["out"], cb, 10_000)
    trainer.args.save_steps = 50
    trainer.add_callback(Progress())
    trainer.train()
    cb.close()
    Path(a["result"]).write_text(json.dumps({"global_step": trainer.state.global_step}))


def _lightning_trainer(argv: str) -> None:
    """A Lightning ``fit`` (``examples/lightning_fit.py``'s model) with the ``TierCkptIO``
    plugin, ``ModelCheckpoint`` every 50 steps (and ``last.ckpt``) and Lightning's own
    ``OnExceptionCheckpoint``; writes each step to ``progress`` and, at the start of training,
    the step it starts from to ``started``. ``resume``: the ``ckpt_path`` to fit from."""
    import lightning as L

    sys.path.insert(0, str(ROOT / "examples"))
    import lightning_fit as ex

    from tierckpt.integrations.lightning import TierCkptIO

    a = json.loads(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")

    class Progress(L.pytorch.callbacks.Callback):  # type: ignore[misc]
        def on_train_start(self, trainer: Any, *_: Any) -> None:
            Path(a["started"]).write_text(str(trainer.global_step))

        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            Path(a["progress"]).write_text(str(trainer.global_step))
            time.sleep(0.01)

    io = TierCkptIO([LocalTier(a["dir"], codec="raw")])
    ckpts = a["ckpts"]
    callbacks = [
        L.pytorch.callbacks.ModelCheckpoint(ckpts, every_n_train_steps=50, save_last=True),
        L.pytorch.callbacks.OnExceptionCheckpoint(ckpts),
        Progress(),
    ]
    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=a["max_steps"],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=callbacks,
        default_root_dir=a["root"],
    )
    try:
        trainer.fit(ex.Regressor(), ex.data(), ckpt_path=a.get("resume"))
    finally:
        io.close()
        Path(a["result"]).write_text(json.dumps({"global_step": trainer.global_step}))


def _spawn(fn: str, args: dict[str, Any], log: Path, **env: str) -> subprocess.Popen[bytes]:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_preemption as t; "
        f"t.{fn}(sys.argv[1])"
    )
    child_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", **env)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)], stdout=f, stderr=f, env=child_env
        )


def _wait(cond: Any, procs: list[subprocess.Popen[bytes]], logs: list[Path], what: str) -> None:
    deadline = time.monotonic() + 180
    while not cond():
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise AssertionError(f"child exited ({p.returncode}):\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise AssertionError(f"no {what} after 180 s")
        time.sleep(0.02)


def _progress(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def _sigterm_at(fn: str, args: dict[str, Any], log: Path, step: int) -> subprocess.Popen[bytes]:
    """Spawn ``fn`` and send it SIGTERM once its ``progress`` file says ``step``."""
    proc = _spawn(fn, args, log)
    progress = Path(args["progress"])
    _wait(lambda: _progress(progress) >= step, [proc], [log], f"step {step}")
    proc.send_signal(signal.SIGTERM)
    return proc


def _finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]


def test_sigterm_saves_the_step_the_loop_is_at_and_frees_the_location(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = {
        "dir": str(run),
        "every": 5,
        "progress": str(tmp_path / "progress"),
        "result": str(tmp_path / "result.json"),
    }
    log = tmp_path / "a.log"
    proc = _spawn("_trainer", args, log)
    _wait(lambda: _progress(tmp_path / "progress") >= 7, [proc], [log], "step 7")
    proc.send_signal(signal.SIGTERM)
    _finish(proc, log)
    out = json.loads((tmp_path / "result.json").read_text())
    stopped = out["stopped_at"]
    assert stopped >= 7 and "SIGTERM received" in log.read_text()
    ck = Checkpointer([LocalTier(run)])
    try:
        assert ck.steps()[-1] == stopped  # the step it was at, not the last periodic one
        got = ck.load()
        assert got["step"] == stopped and torch.equal(
            got["w"], torch.full((1 << 16,), stopped + 1.0)
        )
    finally:
        ck.close()
    assert not list((run / "leases").iterdir())  # released: the next node need not wait

    # and the restarted job goes on from there
    (tmp_path / "result.json").unlink()
    proc = _spawn("_trainer", args, log)
    _wait(lambda: _progress(tmp_path / "progress") >= stopped + 2, [proc], [log], "progress")
    proc.send_signal(signal.SIGTERM)
    _finish(proc, log)
    again = json.loads((tmp_path / "result.json").read_text())
    assert again["resumed_from"] == stopped and again["stopped_at"] > stopped


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ranks_stop_at_the_same_step_when_one_gets_sigterm(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    procs, logs = [], []
    for rank in (0, 1):
        args = {
            "dir": str(run),
            "every": 4,
            "rank": rank,
            "world": 2,
            "progress": str(tmp_path / f"progress{rank}"),
            "result": str(tmp_path / f"result{rank}.json"),
        }
        logs.append(tmp_path / f"r{rank}.log")
        procs.append(_spawn("_trainer", args, logs[-1], **env))
    _wait(lambda: _progress(tmp_path / "progress0") >= 6, procs, logs, "step 6")
    procs[1].send_signal(signal.SIGTERM)  # only rank 1, as a node's agent might
    for p, log in zip(procs, logs):
        _finish(p, log)
    stops = [json.loads((tmp_path / f"result{r}.json").read_text())["stopped_at"] for r in (0, 1)]
    assert stops[0] == stops[1], stops
    assert "another rank was asked to stop" in logs[0].read_text()
    assert "SIGTERM received" in logs[1].read_text()
    ck = Checkpointer([LocalTier(run)])
    try:
        assert ck.steps()[-1] == stops[0]
    finally:
        ck.close()


def test_a_second_sigterm_ends_the_process_as_before(tmp_path: Path) -> None:
    ready, noticed, log = tmp_path / "ready", tmp_path / "noticed", tmp_path / "a.log"
    proc = _spawn("_ignorer", {"ready": str(ready), "noticed": str(noticed)}, log)
    _wait(ready.exists, [proc], [log], "ready")
    proc.send_signal(signal.SIGTERM)
    _wait(noticed.exists, [proc], [log], "the first signal noticed")
    assert proc.poll() is None  # the first one only set the flag
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_handlers_chain_and_come_back(tmp_path: Path) -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with Preemption(signals=(signal.SIGUSR1,)) as stop:
            assert not stop.check()
            os.kill(os.getpid(), signal.SIGUSR1)
            _settle(lambda: stop.requested)
            assert stop.check() and stop.signal == signal.SIGUSR1 and seen == []
            os.kill(os.getpid(), signal.SIGUSR1)  # asked again: the previous handler runs
            _settle(lambda: seen == [signal.SIGUSR1])
        os.kill(os.getpid(), signal.SIGUSR1)  # closed: the previous handler is back
        _settle(lambda: len(seen) == 2)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_time_left_counts_the_grace_period_down_from_the_signal(tmp_path: Path) -> None:
    """``Preemption(grace_s=)``: ``time_left()`` is what is left of the grace since the signal,
    less the exit reserve; None before a signal or without a grace (close() then waits)."""
    with Preemption(signals=(signal.SIGUSR1,)) as plain:
        assert plain.time_left() is None
    with Preemption(signals=(signal.SIGUSR1,), grace_s=30) as stop:
        assert stop.time_left() is None  # not asked to stop yet
        os.kill(os.getpid(), signal.SIGUSR1)
        _settle(lambda: stop.requested)
        assert stop.check()
        first = stop.time_left()
        assert first is not None and 27.0 < first <= 28.0, first
        assert stop.time_left(reserve_s=0) > first
        time.sleep(0.2)
        later = stop.time_left()
        assert later is not None and later <= first - 0.2, (first, later)
        assert stop.time_left(reserve_s=100) == 0.0
        with Checkpointer([LocalTier(tmp_path / "ck")]) as ck:
            ck.save({"w": torch.ones(4)}, 1).wait("local", timeout=60)
            ck.close(timeout=stop.time_left())
    with Checkpointer([LocalTier(tmp_path / "ck")]) as again:
        assert again.steps() == [1]
    for bad in (0, -1, float("inf"), float("nan"), "30", True):
        with pytest.raises(ValueError, match="grace_s"):
            Preemption(signals=(signal.SIGUSR1,), grace_s=bad)  # type: ignore[arg-type]


def test_made_outside_the_main_thread_it_says_where_to_make_it() -> None:
    errors: list[BaseException] = []

    def make() -> None:
        try:
            Preemption()
        except ValueError as exc:
            errors.append(exc)

    th = threading.Thread(target=make)
    th.start()
    th.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])
    with pytest.raises(ValueError, match="at least one signal"):
        Preemption(signals=())


def _settle(cond: Any) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_the_check_benchmark_runs_and_reports_both_costs() -> None:
    """benchmarks/bench_preemption.py (docs/benchmarks.md), at a size that only shows it runs."""
    bench = str(ROOT / "benchmarks" / "bench_preemption.py")
    run = subprocess.run(
        [sys.executable, bench, "--calls", "20", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.strip().splitlines()[-1]
    check_us, bare_us = (float(x) for x in re.findall(r"([\d.]+) us", line))
    assert check_us > 0 and bare_us > 0, line


def test_hf_trainer_callback_saves_the_step_sigterm_found_it_at(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    run, log = tmp_path / "run", tmp_path / "hf.log"
    args = {
        "dir": str(run),
        "out": str(tmp_path / "out"),
        "progress": str(tmp_path / "progress"),
        "result": str(tmp_path / "result.json"),
    }
    proc = _sigterm_at("_hf_trainer", args, log, 3)
    _finish(proc, log)
    stopped = json.loads((tmp_path / "result.json").read_text())["global_step"]
    assert 3 <= stopped < 10_000
    ck = Checkpointer([LocalTier(run)])
    try:
        assert ck.steps()[-1] == stopped  # not a save step (every 50): saved because asked
        got = ck.load()
        assert got["global_step"] == stopped
        assert json.loads(got["trainer_state"])["global_step"] == stopped
    finally:
        ck.close()


def test_lightning_on_exception_checkpoint_saves_the_step_sigterm_found_it_at(
    tmp_path: Path,
) -> None:
    """Lightning turns SIGTERM into ``SIGTERMException`` at the end of the step; its
    ``OnExceptionCheckpoint`` saves that step through the ``TierCkptIO`` plugin, whose teardown
    waits until it is committed; ``fit(ckpt_path="last")`` resumes from it."""
    pytest.importorskip("lightning")
    from tierckpt.integrations.lightning import read_pointer

    log = tmp_path / "lit.log"
    args = {
        "dir": str(tmp_path / "tier"),
        "ckpts": str(tmp_path / "ckpts"),
        "root": str(tmp_path),
        "max_steps": 100_000,
        "progress": str(tmp_path / "progress"),
        "started": str(tmp_path / "started"),
        "result": str(tmp_path / "result.json"),
    }
    proc = _sigterm_at("_lightning_trainer", args, log, 60)
    proc.wait(timeout=180)
    # SIGTERMException is a SystemExit without a code: the process ends as Lightning's does
    assert proc.returncode == 0, log.read_text()[-3000:]
    stopped = json.loads((tmp_path / "result.json").read_text())["global_step"]
    assert stopped >= 60 and stopped % 50 != 0, stopped  # not a ModelCheckpoint step
    pointer = read_pointer(tmp_path / "ckpts" / "on_exception.ckpt")
    assert pointer is not None and pointer["step"] == stopped, pointer
    ck = Checkpointer([LocalTier(tmp_path / "tier")])
    try:
        assert ck.steps()[-1] == stopped  # committed before the process ended
        assert ck.load()["global_step"] == stopped
    finally:
        ck.close()

    args.update(max_steps=stopped + 3, resume="last")
    proc = _spawn("_lightning_trainer", args, log)
    _finish(proc, log)
    assert _progress(tmp_path / "started") == stopped  # "last" is the on-exception checkpoint
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == stopped + 3
