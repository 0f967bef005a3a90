"""``tierckpt gc --dry-run`` names what the real run deletes when a writer was killed in the
middle of a save newer than the newest checkpoint: the real run's sweep removes a killed
writer's temporary files whatever their step (no process holds their ``flock``), and with
them a save of nothing else, where the dry run said it would keep that save ("a save in
progress") and ``inspect`` / ``verify`` named ``--abort-incomplete`` as what removes it. A
live writer's save in progress is kept by both."""

from __future__ import annotations

import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends import _templock
from tierckpt.backends.base import Backend
from tierckpt.cli import main
from tierckpt.format import CheckpointId, manifest_name, shard_name
from tierckpt.offline import gc, open_backend

ROOT = Path(__file__).resolve().parents[1]

#: a trainer that commits step 1, then stalls in the middle of writing step 2's shard file
#: (its temporary created and locked by the real save path, its first bytes written)
WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from tierckpt import Checkpointer, LocalTier
    from tierckpt.backends import local

    root, ready = sys.argv[1], Path(sys.argv[2])
    ck = Checkpointer([LocalTier(root, keep_last=None)])
    ck.save({"w": torch.zeros(1000)}, step=1).wait()
    write = local._LocalWriter.write

    def stalled(self, offset, data):
        write(self, offset, data)
        ready.write_text(self._tmp)
        time.sleep(600)

    local._LocalWriter.write = stalled
    ck.save({"w": torch.ones(1 << 20)}, step=2)
    time.sleep(600)
    """
)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _leftovers(out: str, dry_run: bool) -> list[str]:
    """The steps a gc's output says it deleted (would delete) as uncommitted leftovers."""
    verb = "would delete" if dry_run else "deleted"
    m = re.search(rf"^{verb} (\d+) uncommitted leftover\(s\)(?:: (.*))?$", out, re.M)
    assert m is not None, out
    named = m.group(2).split(", ") if m.group(2) else []
    assert len(named) == int(m.group(1)), out
    return named


def _temps(root: Path) -> list[Path]:
    return sorted(root.rglob("*.tmp"))


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """A live writer stalled in the middle of its save of step 2 (step 1 committed): the
    process, its tier folder and its temporary file of step 2's shard."""
    root, ready = tmp_path / "run", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(ready)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (ready.exists() and ready.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                pytest.fail(f"the writer never began step 2 (rc {proc.poll()}): {err[-3000:]}")
            time.sleep(0.02)
        tmp = Path(ready.read_text())
        assert tmp.exists() and tmp.name.startswith(Path(shard_name(2, 0)).name), tmp
        assert (root / manifest_name(1)).exists() and not (root / manifest_name(2)).exists()
        yield proc, root, tmp
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(60)
        if proc.stderr:
            proc.stderr.close()


def test_a_dry_run_names_the_save_of_a_killed_writer_that_the_real_run_deletes(
    writer: tuple[subprocess.Popen[bytes], Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, root, tmp = writer
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL
    assert _templock.locks_prove_liveness(str(tmp.parent)), "a file system without flock"

    # inspect / verify name the command that removes it: a plain gc, as the real run does
    for command in ("inspect", "verify"):
        rc, _out, err = _run([command, str(root), "--step", "2"], capsys)
        assert rc == 1 and "unfinished writes only, no manifest): abandoned" in err, err
        assert f"`tierckpt gc {root} --keep-last 1` removes it (its writer was killed" in err, err
        assert "--abort-incomplete" not in err, err

    rc, dry, _err = _run(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    assert rc == 0 and tmp.exists()
    assert "kept 1 uncommitted" not in dry and "would refuse" not in dry, dry
    rc, real, _err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 0
    # the dry run said what the real one did: step 2's save, nothing committed
    assert _leftovers(dry, True) == _leftovers(real, False) == ["2"], (dry, real)
    assert "of which 2: not older than the newest checkpoint" in dry, dry
    assert not tmp.exists() and _temps(root) == []
    assert Checkpointer([LocalTier(root)]).steps() == [1]


def test_a_live_writers_save_in_progress_is_kept_by_the_dry_run_and_the_real_one(
    writer: tuple[subprocess.Popen[bytes], Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    proc, root, tmp = writer
    rc, _out, err = _run(["inspect", str(root), "--step", "2"], capsys)
    assert rc == 1 and "probably in flight, as a live writer holds this location" in err, err

    # without --force: the dry run says the real one refuses, and it does, deleting nothing
    rc, dry, _err = _run(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    assert rc == 0 and _leftovers(dry, True) == [], dry
    assert "kept 1 uncommitted save(s) not older than the newest checkpoint: 2 (a save in " in dry
    assert "a live process holds its unfinished writes" in dry, dry
    assert "without --dry-run gc would refuse and delete nothing" in dry, dry
    rc, _out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 1 and "has a live writer" in err, err
    assert tmp.exists()

    # with --force: both keep the save in progress (its writer holds its temporary's lock)
    argv = ["gc", str(root), "--keep-last", "1", "--force"]
    rc, dry, _err = _run([*argv, "--dry-run"], capsys)
    assert rc == 0 and "would refuse" not in dry, dry
    rc, real, _err = _run(argv, capsys)
    assert rc == 0
    assert _leftovers(dry, True) == _leftovers(real, False) == [], (dry, real)
    assert "kept 1 uncommitted save(s) not older than the newest checkpoint: 2" in real, real
    assert tmp.exists() and _temps(root) == [tmp]
    assert proc.poll() is None  # still at work

    # the same writer killed: now both name its save, and the real run removes it
    proc.kill()
    proc.wait(60)
    rc, dry, _err = _run(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    rc, real, _err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert _leftovers(dry, True) == _leftovers(real, False) == ["2"], (dry, real)
    assert not tmp.exists()


def _dead_temp(root: Path, step: int) -> Path:
    """A temporary file of ``step``'s shard that no process holds (its writer killed)."""
    tmp = root / f"{shard_name(step, 0)}.0123456789ab.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"x" * 100)
    return tmp


def test_where_locks_prove_nothing_both_keep_it_and_name_abort_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a file system whose locks prove nothing (NFS), the sweep removes no temporary file,
    and the dry run, the real run and the hints agree on it."""
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        ck.save({"w": torch.zeros(10)}, step=1).wait()
    tmp = _dead_temp(root, 2)
    monkeypatch.setattr(_templock, "locks_prove_liveness", lambda path: False)
    rc, _out, err = _run(["verify", str(root), "--step", "2"], capsys)
    assert rc == 1 and f"`tierckpt gc {root} --keep-last 1 --abort-incomplete` removes" in err
    rc, dry, _err = _run(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    rc, real, _err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert _leftovers(dry, True) == _leftovers(real, False) == [], (dry, real)
    for out in (dry, real):
        assert "2 (the store cannot tell whether the writer" in out, out
    assert tmp.exists()


def test_dead_writes_in_folders_gc_keeps_are_named_by_both(tmp_path: Path) -> None:
    """A killed writer's temporary file in a committed checkpoint's folder, and one beside a
    completed shard file of an uncommitted save: the sweep removes them, the folders stay."""
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for step in (1, 2):
            ck.save({"w": torch.zeros(10)}, step=step).wait()
    os.remove(root / manifest_name(2))  # 2: a completed shard file, no manifest
    # another rank's shard file, its writer killed midway
    in_committed = (root / shard_name(1, 0)).parent / "rank-000001.tck.0123456789ab.tmp"
    in_committed.write_bytes(b"x")
    in_save = (root / shard_name(2, 0)).parent / "rank-000001.tck.0123456789ab.tmp"
    in_save.write_bytes(b"x")
    backend = open_backend(str(root))
    dry = gc(backend, 1, dry_run=True)
    assert (dry.leftovers, dry.kept_uncommitted, dry.dead_saves) == ([], [CheckpointId(2)], [])
    real = gc(backend, 1)
    assert dry.dead_writes == real.dead_writes and [c.step for c in real.dead_writes] == [1, 2]
    assert real.kept_uncommitted == dry.kept_uncommitted
    assert not in_committed.exists() and not in_save.exists()
    assert (root / shard_name(2, 0)).exists() and (root / manifest_name(1)).exists()


def test_every_store_that_removes_dead_writes_is_judged_by_the_dry_run() -> None:
    """The dry run's read-only twin of ``remove_dead_incomplete`` looks at a local folder's
    temporary files: a store that removes dead writes another way would make a dry run
    promise less than the real run deletes."""
    import tierckpt.backends.local
    import tierckpt.backends.memory
    import tierckpt.noderam  # noqa: F401
    from tierckpt.backends.local import LocalBackend

    for name in ("tierckpt.backends.s3", "tierckpt.backends.objstore"):
        try:
            __import__(name)
        except ImportError:
            pass
    seen: list[type[Backend]] = []
    todo = list(Backend.__subclasses__())
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo += cls.__subclasses__()
    for cls in seen:
        # unwrapped: the object-store backend wraps the base's (guard_panics)
        if inspect.unwrap(cls.remove_dead_incomplete) is not Backend.remove_dead_incomplete:
            assert issubclass(cls, LocalBackend), cls
            assert cls.remove_dead_incomplete is LocalBackend.remove_dead_incomplete, cls
