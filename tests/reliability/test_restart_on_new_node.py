"""A job restarted on another node finds its dead predecessor's lease on S3: training goes on.

A writer's lease on a location where no process or lock file of this machine can say whether
its holder runs (S3 alone, and the holder on another node, or in a container that named no
lock file) counts as live until its ttl (60 s) has passed since its last renewal. A job that
crashed and was restarted on a new node within that minute (a Kubernetes pod rescheduled, a
Slurm requeue) met its own dead predecessor's lease, and its ``save()`` raised
``WriterConflict``: the training loop died at its first checkpoint, and a restart policy made
that a crash loop until the minute had passed, losing the steps trained each time.

Now a holder only *presumed* live by its lease's age does not make ``save()`` raise: that
tier's copy fails (nothing written there; the other tiers save), the next save asks again, and
once the lease is past its ttl it is taken over and the copies commit. A holder that renews its
lease while the new job watches is known to run: ``save()`` raises ``WriterConflict`` then, as
it does at once for a holder known live by its process or lock file. Real processes, S3 on
moto; "another node" is a child whose leases name another host and boot id.
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
from tierckpt import Checkpointer, CheckpointFailed, S3Tier, WriterConflict
from tierckpt.testing.s3servers import S3Server

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LEASE = "leases/rank-000000.json"
TTL = 3.0  # seconds: renewed every 0.75 s


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 14, generator=g), "step": step}


def _child(argv: str) -> None:
    """A writer on "another node": saves step 1, touches ``held``, then idles (renewing its
    lease) until killed."""
    a = json.loads(argv)
    identity = tierckpt.lease.HostIdentity
    fake = identity("node-a", "boot-of-node-a", "pid:[1]")
    identity.current = staticmethod(lambda: fake)  # type: ignore[method-assign]
    tier = S3Tier(a["url"], endpoint_url=a["endpoint"], codec="raw")
    ck = Checkpointer([tier], chunk_bytes=64 << 10, host_buffer_bytes=4 << 20)
    ck.save(_state(1), 1).wait(timeout=120)
    Path(a["held"]).write_text("1")
    time.sleep(3600)


def _start_other_node(tmp_path: Path, url: str, endpoint: str) -> subprocess.Popen[bytes]:
    held, log = tmp_path / "held", tmp_path / "node-a.log"
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "import test_restart_on_new_node as t; t._child(sys.argv[1])"
    )
    args = {"url": url, "endpoint": endpoint, "held": str(held)}
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", TIERCKPT_LEASE_TTL=str(TTL))
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(args)],
            stdout=f,
            stderr=f,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 120
    while not held.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill(proc)
            raise AssertionError(f"the other node's writer did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return proc


def _kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _lease(server: S3Server, bucket: str) -> dict[str, Any]:
    body = server.admin.get_object(Bucket=bucket, Key=f"run/{LEASE}")["Body"].read()
    return json.loads(body)  # type: ignore[no-any-return]


def test_a_job_restarted_on_a_new_node_trains_through_its_dead_predecessors_lease(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    record: Recorder,
) -> None:
    bucket = s3_bucket(moto_server)
    url, endpoint = f"s3://{bucket}/run", moto_server.endpoint_url
    proc = _start_other_node(tmp_path, url, endpoint)
    _kill(proc)  # the node is lost: its lease stays, renewed less than a ttl ago
    monkeypatch.setenv("TIERCKPT_LEASE_TTL", str(TTL))
    skipped: list[int] = []
    committed: int | None = None
    t0 = time.monotonic()
    with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
        assert int(ck.load()["step"]) == 1  # the restart resumes from the dead job's step
        for step in range(2, 200):
            handle = ck.save(_state(step), step)  # never raises: training goes on
            try:
                handle.wait(timeout=60)
            except CheckpointFailed as exc:
                why = exc.errors["s3"]
                assert isinstance(why, WriterConflict) and why.presumed, repr(why)
                msg = str(why)
                assert "node-a" in msg and "cannot tell whether that job still runs" in msg, msg
                skipped.append(step)
                assert time.monotonic() - t0 < 60, f"not taken over in 60 s: {msg}"
                time.sleep(0.25)
                continue
            committed = step
            break
        took = time.monotonic() - t0
        assert committed is not None and skipped, (skipped, committed)
        assert _lease(moto_server, bucket)["pid"] == os.getpid()  # taken over
        steps = ck.steps()
    assert steps == [1, committed], steps  # the skipped saves wrote nothing there
    with Checkpointer([S3Tier(url, endpoint_url=endpoint)]) as reader:
        got = reader.load()
        assert int(got["step"]) == committed and torch.equal(got["w"], _state(committed)["w"])
    record(
        "one_writer",
        "a job restarted on a new node, S3 only (its predecessor's lease within its ttl)",
        f"save() never raised; {len(skipped)} copies skipped, then taken over and committed "
        f"{took:.1f} s after the restart (ttl {TTL:.0f} s)",
    )


def test_a_live_job_on_another_node_is_refused_once_seen_renewing(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    record: Recorder,
) -> None:
    bucket = s3_bucket(moto_server)
    url, endpoint = f"s3://{bucket}/run", moto_server.endpoint_url
    proc = _start_other_node(tmp_path, url, endpoint)
    try:
        holder = _lease(moto_server, bucket)
        monkeypatch.setenv("TIERCKPT_LEASE_TTL", str(TTL))
        refused: WriterConflict | None = None
        skipped = 0
        with Checkpointer([S3Tier(url, endpoint_url=endpoint, codec="raw")]) as ck:
            for step in range(2, 200):
                try:
                    handle = ck.save(_state(step), step)
                except WriterConflict as exc:
                    refused = exc
                    break
                with pytest.raises(CheckpointFailed) as info:
                    handle.wait(timeout=60)
                assert getattr(info.value.errors["s3"], "presumed", False), info.value.errors
                skipped += 1
                assert skipped < 100, "a renewing holder was never found live"
                time.sleep(0.25)
        assert refused is not None and not refused.presumed
        msg = str(refused)
        assert "renewed its lease since this writer first found it" in msg, msg
        assert "node-a" in msg and "tierckpt unlock" in msg, msg
        assert _lease(moto_server, bucket)["owner"] == holder["owner"]  # untouched
        listed = moto_server.admin.list_objects_v2(Bucket=bucket, Prefix="run/manifests/")
        names = [o["Key"] for o in listed.get("Contents", [])]
        assert len(names) == 1, names  # the holder's step 1 only: the refused job wrote none
    finally:
        _kill(proc)
    record(
        "one_writer",
        "a live job on another node (S3 only, lease renewed every ttl/4)",
        f"{skipped} copies skipped while presumed live, then save() raised WriterConflict "
        "once a renewal was seen; nothing written",
    )
