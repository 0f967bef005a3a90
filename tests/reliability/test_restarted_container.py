"""A container restarted on its node takes its crashed writer's lease at once, and only then.

A writer's lease names its host, boot id, PID namespace and PID. A restarted container runs in
a new PID namespace, so the crashed container's PID said nothing there, and its lease counted
as another machine's: the restarted job's first saves failed with ``WriterConflict`` until the
lease's ttl (60 s) had passed since the crash (in Kubernetes: a crash loop until then).

Now a writer with a local folder holds an ``flock`` on ``leases/rank-<r>.live`` there and names
the file in its leases; a writer on the same kernel asks the kernel whether anyone holds it.
Each case runs real processes. "Another container" is a child that reports another PID
namespace in its lease (its ``HostIdentity``), which is all a container changes in a lease; the
last case uses a real PID namespace (``unshare --pid``) where this machine allows it.

Shown:
- a killed writer's restarted job saves at once on a local tier, and on S3 behind a local tier
  (the S3 lease names the local lock); every committed step loads bit-exact;
- a worker the dead writer forked (a data loader's) does not keep its lock alive;
- a writer that lives but is stopped past the ttl (a paused container) is *not* taken over:
  the lock says it runs, and it could resume writing;
- a lease without a lock file (S3 alone, or an older writer) is judged by its age, as before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import Recorder

import tierckpt
from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.testing.s3servers import S3Server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LEASE = "leases/rank-000000.json"


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 16, generator=g), "step": step}


def _tiers(spec: dict[str, Any]) -> list[Any]:
    tiers: list[Any] = [LocalTier(spec["local"], codec="raw")]
    if spec.get("s3"):
        tiers.append(S3Tier(spec["s3"], endpoint_url=spec["endpoint"], codec="raw"))
    return tiers


def _child(argv: str) -> None:
    """A job in "another container": its leases name ``pid_ns``. ``role``:

    ``hold``  saves step ``step``, forks a sleeping worker when ``fork`` (its pid to ``worker``),
              touches ``held`` and sleeps until killed;
    ``save``  saves step ``step`` and writes how it ended to ``result``.
    """
    a = json.loads(argv)
    if a["pid_ns"] is not None:  # None: the real one (a real PID namespace)
        identity = tierckpt.lease.HostIdentity
        real = identity.current()
        fake = identity(real.host, real.boot_id, a["pid_ns"])
        identity.current = staticmethod(lambda: fake)  # type: ignore[method-assign]
    ck = Checkpointer(_tiers(a["spec"]), chunk_bytes=64 << 10, host_buffer_bytes=4 << 20)
    t0 = time.perf_counter()
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        ck.save(_state(a["step"]), a["step"]).wait(timeout=120)
    except Exception as exc:
        out.update(error=type(exc).__name__, message=str(exc))
    out["seconds"] = time.perf_counter() - t0
    if a["role"] == "hold":
        if a.get("fork"):
            pid = os.fork()
            if pid == 0:  # a worker: outlives the writer, holds nothing
                time.sleep(120)
                os._exit(0)
            Path(a["worker"]).write_text(str(pid))
        Path(a["held"]).write_text(json.dumps(out))
        time.sleep(3600)
    ck.close()
    Path(a["result"]).write_text(json.dumps(out))


def _spawn(args: dict[str, Any], log: Path, prefix: list[str] | None = None, **env: str) -> Any:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "import test_restarted_container as t; t._child(sys.argv[1])"
    )
    child_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", **env)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [*(prefix or []), sys.executable, "-c", code, json.dumps(args)],
            stdout=f,
            stderr=f,
            env=child_env,
            start_new_session=True,
        )


def _wait_file(path: Path, proc: Any, log: Path, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {path.name} after {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    time.sleep(0.05)  # written in one call; let it land
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def _kill(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _hold(tmp_path: Path, spec: dict[str, Any], step: int, **extra: Any) -> tuple[Any, Path]:
    """A writer in "container A" that saved ``step`` and holds its leases."""
    log = tmp_path / "a.log"
    held = tmp_path / "held"
    args = {"role": "hold", "spec": spec, "step": step, "pid_ns": "pid:[1001]", "held": str(held)}
    proc = _spawn({**args, **extra}, log)
    got = _wait_file(held, proc, log)
    assert "error" not in got, got
    return proc, log


def _save(tmp_path: Path, spec: dict[str, Any], step: int, name: str, **env: str) -> dict[str, Any]:
    """A writer in "container B" (a restart, or a second job) saving ``step``."""
    log, result = tmp_path / f"{name}.log", tmp_path / f"{name}.json"
    args = {"role": "save", "spec": spec, "step": step, "pid_ns": "pid:[2002]"}
    proc = _spawn({**args, "result": str(result)}, log, **env)
    try:
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            _kill(proc)
    assert proc.returncode == 0, log.read_text()[-4000:]
    out: dict[str, Any] = json.loads(result.read_text())
    out["log"] = log.read_text()
    return out


def _loads(spec: dict[str, Any], steps: list[int]) -> list[int]:
    """The steps of ``steps`` that every tier of ``spec`` holds bit-exact."""
    good = []
    for step in steps:
        ok = True
        for tier in _tiers(spec):
            ck = Checkpointer([tier])
            try:
                got = ck.load(step=step)
            except Exception:
                ok = False
            else:
                want = _state(step)
                ok = ok and torch.equal(got["w"], want["w"]) and got["step"] == step
            finally:
                ck.close()
        if ok:
            good.append(step)
    return good


def _saved_both(record: Recorder, case: str, res: dict[str, Any], spec: dict[str, Any]) -> None:
    """The restarted job's save ``res`` went through, and steps 1 and 2 load bit-exact."""
    record(
        "one_writer",
        case,
        f"{res.get('error') or 'saved'} after {res['seconds']:.1f} s",
        "error" not in res,
    )
    assert "error" not in res, res["message"]
    assert _loads(spec, [1, 2]) == [1, 2]


def _restart_case(tmp_path: Path, spec: dict[str, Any], record: Recorder, what: str) -> None:
    proc, _ = _hold(tmp_path, spec, 1)
    lease = json.loads((Path(spec["local"]) / LEASE).read_text())
    _kill(proc)  # the container crashes
    res = _save(tmp_path, spec, 2, "b")
    loaded = _loads(spec, [1, 2])
    ok = "error" not in res and loaded == [1, 2]
    record(
        "one_writer",
        f"a container restarted on its node, {what}: its first save",
        f"{res.get('error') or 'saved'} after {res['seconds']:.1f} s "
        f"(lease ttl 60 s); steps loading bit-exact on every tier: {loaded}",
        ok,
    )
    assert "error" not in res, res["message"]
    assert res["seconds"] < 30, res  # at once, not after the ttl
    assert lease.get("live_path"), f"the lease names no lock file: {lease}"
    assert "no process on this machine holds its lock file" in res["log"], res["log"][-2000:]
    assert loaded == [1, 2]


def test_restarted_container_takes_over_a_local_tier_at_once(
    tmp_path: Path, record: Recorder
) -> None:
    _restart_case(tmp_path, {"local": str(tmp_path / "run")}, record, "local tier")
    assert sorted(os.listdir(tmp_path / "run" / "leases")) == []  # B closed: nothing left


def test_restarted_container_takes_over_s3_behind_local_at_once(
    tmp_path: Path, moto_server: S3Server, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    spec = {
        "local": str(tmp_path / "run"),
        "s3": f"s3://{bucket}/run",
        "endpoint": moto_server.endpoint_url,
    }
    _restart_case(tmp_path, spec, record, "S3 behind a local tier")
    keys = moto_server.admin.list_objects_v2(Bucket=bucket, Prefix="run/leases/")
    assert keys.get("KeyCount", 0) == 0  # B released its S3 lease too


def test_a_forked_worker_does_not_keep_a_dead_writer_alive(
    tmp_path: Path, record: Recorder
) -> None:
    spec = {"local": str(tmp_path / "run")}
    worker = tmp_path / "worker"
    proc, _ = _hold(tmp_path, spec, 1, fork=True, worker=str(worker))
    wpid = int(worker.read_text())
    try:
        os.kill(proc.pid, signal.SIGKILL)  # the writer only: its worker runs on
        proc.wait(timeout=30)
        os.kill(wpid, 0)  # still running
        res = _save(tmp_path, spec, 2, "b")
    finally:
        _kill(proc)  # the worker is in the writer's session
    _saved_both(
        record, "a dead writer's forked worker still runs; a restarted job saves", res, spec
    )


def test_a_stopped_writer_in_another_container_is_not_taken_over(
    tmp_path: Path, record: Recorder
) -> None:
    """Stopped past its ttl (``docker pause``, SIGSTOP): by age alone it was dead and taken
    over; it would write again once resumed. Its lock says it lives: refused."""
    spec = {"local": str(tmp_path / "run")}
    ttl = "2"
    log, held = tmp_path / "a.log", tmp_path / "held"
    args = {"role": "hold", "spec": spec, "step": 1, "pid_ns": "pid:[1001]", "held": str(held)}
    proc = _spawn(args, log, TIERCKPT_LEASE_TTL=ttl)
    _wait_file(held, proc, log)
    try:
        os.killpg(proc.pid, signal.SIGSTOP)
        time.sleep(3 * float(ttl))  # well past the ttl: no renewal
        res = _save(tmp_path, spec, 2, "b", TIERCKPT_LEASE_TTL=ttl)
        os.killpg(proc.pid, signal.SIGCONT)
        lease_file = Path(spec["local"]) / LEASE
        lease = json.loads(lease_file.read_text()) if lease_file.exists() else {}
    finally:
        _kill(proc)
    record(
        "one_writer",
        "a writer stopped past its ttl in another container (it may resume)",
        f"second job: {res.get('error') or 'saved (took over)'}",
        res.get("error") == "WriterConflict",
    )
    assert res.get("error") == "WriterConflict", res
    assert "holds its lock file" in res["message"], res["message"]
    assert lease.get("pid") == json.loads((tmp_path / "held").read_text())["pid"]  # still A's
    after = _save(tmp_path, spec, 3, "c", TIERCKPT_LEASE_TTL=ttl)  # A is dead now
    assert "error" not in after, after["message"]
    assert _loads(spec, [1, 3]) == [1, 3]


def test_a_lease_without_a_lock_file_is_judged_by_its_age(tmp_path: Path) -> None:
    """No local folder to lock (S3 alone), a lock file that is another file now, or a lease
    from before lock files: a live-looking lease is not taken over before its ttl."""
    from tierckpt.lease import LeaseRecord, owner_status
    from tierckpt.liveness import HostIdentity, LiveLock, LockId, probe

    me = HostIdentity.current()
    now = time.time()
    other_ns = LeaseRecord("o", me.host, me.boot_id, "pid:[9]", 1, 1, now, now, 60.0)
    alive, why = owner_status(other_ns, now)
    assert alive is True, why  # within its ttl, and the message says whose it may be
    assert "this one before a restart" in why and "s more unless renewed" in why, why
    assert owner_status(other_ns, now + 61)[0] is False  # past it
    path = tmp_path / "leases" / "rank-000000.live"
    lock = LiveLock(str(path))
    held = lock.take()
    assert held is not None and path.exists()
    assert probe(held) is False  # this process's own lock: no other process holds it
    with_lock = LeaseRecord("o", me.host, me.boot_id, "pid:[9]", 1, 1, now, now, 60.0, *_id(held))
    assert owner_status(with_lock, now)[0] is False  # ours, so not its writer's
    elsewhere = LeaseRecord("o", "h2", "other-boot", "pid:[9]", 1, 1, now, now, 60.0, *_id(held))
    assert owner_status(elsewhere, now)[0] is True  # another kernel: the lock tells nothing
    other_file = LockId(held.path, held.dev, held.ino + 1)
    assert probe(other_file) is None
    lock.release()
    assert not path.exists()
    assert probe(held) is None  # gone: cannot tell, so the age decides
    assert owner_status(with_lock, now)[0] is True


def _id(lock: Any) -> tuple[str, int, int]:
    return lock.path, lock.dev, lock.ino


def _unshare_works() -> bool:
    exe = shutil.which("unshare")
    if exe is None:
        return False
    try:
        run = subprocess.run(
            [exe, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return run.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no PID namespaces here (unshare --pid)")
def test_restart_in_a_real_pid_namespace(tmp_path: Path, record: Recorder) -> None:
    """The same as the first case, with each writer PID 1 of its own PID namespace."""
    spec = {"local": str(tmp_path / "run")}
    real_ns = os.readlink("/proc/self/ns/pid")
    ns = ["unshare", "--pid", "--fork", "--mount-proc"]
    log, held, result = tmp_path / "a.log", tmp_path / "held", tmp_path / "b.json"
    args = {"role": "hold", "spec": spec, "step": 1, "pid_ns": None, "held": str(held)}
    proc = _spawn(args, log, prefix=ns)
    got = _wait_file(held, proc, log)
    _kill(proc)
    lease = json.loads((Path(spec["local"]) / LEASE).read_text())
    assert lease["pid"] == got["pid"] == 1 and lease["pid_ns"] != real_ns
    b = _spawn(
        {"role": "save", "spec": spec, "step": 2, "pid_ns": None, "result": str(result)},
        tmp_path / "b.log",
        prefix=ns,
    )
    b.wait(timeout=180)
    res = json.loads(result.read_text())
    case = "a writer restarted in a new PID namespace (unshare --pid): its first save"
    _saved_both(record, case, res, spec)


def test_a_second_writer_in_this_process_leaves_the_first_ones_lock_alone(tmp_path: Path) -> None:
    """Refused as before; the first writer's lock file and its lease stay as they were (the
    second does not even open the file: on NFS, closing any descriptor of a file drops every
    lock the process holds on it)."""
    run = tmp_path / "run"
    first = Checkpointer([LocalTier(run, codec="raw")])
    second = Checkpointer([LocalTier(run, codec="raw")])
    try:
        first.save(_state(1), 1).wait(timeout=60)
        lock = run / "leases" / "rank-000000.live"
        before = lock.stat().st_ino
        with pytest.raises(tierckpt.WriterConflict):
            second.save(_state(2), 2)
        assert lock.stat().st_ino == before
        assert json.loads((run / LEASE).read_text())["live_ino"] == before
        first.close()
        second.save(_state(2), 2).wait(timeout=60)  # the first is gone: the second takes over
        assert json.loads((run / LEASE).read_text())["live_path"] == str(lock)
    finally:
        first.close()
        second.close()
    assert _loads({"local": str(run)}, [1, 2]) == [1, 2]
