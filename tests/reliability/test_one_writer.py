"""One writer per run location: a second job is refused at once, and nothing of the first is lost.

Two jobs pointed at the same run folder or S3 prefix used to corrupt each other: with the same
steps the loser overwrote the winner's committed shards; with different steps the winner's
retention deleted the loser's saves in progress and the loser's manifests pointed at deleted
data. Two ``Checkpointer``s of one process sharing ``MemoryTier()``'s
default namespace did the same to each other's RAM copy.

Now a writer takes a lease (``leases/rank-<r>.json``) on every tier at its first save; the
scenario above is run with real processes on a local folder and on S3 (moto and
SeaweedFS): the second job's every save is refused with ``WriterConflict`` before it writes
anything, and every checkpoint the first job committed loads bit-exact afterwards. Then the
ways a lease changes hands: a SIGKILLed writer restarted on the same host takes over at once; a
lease from another host is taken over only once its renewals stopped for longer than its ttl;
a writer whose lease was taken over stops writing and deleting there; ``tierckpt unlock``.

The leases are read and crafted here as plain JSON (the format in docs/format.md), not through
``tierckpt.lease``, so that these tests run (and fail at their assertions) on code without it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import Recorder

import tierckpt
from tierckpt import Checkpointer, CheckpointFailed, LocalTier, MemoryTier, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.format import manifest_name, step_prefix
from tierckpt.layout import data_folder_part
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LEASE = "leases/rank-000000.json"
# absent before leases existed: the tests must then fail at their assertions, not at import
WriterConflict: type[BaseException] = getattr(
    tierckpt, "WriterConflict", type("WriterConflict", (Exception,), {})
)
LeaseLost: type[BaseException] = getattr(tierckpt, "LeaseLost", WriterConflict)

BucketFactory = Callable[[S3Server], str]


# -- shared pieces -----------------------------------------------------------------------------


def _state(step: int, job: str, numel: int = 1 << 18) -> dict[str, Any]:
    """A deterministic state per (job, step): 1 MiB of float32 plus small values."""
    g = torch.Generator().manual_seed(2 * step + (job == "B"))
    return {
        "w": torch.randn(numel, generator=g),
        "b": torch.randint(0, 1 << 30, (1000,), generator=g),
        "meta": {"job": job, "step": step},
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _tier_spec(spec: dict[str, Any]) -> Any:
    if spec["kind"] == "local":
        return LocalTier(spec["path"], keep_last=spec.get("keep_last"))
    return S3Tier(
        spec["url"], endpoint_url=spec["endpoint"], codec="raw", keep_last=spec.get("keep_last")
    )


def _local_spec(path: Path, **kw: Any) -> dict[str, Any]:
    return {"kind": "local", "path": str(path), **kw}


def _s3_spec(server: S3Server, bucket: str, **kw: Any) -> dict[str, Any]:
    return {"kind": "s3", "url": f"s3://{bucket}/run", "endpoint": server.endpoint_url, **kw}


def _backend(spec: dict[str, Any]) -> Backend:
    return _tier_spec(spec).make_backend()  # type: ignore[no-any-return]


def _lease_json(
    *, host: str, pid: int, renewed: float, ttl: float = 60.0, owner: str = "f" * 32
) -> bytes:
    """A lease as another machine's writer would have written it (docs/format.md)."""
    return json.dumps(
        {
            "format": "tierckpt-lease",
            "version": 1,
            "owner": owner,
            "host": host,
            "boot_id": "00000000-0000-0000-0000-000000000000",
            "pid_ns": "pid:[1]",
            "pid": pid,
            "pid_start": 1,
            "started": renewed - 3600,
            "renewed": renewed,
            "ttl": ttl,
        }
    ).encode()


def _read_lease(backend: Backend) -> dict[str, Any] | None:
    try:
        return json.loads(bytes(backend.get(LEASE)))  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None


def _put_lease(backend: Backend, data: bytes) -> None:
    backend.put_atomic(LEASE, data, overwrite=True)


# -- child processes -----------------------------------------------------------------------------


def _child(argv: str) -> None:
    """A job in its own process. ``role``:

    ``first``   saves steps ``start``, ``start+1``, ... (waiting for each to commit); after the
                first commit touches ``held`` and waits for ``ready``; goes on until ``stop``
                exists (and at least ``min_steps``); then closes and writes its committed
                steps to ``result``.
    ``second``  touches ``ready`` and at once tries to save ``steps``, beside the first job's
                saves of the same or other steps; records how each ended; touches ``stop``.
    ``hold``    saves step ``start``, touches ``held`` and sleeps until killed.
    ``exit``    saves step ``start`` and ends the process without ``close()``.
    """
    a = json.loads(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    tiers = [_tier_spec(a["tier"])]
    out: dict[str, Any] = {"pid": os.getpid()}
    if a["role"] == "exit":
        ck = Checkpointer(tiers, chunk_bytes=256 << 10, host_buffer_bytes=16 << 20)
        ck.save(_state(a["start"], "A"), a["start"]).wait(timeout=120)
        Path(a["result"]).write_text(json.dumps(out))
        return  # no close(): the interpreter's exit gives the lease back
    if a["role"] in ("first", "hold"):
        ck = Checkpointer(tiers, chunk_bytes=256 << 10, host_buffer_bytes=16 << 20)
        committed = []
        step = a["start"]
        while True:
            ck.save(_state(step, "A"), step).wait(timeout=120)
            committed.append(step)
            if len(committed) == 1:
                Path(a["held"]).touch()
                if a["role"] == "hold":
                    time.sleep(3600)
                _wait_for(Path(a["ready"]))
            if os.path.exists(a["stop"]) and len(committed) >= a["min_steps"]:
                break
            step += 1
            time.sleep(0.02)
        ck.close()
        out["committed"] = committed
    else:
        ck = Checkpointer(tiers, chunk_bytes=256 << 10, host_buffer_bytes=16 << 20)
        attempts = []
        states = {step: _state(step, "B") for step in a["steps"]}
        Path(a["ready"]).touch()
        for step in a["steps"]:
            t0 = time.perf_counter()
            try:
                h = ck.save(states[step], step)
            except Exception as exc:
                attempts.append(
                    {
                        "step": step,
                        "at": "save",
                        "error": type(exc).__name__,
                        "message": str(exc),
                        "seconds": time.perf_counter() - t0,
                    }
                )
            else:
                try:
                    h.wait(timeout=120)
                    attempts.append({"step": step, "at": "handle", "error": None})
                except Exception as exc:
                    attempts.append(
                        {
                            "step": step,
                            "at": "handle",
                            "error": type(exc).__name__,
                            "message": str(exc),
                        }
                    )
            time.sleep(0.02)
        ck.close()
        out["attempts"] = attempts
        Path(a["stop"]).touch()
    Path(a["result"]).write_text(json.dumps(out))


def _wait_for(path: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def _spawn(args: dict[str, Any], log: Path, **env: str) -> subprocess.Popen[bytes]:
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_one_writer as t; t._child(sys.argv[1])"
    child_env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", **env)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)], stdout=f, stderr=f, env=child_env
        )


def _wait_file(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"child exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {timeout} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen[bytes], log: Path, result: Path) -> dict[str, Any]:
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, log.read_text()[-4000:]
    return json.loads(result.read_text())  # type: ignore[no-any-return]


def _two_jobs(tmp_path: Path, spec: dict[str, Any], second_steps: list[int]) -> dict[str, Any]:
    """The issue's scenario: job A saves continuously; job B starts on the same location and
    tries to save ``second_steps`` meanwhile. Returns both results."""
    names = ("held", "ready", "stop", "result-a", "result-b", "a.log", "b.log")
    files = {k: tmp_path / k for k in names}
    a = _spawn(
        {
            "role": "first",
            "tier": spec,
            "start": 1,
            "min_steps": 12,
            "held": str(files["held"]),
            "ready": str(files["ready"]),
            "stop": str(files["stop"]),
            "result": str(files["result-a"]),
        },
        files["a.log"],
    )
    try:
        _wait_file(files["held"], a, files["a.log"])
        b = _spawn(
            {
                "role": "second",
                "tier": spec,
                "steps": second_steps,
                "ready": str(files["ready"]),
                "stop": str(files["stop"]),
                "result": str(files["result-b"]),
            },
            files["b.log"],
        )
        res_b = _finish(b, files["b.log"], files["result-b"])
        res_a = _finish(a, files["a.log"], files["result-a"])
    finally:
        for p in (a,):
            if p.poll() is None:
                p.kill()
    return {"a": res_a, "b": res_b}


def _check_first_job_intact(spec: dict[str, Any], committed: list[int]) -> list[str]:
    """Problems with the first job's checkpoints: every one it committed must be there and
    load bit-exact, and nothing else may be committed there."""
    problems = []
    backend = _backend(spec)
    try:
        stored = sorted(
            int(n[len("manifests/step-") : -len(".json")]) for n in backend.list("manifests/")
        )
    finally:
        backend.close()
    if stored != sorted(committed):
        problems.append(f"committed steps {stored}, the first job committed {sorted(committed)}")
    with Checkpointer([_tier_spec(spec)], repopulate=False) as reader:
        for step in committed:
            try:
                got = reader.load(step)
            except Exception as exc:
                problems.append(f"step {step}: {type(exc).__name__}: {exc}")
                continue
            if not _same(got, _state(step, "A")):
                problems.append(f"step {step}: loaded state differs from what job A saved")
    return problems


def _two_jobs_case(
    tmp_path: Path, spec: dict[str, Any], variant: str, record: Recorder, where: str
) -> None:
    # same: the steps the first job saves next, at the same time; different: newer steps
    second_steps = list(range(2, 14)) if variant == "same" else list(range(1000, 1012))
    res = _two_jobs(tmp_path, spec, second_steps)
    attempts = res["b"]["attempts"]
    refused = [x for x in attempts if x["at"] == "save" and x["error"] == "WriterConflict"]
    problems = _check_first_job_intact(spec, res["a"]["committed"])
    backend = _backend(spec)
    try:
        theirs = {step_prefix(s) for s in second_steps} if variant == "different" else set()
        # format v1 and v2 names alike (v2: under hashed prefixes <hh>/steps/...)
        foreign = [
            n for n in backend.list("") if any(data_folder_part(n).startswith(p) for p in theirs)
        ]
        lease_left = backend.list("leases/")
    finally:
        backend.close()
    ok = len(refused) == len(attempts) and not problems and not foreign and not lease_left
    record(
        "one_writer",
        f"two jobs on one {where}, {variant} steps",
        f"second job: {len(refused)}/{len(attempts)} saves refused with WriterConflict; first "
        f"job: {len(res['a']['committed'])} committed, {len(problems)} problems",
        ok,
    )
    assert len(refused) == len(attempts), f"second job not refused at save(): {attempts}"
    msg = refused[0]["message"]
    assert str(res["a"]["pid"]) in msg and "tierckpt unlock" in msg, msg
    assert refused[0]["seconds"] < 30  # at once: no waiting for a ttl (60 s by default)
    assert not problems, problems
    assert not foreign, f"the second job wrote {foreign[:5]}"
    assert not lease_left, f"the first job did not release its lease: {lease_left}"


# -- two jobs on one location ------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["same", "different"])
def test_second_job_on_a_local_folder_is_refused(
    tmp_path: Path, variant: str, record: Recorder
) -> None:
    spec = _local_spec(tmp_path / "run")
    _two_jobs_case(tmp_path, spec, variant, record, "local folder")


@pytest.mark.s3
@pytest.mark.parametrize("variant", ["same", "different"])
def test_second_job_on_an_s3_prefix_is_refused(
    tmp_path: Path, moto_server: S3Server, s3_bucket: BucketFactory, variant: str, record: Recorder
) -> None:
    spec = _s3_spec(moto_server, s3_bucket(moto_server))
    _two_jobs_case(tmp_path, spec, variant, record, "S3 prefix (moto)")


@pytest.mark.s3
@pytest.mark.slow  # ~40 s; the same code path as moto's, against a real S3 implementation
def test_second_job_on_seaweedfs_is_refused(
    tmp_path: Path, seaweedfs_server: S3Server, s3_bucket: BucketFactory, record: Recorder
) -> None:
    spec = _s3_spec(seaweedfs_server, s3_bucket(seaweedfs_server))
    _two_jobs_case(tmp_path, spec, "same", record, "S3 prefix (SeaweedFS)")


# -- a dead writer's lease -----------------------------------------------------------------------


@pytest.fixture(params=["local", "s3"])
def location(
    request: pytest.FixtureRequest, tmp_path: Path, s3_bucket: BucketFactory
) -> dict[str, Any]:
    if request.param == "local":
        return _local_spec(tmp_path / "run")
    server: S3Server = request.getfixturevalue("moto_server")
    return _s3_spec(server, s3_bucket(server))


def test_sigkilled_writer_restarted_on_the_same_host_takes_over_at_once(
    tmp_path: Path, location: dict[str, Any], caplog: pytest.LogCaptureFixture, record: Recorder
) -> None:
    held, result, log = tmp_path / "held", tmp_path / "result", tmp_path / "hold.log"
    proc = _spawn(
        {
            "role": "hold",
            "tier": location,
            "start": 7,
            "held": str(held),
            "stop": str(tmp_path / "stop"),
            "result": str(result),
            "min_steps": 1,
        },
        log,
        TIERCKPT_LEASE_TTL="3600",  # an hour: taking over must not wait for it
    )
    try:
        _wait_file(held, proc, log)
        backend = _backend(location)
        before = _read_lease(backend)
        assert before is not None and before["pid"] == proc.pid, before
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    with (
        caplog.at_level(logging.WARNING, logger="tierckpt"),
        Checkpointer([_tier_spec(location)], chunk_bytes=256 << 10) as ck,
    ):
        t0 = time.perf_counter()
        ck.save(_state(8, "A"), 8).wait(timeout=120)
        took = time.perf_counter() - t0
        after = _read_lease(backend)
    assert after is not None and after["pid"] == os.getpid(), after
    assert any("taking over" in r.getMessage() for r in caplog.records)
    assert took < 600  # far below the dead writer's ttl of an hour
    with Checkpointer([_tier_spec(location)], repopulate=False) as reader:
        assert _same(reader.load(7), _state(7, "A")) and _same(reader.load(8), _state(8, "A"))
    backend.close()
    record(
        "one_writer",
        f"SIGKILLed writer restarted on the same host ({location['kind']})",
        f"took over at once ({took:.1f} s for the first save), step 7 intact",
    )


def test_lease_of_another_host_taken_over_only_once_stale(
    location: dict[str, Any], caplog: pytest.LogCaptureFixture, record: Recorder
) -> None:
    backend = _backend(location)
    fresh = _lease_json(host="node-b", pid=4242, renewed=time.time())
    _put_lease(backend, fresh)
    with Checkpointer([_tier_spec(location)], chunk_bytes=256 << 10) as ck:
        # renewed within its ttl, by a host this machine cannot ask: presumed live, so this
        # save's copy fails (nothing written) while save() itself does not raise
        with pytest.raises(CheckpointFailed) as failed:
            ck.save(_state(1, "A"), 1).wait(timeout=60)
        why = next(iter(failed.value.errors.values()))
        assert isinstance(why, WriterConflict) and why.presumed, repr(why)
        msg = str(why)
        assert "node-b" in msg and "4242" in msg and "tierckpt unlock" in msg, msg
        assert backend.list("manifests/") == []
        assert [n for n in backend.list("") if data_folder_part(n).startswith("steps/")] == []
        assert bytes(backend.get(LEASE)) == fresh  # the other writer's lease is untouched
        # it renews its lease: it runs, and the next save raises
        renewed = _lease_json(host="node-b", pid=4242, renewed=time.time() + 1)
        _put_lease(backend, renewed)
        with pytest.raises(WriterConflict) as info:
            ck.save(_state(1, "A"), 1)
        assert not info.value.presumed and "renewed its lease since" in str(info.value)
        assert backend.list("manifests/") == []
        assert bytes(backend.get(LEASE)) == renewed
        # the other host stopped renewing: its lease is past its ttl by its clock and by the
        # store's (a lease the store wrote within the ttl would mean a live writer whose
        # clock is behind: test_clock_skew.py)
        _put_lease(backend, _lease_json(host="node-b", pid=4242, renewed=time.time() - 600, ttl=1))
        time.sleep(2.2)  # Last-Modified counts whole seconds
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            ck.save(_state(2, "A"), 2).wait(timeout=120)
        mine = _read_lease(backend)
        assert mine is not None and mine["pid"] == os.getpid()
        assert any("taking over" in r.getMessage() for r in caplog.records)
    assert _read_lease(backend) is None  # released at close
    backend.close()
    record(
        "one_writer",
        f"lease of another host ({location['kind']})",
        "fresh: refused with WriterConflict naming host and pid; stale: taken over",
    )


def test_process_exiting_without_close_gives_its_lease_back(
    tmp_path: Path, location: dict[str, Any]
) -> None:
    result, log = tmp_path / "result", tmp_path / "exit.log"
    proc = _spawn({"role": "exit", "tier": location, "start": 3, "result": str(result)}, log)
    _finish(proc, log, result)
    backend = _backend(location)
    try:
        assert backend.list("leases/") == [], "the exited process kept its writer lease"
        assert backend.exists(manifest_name(3))
    finally:
        backend.close()


@pytest.mark.s3
def test_unreachable_lease_fails_only_that_tier_and_is_retried(
    tmp_path: Path, moto_server: S3Server, s3_bucket: BucketFactory, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(
        moto_server.endpoint_url, [Fault("error500", path_contains="/leases/")]
    ) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, codec="raw", max_attempts=2
        )
        with Checkpointer([LocalTier(tmp_path / "run"), s3], chunk_bytes=256 << 10) as ck:
            h = ck.save(_state(1, "A"), 1)  # no WriterConflict: the store just failed
            with pytest.raises(CheckpointFailed) as info:
                h.wait(timeout=120)
            assert set(info.value.errors) == {"s3"}, info.value.errors
            assert ck.steps("local") == [1] and ck.steps("s3") == []
            assert [k for k in _keys(moto_server, bucket) if "/steps/" in k] == []
            proxy.set_faults([])  # the store is back: the next save takes the lease
            ck.save(_state(2, "A"), 2).wait(timeout=120)
            assert ck.steps("s3") == [2]
            assert f"run/{LEASE}" in _keys(moto_server, bucket)
    assert f"run/{LEASE}" not in _keys(moto_server, bucket)
    record(
        "one_writer",
        "S3 lease unreachable at the first save",
        "only the S3 copy of that step failed; the next save took the lease and committed",
    )


def _keys(server: S3Server, bucket: str) -> list[str]:
    listed = server.admin.list_objects_v2(Bucket=bucket).get("Contents", [])
    return [o["Key"] for o in listed]


# -- one process ---------------------------------------------------------------------------------


def test_two_checkpointers_in_one_process_on_the_default_memory_tier(record: Recorder) -> None:
    MemoryBackend.clear_namespace("default")
    first = Checkpointer([MemoryTier(keep_last=None)], chunk_bytes=256 << 10)
    first.save(_state(1, "A"), 1).wait(timeout=60)
    second = Checkpointer([MemoryTier()], chunk_bytes=256 << 10)
    with pytest.raises(WriterConflict, match="this process") as refused:
        second.save(_state(1, "B"), 1)
    # what to do: close the earlier writer (not "stop the other job" or `tierckpt unlock`)
    assert "close() that writer first" in str(refused.value), refused.value
    assert "unlock" not in str(refused.value), refused.value
    with pytest.raises(WriterConflict):
        second.save(_state(2, "B"), 2)
    first.save(_state(2, "A"), 2).wait(timeout=60)
    assert _same(first.load(1), _state(1, "A")) and _same(first.load(2), _state(2, "A"))
    second.close()
    first.close()
    # an in-process restart: the first one closed, a new one writes (and reads the old step)
    with Checkpointer([MemoryTier()], chunk_bytes=256 << 10) as third:
        assert _same(third.load(), _state(2, "A"))
        third.save(_state(3, "A"), 3).wait(timeout=60)
        assert third.steps() == [3]  # keep_last=1
    MemoryBackend.clear_namespace("default")
    record(
        "one_writer",
        "two Checkpointers on MemoryTier() in one process",
        "second refused with WriterConflict; first intact; a new one works after close",
    )


# -- a writer that lost its lease ----------------------------------------------------------------


def test_lost_lease_stops_writes_and_retention_on_that_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record: Recorder
) -> None:
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", "2")  # renewed every 0.5 s
    root = tmp_path / "run"
    backend = LocalBackend(root)
    other = _lease_json(host="node-b", pid=4242, renewed=time.time() + 3600)
    ck = Checkpointer([LocalTier(root, keep_last=1)], chunk_bytes=256 << 10)
    commit = ck._strategy.commit  # the pipeline takes its commit hook at the first save

    def commit_then_taken_over(*args: Any) -> Any:
        out = commit(*args)
        if args[1].step == 2:  # another writer takes the lease over right after this commit
            _put_lease(backend, other)
        return out

    ck._strategy.commit = commit_then_taken_over  # type: ignore[method-assign]
    try:
        ck.save(_state(1, "A"), 1).wait(timeout=60)
        # the heartbeat: the lease's renewal time moves on while the writer idles
        first = _read_lease(backend)
        assert first is not None
        deadline = time.monotonic() + 60
        while (_read_lease(backend) or first)["renewed"] == first["renewed"]:
            assert time.monotonic() < deadline, "the lease was not renewed within 60 s"
            time.sleep(0.1)
        ck.save(_state(2, "A"), 2).wait(timeout=60)
        # keep_last=1 would delete step 1 now; without the lease retention must not run
        assert ck.steps() == [1, 2]
        h = ck.save(_state(3, "A"), 3)
        with pytest.raises(CheckpointFailed) as info:
            h.wait(timeout=60)
        assert isinstance(info.value.errors["local"], LeaseLost), info.value.errors
        assert "lost" in str(info.value.errors["local"])
        assert not (root / "steps" / f"{3:012d}").exists()
    finally:
        ck.close()
    assert bytes(backend.get(LEASE)) == other  # never overwritten nor released by the loser
    with Checkpointer([LocalTier(root)], repopulate=False) as reader:
        assert _same(reader.load(1), _state(1, "A")) and _same(reader.load(2), _state(2, "A"))
    record(
        "one_writer",
        "lease taken over while writing",
        "retention stopped, later saves fail with LeaseLost, the new owner's lease untouched",
    )


def test_renewal_notices_a_takeover_without_a_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", "1")
    root = tmp_path / "run"
    backend = LocalBackend(root)
    with (
        caplog.at_level(logging.ERROR, logger="tierckpt"),
        Checkpointer([LocalTier(root)], chunk_bytes=256 << 10) as ck,
    ):
        ck.save(_state(1, "A"), 1).wait(timeout=60)
        _put_lease(backend, _lease_json(host="node-b", pid=1, renewed=time.time() + 3600))
        deadline = time.monotonic() + 60
        while not any("lost" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no renewal noticed the takeover in 60 s"
            time.sleep(0.1)
    assert (_read_lease(backend) or {}).get("host") == "node-b"


# -- tierckpt unlock, gc, ls ---------------------------------------------------------------------


def test_cli_unlock_gc_and_ls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], record: Recorder
) -> None:
    from tierckpt.cli import main

    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=256 << 10) as ck:
        for s in (1, 2, 3):
            ck.save(_state(s, "A"), s).wait(timeout=60)
    backend = LocalBackend(root)
    # a job on another machine holds the location (renewed just now)
    _put_lease(backend, _lease_json(host="node-b", pid=4242, renewed=time.time()))
    capsys.readouterr()
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "node-b" in out and "4242" in out and "live" in out, out
    assert main(["gc", str(root), "--keep-last", "1"]) == 1
    err = capsys.readouterr().err
    assert "live writer" in err and "--force" in err, err
    assert len(backend.list("manifests/")) == 3  # refused: nothing deleted
    assert main(["gc", str(root), "--keep-last", "1", "--dry-run"]) == 0
    assert main(["unlock", str(root)]) == 0
    out = capsys.readouterr().out
    assert "removed the writer lease of rank 0" in out and "node-b" in out, out
    assert backend.list("leases/") == []
    with Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=256 << 10) as ck:
        ck.save(_state(4, "A"), 4).wait(timeout=60)
        assert main(["gc", str(root), "--keep-last", "1"]) == 1  # this writer is live
        assert main(["gc", str(root), "--keep-last", "2", "--force"]) == 0
        # unlocking a live writer: it loses the location at its next check, writes nothing
        assert main(["unlock", str(root), "--rank", "0", "--force"]) == 0
        with pytest.raises(CheckpointFailed) as info:
            ck.save(_state(5, "A"), 5).wait(timeout=60)
        assert isinstance(info.value.errors["local"], LeaseLost)
    assert not backend.exists(manifest_name(5))
    assert [int(n[15:27]) for n in backend.list("manifests/")] == [3, 4]
    record(
        "one_writer",
        "tierckpt unlock / gc / ls with a writer lease",
        "ls shows the holder, gc refuses without --force, unlock removes it",
    )


# -- several ranks -------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("api", ["checkpointer", "dcp"])
@pytest.mark.parametrize("second_world", [2, 4])
def test_second_multi_rank_job_is_refused_on_every_rank(
    tmp_path: Path, record: Recorder, second_world: int, api: str
) -> None:
    """A second job on a live 2-rank job's folder is refused on every rank before any rank
    writes: with 4 ranks, ranks 2 and 3 find their leases free, and are refused because
    ranks 0 and 1 were (they wrote stray shard files there before). The same for a second
    job that saves with ``dcp.save`` through a TierWriter, twice (its retry is refused as
    well, and no rank keeps a lease)."""
    import dist_workers

    root = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.mkdir()
    first: dict[str, Any] = {}

    def run_first() -> None:
        try:
            first["res"] = dist_workers.run(
                "w_one_writer", 2, timeout=300, root=str(root), gate=str(gate), role="first"
            )
        except BaseException as exc:
            first["err"] = exc
            (gate / "go").touch()

    t = threading.Thread(target=run_first)
    t.start()
    try:
        deadline = time.monotonic() + 240
        while not all((gate / f"held-{r}").exists() for r in (0, 1)) and "err" not in first:
            assert time.monotonic() < deadline, "the first job did not commit its first step"
            time.sleep(0.1)
        before = set(LocalBackend(root).list())
        second = dist_workers.run(
            "w_one_writer",
            second_world,
            timeout=300,
            root=str(root),
            gate=str(gate),
            role="second",
            api=api,
        )
        written = set(LocalBackend(root).list()) - before
    finally:
        (gate / "go").touch()
        t.join(300)
    assert "err" not in first, first.get("err")
    if api == "dcp":  # DCP wraps each rank's error in its CheckpointException
        want = {"errors": ["CheckpointException: True"] * 2, "holds_leases": False}
        assert second == [want] * second_world, second
    else:
        assert [r["error"] for r in second] == ["WriterConflict"] * second_world, second
    assert not written, f"the second job wrote {sorted(written)[:5]}"
    committed = first["res"][0]["committed"]
    assert committed == [1, 2, 3]
    assert sorted(int(n[15:27]) for n in LocalBackend(root).list("manifests/")) == committed
    record(
        "one_writer",
        f"second {second_world}-rank job on a 2-rank job's folder"
        + (" (dcp.save through a TierWriter, twice)" if api == "dcp" else ""),
        f"refused with WriterConflict on all {second_world} ranks before any wrote; the first "
        "job committed all its steps",
    )


@pytest.mark.distributed
def test_a_refused_dcp_job_takes_every_lease_again_once_the_location_is_free(
    tmp_path: Path,
) -> None:
    """A 2-rank DCP job refused because another writer holds rank 0's lease (rank 1 took
    its free lease, then gave it back) saves through the same TierWriter once that writer
    closed: it commits, and every rank holds its lease again (none writes without one)."""
    import dist_workers

    root = tmp_path / "run"
    gate = tmp_path / "gate"
    gate.mkdir()
    held = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    held.save(_state(1, "A"), 1).wait(timeout=60)  # holds rank 0's lease
    out: dict[str, Any] = {}

    def second() -> None:
        try:
            out["res"] = dist_workers.run(
                "w_dcp_refused_then_free", 2, timeout=300, root=str(root), gate=str(gate)
            )
        except BaseException as exc:
            out["err"] = exc

    t = threading.Thread(target=second)
    t.start()
    try:
        deadline = time.monotonic() + 240
        while not all((gate / f"refused-{r}").exists() for r in (0, 1)) and t.is_alive():
            assert time.monotonic() < deadline, "the second job was not refused"
            time.sleep(0.1)
        # refused: nothing of step 100 written
        assert not [n for n in LocalBackend(root).list() if "000000000100" in n]
    finally:
        held.close()
        (gate / "free").touch()
        t.join(300)
    assert "err" not in out, out.get("err")
    assert out["res"] == [{"errors": [True, None], "holds_leases": True}] * 2, out["res"]
    assert _committed_steps(root) == [1, 100]


def _committed_steps(root: Path) -> list[int]:
    """The steps committed in ``root`` (read as a fresh Checkpointer sees them)."""
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        return ck.steps()


@pytest.mark.distributed
def test_a_first_save_that_fails_on_one_rank_fails_on_every_rank(tmp_path: Path) -> None:
    """The agreement of a job's first save (every rank reaches it, whatever went wrong on
    one): a rank whose state cannot be saved raises, the others raise instead of writing
    (or waiting in the agreement for ever), and the next save commits on every rank."""
    import dist_workers

    res = dist_workers.run("w_first_save_fails_on_one_rank", 3, timeout=300, root=str(tmp_path))
    assert [r["error"] for r in res] == [
        "CheckpointFailed",
        "UnsupportedObject",
        "CheckpointFailed",
    ]
    assert [r["steps"] for r in res] == [[2], [2], [2]]
    step1 = [n for n in LocalBackend(tmp_path).list() if "000000000001" in n]
    assert not step1, f"step 1 was written: {step1[:5]}"


@pytest.fixture(autouse=True)
def _no_leftover_default_memory() -> Iterator[None]:
    yield
    MemoryBackend.clear_namespace("default")
