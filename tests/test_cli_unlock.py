"""``tierckpt unlock`` refuses a writer this machine sees running (its process here) unless
``--force``; it unlocks a dead holder, and one presumed live only by its lease's age (a job on
another machine: the case unlock exists for)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main
from tierckpt.lease import lease_name
from tierckpt.liveness import LeaseRecord

LEASE = lease_name(0)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _save(ck: Checkpointer, step: int) -> None:
    ck.save({"w": torch.full((1000,), float(step))}, step).wait(timeout=60)


def test_unlock_refuses_a_writer_running_here_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    backend = LocalBackend(root)
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        _save(ck, 1)
        held = bytes(backend.get(LEASE))
        capsys.readouterr()
        rc, out, err = _run(["unlock", str(root)], capsys)
        assert rc == 1, (out, err)
        pid = json.loads(held)["pid"]
        assert str(pid) in err and "live" in err, err
        assert "Stop that job first" in err and "--force" in err, err
        assert "Traceback" not in err and "removed" not in out
        assert bytes(backend.get(LEASE)) == held  # untouched
        _save(ck, 2)  # the writer keeps its location
        rc, out, err = _run(["unlock", str(root), "--rank", "0", "--force"], capsys)
        assert rc == 0, err
        assert "removed the writer lease of rank 0" in out and "(--force)" in out, out
        assert not backend.exists(LEASE)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_unlock_removes_a_dead_holders_lease(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = LocalBackend(tmp_path / "run")
    rec = dataclasses.replace(LeaseRecord.mine("a" * 32, 60.0), pid=_dead_pid(), pid_start=1)
    backend.put_atomic(LEASE, rec.encode())
    rc, out, err = _run(["unlock", backend.url], capsys)
    assert rc == 0, err
    assert "removed the writer lease of rank 0" in out and "dead" in out, out
    assert not backend.exists(LEASE)


def test_unlock_removes_a_lease_presumed_live_by_its_age(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job on another machine, renewed just now: nothing here can ask its process, and
    a dead job there looks the same, so unlock removes it and says how it was judged."""
    backend = LocalBackend(tmp_path / "run")
    now = time.time()
    rec = dataclasses.replace(
        LeaseRecord.mine("b" * 32, 60.0),
        host="node-b",
        boot_id="00000000-0000-0000-0000-000000000000",
        pid=4242,
        renewed=now,
        started=now - 3600,
    )
    backend.put_atomic(LEASE, rec.encode())
    rc, out, err = _run(["ls", backend.url, "--json"], capsys)
    leases = json.loads(out)["leases"]
    assert leases[0]["alive"] and leases[0]["presumed"], leases
    rc, out, err = _run(["unlock", backend.url], capsys)
    assert rc == 0, err
    assert "node-b" in out and "4242" in out, out
    assert "presumed live by its lease's age" in out, out
    assert not backend.exists(LEASE)


def test_unlock_of_an_unreadable_lease_says_so_not_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a damaged lease file, or a newer tierckpt's: unlock removes it without --force (nobody
    # can tell it is live), and said "that writer was live (--force)" of it
    root = tmp_path / "run"
    backend = LocalBackend(root)
    backend.put_atomic(LEASE, b'{"format": "tierckpt-lease", "version": 99}')
    rc, out, err = _run(["unlock", str(root)], capsys)
    assert rc == 0, (out, err)
    assert "--force" not in out and "could not be read" in out, out
    assert not backend.exists(LEASE)


def test_a_writer_whose_lease_was_removed_is_told_to_restart(tmp_path: Path) -> None:
    # rm -rf leases/ (or unlock --force) beside a running job: its saves fail there for good,
    # and were told "Two jobs are pointed at one location: stop one of them" with one job
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root)]) as ck:
        _save(ck, 1)
        (root / LEASE).unlink()
        with pytest.raises(Exception) as info:
            _save(ck, 2)
    text = str(info.value) + str(info.value.__cause__ or "")
    assert "restart this job" in text and "Two jobs" not in text, text
