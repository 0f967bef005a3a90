"""A machine whose clock runs ahead never takes a live writer's location for a dead one's.

A lease on another machine is judged by its age: the renewal time its holder wrote, by the
holder's clock, against this machine's clock. A second job on a machine whose clock ran ahead
of the holder's by more than the ttl (60 s) saw a live writer's lease as expired, took the
location over, and the live job lost it (``LeaseLost``: its later saves there failed) while two
jobs wrote one location. Now a lease that looks expired is judged again by the store's clock
(its modification time against an empty probe object's, both set by the store): a lease the
store wrote within the ttl has a live holder, whatever the machines' clocks say.

Each case runs the holder as a real process on "another machine" (its lease names another
host and boot id, which is all another machine changes in a lease) whose clock runs 10 minutes
behind this one's (its ``time.time``), saving to a local folder or to S3 (moto).
"""

from __future__ import annotations

import json
import os
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
from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier, WriterConflict
from tierckpt.backends.local import LocalBackend
from tierckpt.lease import LEASE_DIR, LeaseRecord, WriterLease, lease_name
from tierckpt.testing.s3servers import S3Server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SKEW_S = 600.0
TTL = "4"  # renewed every second


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 14, generator=g), "step": step}


def _tier(spec: dict[str, Any]) -> Any:
    if spec["kind"] == "local":
        return LocalTier(spec["path"], codec="raw")
    return S3Tier(spec["url"], endpoint_url=spec["endpoint"], codec="raw")


def _child(argv: str) -> None:
    """The holder on "another machine" whose clock is ``SKEW_S`` behind: saves step 1, says
    so in ``held``, then saves step 3 once ``go`` appears (how it ended to ``result``) and
    sleeps until killed."""
    a = json.loads(argv)
    identity = tierckpt.lease.HostIdentity
    fake = identity("node-a", "11111111-2222-3333-4444-555555555555", "pid:[7]")
    identity.current = staticmethod(lambda: fake)  # type: ignore[method-assign]
    real = time.time
    time.time = lambda: real() - SKEW_S  # this machine's clock, 10 minutes behind
    ck = Checkpointer([_tier(a["spec"])], chunk_bytes=64 << 10, host_buffer_bytes=4 << 20)
    ck.save(_state(1), 1).wait(timeout=120)
    Path(a["held"]).write_text("1")
    while not Path(a["go"]).exists():
        time.sleep(0.05)
    out: dict[str, Any] = {}
    try:
        ck.save(_state(3), 3).wait(timeout=120)
    except Exception as exc:
        out = {"error": type(exc).__name__, "message": str(exc)}
    Path(a["result"]).write_text(json.dumps(out))
    time.sleep(3600)


def _wait(path: Path, proc: Any, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"holder exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path.name}:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)
    time.sleep(0.05)


@pytest.fixture(params=["local", "s3"])
def spec(request: Any, tmp_path: Path) -> dict[str, Any]:
    if request.param == "local":
        return {"kind": "local", "path": str(tmp_path / "run")}
    server: S3Server = request.getfixturevalue("moto_server")
    bucket = request.getfixturevalue("s3_bucket")(server)
    return {"kind": "s3", "url": f"s3://{bucket}/run", "endpoint": server.endpoint_url}


def _lease(spec: dict[str, Any]) -> dict[str, Any]:
    backend = _tier(spec).make_backend()
    try:
        return json.loads(bytes(backend.get(lease_name(0))))  # type: ignore[no-any-return]
    finally:
        backend.close()


def _lease_dir(spec: dict[str, Any]) -> list[str]:
    backend = _tier(spec).make_backend()
    try:
        return sorted(backend.list(f"{LEASE_DIR}/"))
    finally:
        backend.close()


def test_a_live_writer_whose_clock_is_behind_keeps_its_location(
    tmp_path: Path,
    spec: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    record: Recorder,
) -> None:
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", TTL)
    log, held, go, result = (tmp_path / n for n in ("a.log", "held", "go", "result.json"))
    args = {"spec": spec, "held": str(held), "go": str(go), "result": str(result)}
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "import test_clock_skew as t; t._child(sys.argv[1])"
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)],
            stdout=f,
            stderr=f,
            env=env,
            start_new_session=True,
        )
    try:
        _wait(held, proc, log)
        holder = _lease(spec)
        assert holder["host"] == "node-a" and time.time() - holder["renewed"] > SKEW_S - 5
        refusals = []
        with Checkpointer([_tier(spec)], chunk_bytes=64 << 10) as ck:
            # at once: presumed live by the store's clock, so that tier's copy fails (save()
            # does not raise); well past the ttl, having seen it renewed: known live, refused
            with pytest.raises(CheckpointFailed) as failed:
                ck.save(_state(2), 2).wait(timeout=60)
            (first,) = failed.value.errors.values()
            assert isinstance(first, WriterConflict) and first.presumed, repr(first)
            refusals.append(str(first))
            time.sleep(2 * float(TTL))
            with pytest.raises(WriterConflict) as info:
                ck.save(_state(2), 2)
            assert not info.value.presumed
            refusals.append(str(info.value))
        for msg in refusals:
            assert "node-a" in msg and "disagree by about" in msg, msg
            assert "the store wrote it" in msg, msg
        assert "renewed its lease since this writer first found it" in refusals[1]
        assert _lease(spec)["owner"] == holder["owner"]  # still the holder's
        go.write_text("1")
        _wait(result, proc, log)
        done = json.loads(result.read_text())
        assert done == {}, done  # the holder never lost its location: step 3 committed
        # no probe object left behind by the refused writer
        assert not [n for n in _lease_dir(spec) if n.endswith(".probe")], _lease_dir(spec)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
    # the holder is dead now: once the store has not seen a renewal for the ttl, it is
    # taken over (the holder's clock still says its lease is 10 minutes old)
    time.sleep(float(TTL) + 1.5)
    with Checkpointer([_tier(spec)], chunk_bytes=64 << 10) as ck:
        ck.save(_state(4), 4).wait(timeout=60)
    with Checkpointer([_tier(spec)]) as ck:
        for step in (1, 3, 4):
            got = ck.load(step=step)
            assert torch.equal(got["w"], _state(step)["w"]) and got["step"] == step
        with pytest.raises(tierckpt.CheckpointNotFound):
            ck.load(step=2)  # the refused writer committed nothing
    record(
        "one_writer",
        f"a live writer whose clock runs {SKEW_S:.0f} s behind ({spec['kind']})",
        "second job refused twice (its clock ahead: the lease looked 10 min old; the store "
        "wrote it within the ttl); the holder kept saving; taken over once it died",
    )


def _skewed_lease(backend: LocalBackend, renewed: float, ttl: float = 60.0) -> None:
    me = tierckpt.lease.HostIdentity.current()
    rec = LeaseRecord("f" * 32, "node-b", "0" * 36, "pid:[1]", 4242, 1, renewed, renewed, ttl)
    assert rec.host != me.host
    backend.put_atomic(lease_name(0), rec.encode(), overwrite=True)


def test_a_store_without_times_keeps_the_age_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the store keeps no modification times (or the probe fails), the lease's age
    decides, as before; where it keeps them, a lease it wrote just now is live."""
    backend = LocalBackend(tmp_path / "run")
    _skewed_lease(backend, time.time() - SKEW_S)
    lease = WriterLease(backend, "local", 0, "a" * 32, 60.0)
    with pytest.raises(WriterConflict, match="disagree by about 6"):
        lease.acquire()
    assert backend.list(f"{LEASE_DIR}/") == [lease_name(0)]  # the probe is gone again
    monkeypatch.setattr(LocalBackend, "modified", lambda self, name: None)
    lease.acquire()  # judged by its age alone: taken over
    assert json.loads(bytes(backend.get(lease_name(0))))["owner"] == "a" * 32
    lease.release()

    def broken(self: Any, name: str) -> float:
        raise OSError("stat failed")

    _skewed_lease(backend, time.time() - SKEW_S)
    monkeypatch.setattr(LocalBackend, "modified", broken)
    lease = WriterLease(backend, "local", 0, "b" * 32, 60.0)
    lease.acquire()
    assert json.loads(bytes(backend.get(lease_name(0))))["owner"] == "b" * 32
    lease.release()
    backend.close()


def test_a_lease_old_by_the_store_clock_too_is_taken_over(tmp_path: Path) -> None:
    backend = LocalBackend(tmp_path / "run")
    _skewed_lease(backend, time.time() - SKEW_S)
    path = backend.local_path(lease_name(0))
    assert path is not None
    old = time.time() - SKEW_S
    os.utime(path, (old, old))  # the store wrote it 10 minutes ago too: its holder is gone
    lease = WriterLease(backend, "local", 0, "c" * 32, 60.0)
    lease.acquire()
    assert json.loads(bytes(backend.get(lease_name(0))))["owner"] == "c" * 32
    lease.release()
    backend.close()


def test_gc_and_ls_see_a_live_writer_whose_clock_is_behind(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: Recorder
) -> None:
    """``tierckpt gc`` refuses a location with a live writer (it would remove that writer's
    saves in progress); judged by age alone, a live writer whose clock is behind looked dead."""
    from tierckpt.cli import main

    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=256 << 10) as ck:
        for s in (1, 2, 3):
            ck.save(_state(s), s).wait(timeout=60)
    backend = LocalBackend(root)
    _skewed_lease(backend, time.time() - SKEW_S)  # the store wrote it just now
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "node-b" in out and "live" in out and "disagree by about" in out, out
    assert main(["gc", str(root), "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "live writer" in err and "--force" in err, err
    assert len(backend.list("manifests/")) == 3  # refused: nothing deleted
    assert not [n for n in backend.list(f"{LEASE_DIR}/") if n.endswith(".probe")]
    path = backend.local_path(lease_name(0))
    assert path is not None
    old = time.time() - SKEW_S
    os.utime(path, (old, old))  # not written for 10 minutes by the store's clock either
    assert main(["gc", str(root), "--keep-last", "1"]) == 0  # dead: gc goes ahead
    assert len(backend.list("manifests/")) == 1
    backend.close()
    record(
        "one_writer",
        f"tierckpt ls / gc with a live writer whose clock runs {SKEW_S:.0f} s behind",
        "ls says live (and by how much the clocks disagree), gc refuses without --force; "
        "once the store has not seen it for the ttl, gc goes ahead",
    )
