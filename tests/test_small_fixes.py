"""Four everyday situations that used to go wrong quietly.

* An evaluator loading the newest step beside a trainer with ``keep_last=1``: retention
  removed the step ``load()`` had chosen, and it raised ``CheckpointNotFound`` although a newer
  step was committed. Two real processes; not one ``CheckpointNotFound`` is allowed.
* ``tierckpt export`` wrote one file per top-level key and silently dropped the tensors of a
  key whose file name sanitized like another's (exit status 0).
* A save skipped with ``on_busy="skip"`` looked committed to ``h.wait()`` / ``h.result()``.
* A read-only tier location raised a raw ``OSError`` (a ``PermissionError`` with no hint).
  The child runs without the right to override file permissions (root drops
  ``CAP_DAC_OVERRIDE`` before exec), so the folder really is read-only for it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import tierckpt
from tierckpt import (
    Checkpointer,
    CheckpointFailed,
    CheckpointSkipped,
    LocalTier,
    TierCkptError,
)
from tierckpt.backends.local import LocalBackend
from tierckpt.format import shard_name
from tierckpt.policy import LocalTier as _LocalTier

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _run_py(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=timeout,
        cwd=REPO,
    )


# -- (a) load() beside a trainer whose retention removes the step it chose -------------------

TRAINER = """
import os, sys, time, torch
from tierckpt import Checkpointer, LocalTier
root, stop = sys.argv[1], sys.argv[2]
with Checkpointer([LocalTier(root, keep_last=1)], chunk_bytes=1 << 20) as ck:
    step = 0
    while not os.path.exists(stop) and step < 5000:
        step += 1
        # 8 MiB: a load takes long enough for retention to remove the step under it
        ck.save({"w": torch.full((2 << 20,), float(step)), "step": step}, step).wait()
print("trainer saved", step, flush=True)
"""

EVALUATOR = """
import json, os, sys, time, torch
from tierckpt import Checkpointer, CheckpointNotFound, LocalTier
root, stop, loads = sys.argv[1], sys.argv[2], int(sys.argv[3])
ck = Checkpointer([LocalTier(root)], chunk_bytes=1 << 20)
deadline = time.monotonic() + 120
while not ck.steps() and time.monotonic() < deadline:
    time.sleep(0.01)  # the trainer's first commit
not_found, ok, bad, errors = 0, 0, 0, []
for _ in range(loads):
    try:
        s = ck.load()
    except CheckpointNotFound as exc:
        not_found += 1
        errors.append(str(exc)[:200])
        continue
    ok += 1
    if not bool((s["w"] == float(s["step"])).all()):
        bad += 1  # a torn mix of two steps
open(stop, "w").close()
ck.close()
print(json.dumps({"not_found": not_found, "ok": ok, "bad": bad, "errors": errors[:3]}))
"""


def test_load_beside_keep_last_1_trainer_never_misses_a_committed_step(tmp_path: Path) -> None:
    root, stop = tmp_path / "run", tmp_path / "stop"
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(TRAINER), str(root), str(stop)],
        env=_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ev = _run_py(EVALUATOR, str(root), str(stop), "150", timeout=400)
    finally:
        stop.touch()
        t_out, t_err = trainer.communicate(timeout=120)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert trainer.returncode == 0, t_err[-3000:]
    got = json.loads(ev.stdout.strip().splitlines()[-1])
    saved = int(t_out.split()[-1])
    assert saved > 20, f"the trainer saved only {saved} steps beside the evaluator"
    assert got["bad"] == 0
    assert got["not_found"] == 0, got  # a committed step existed at every load
    assert got["ok"] == 150


def test_load_of_a_really_missing_shard_still_fails(tmp_path: Path) -> None:
    """The re-listing is bounded: a listed step whose data is gone still raises."""
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.ones(10)}, 1).wait()
        b: LocalBackend = ck.backend("local")
        for name in b.list(shard_name(1, 0).split("/")[0] + "/"):  # format v2: its prefix
            b.delete(name)
        # a committed step whose data is gone is damage, not "nothing committed"
        with pytest.raises(tierckpt.CorruptCheckpoint):
            ck.load()


# -- (b) export: two top-level keys that sanitize to one file name ---------------------------


def test_export_refuses_keys_that_sanitize_alike(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    src = tmp_path / "ck"
    state = {"a/b": {"w": torch.ones(4)}, "a_b": {"w": torch.zeros(4)}, "step": 3}
    with Checkpointer([LocalTier(src)]) as ck:
        ck.save(state, 3).wait()
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "export", str(src), str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "'a/b'" in p.stderr and "'a_b'" in p.stderr and "--single-file" in p.stderr
    assert not list(out.glob("*.safetensors"))  # nothing half-exported
    # the way out the message names keeps every tensor
    p = subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "export", "--single-file", str(src), str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file

    got = load_file(str(out / "state.safetensors"))
    assert_same(got, {"a/b.w": torch.ones(4), "a_b.w": torch.zeros(4)})


# -- (c) a skipped save is never taken for a committed one -----------------------------------


def test_skipped_save_raises_checkpoint_skipped(tmp_path: Path) -> None:
    gate = threading.Event()

    class Slow(LocalBackend):
        def open_writer(self, name: str):  # type: ignore[no-untyped-def]
            gate.wait(30)
            return super().open_writer(name)

    class SlowTier(_LocalTier):
        def make_backend(self):  # type: ignore[no-untyped-def]
            return Slow(self.path)

    with Checkpointer([SlowTier(tmp_path)], on_busy="skip") as ck:
        h1 = ck.save({"x": torch.ones(3)}, 1)
        h2 = ck.save({"x": torch.ones(3)}, 2)
        assert h2.skipped and not h1.skipped
        h2.wait_captured()  # training is never held or failed by a skip
        with pytest.raises(CheckpointSkipped, match="step 2 was skipped") as info:
            h2.wait()
        assert isinstance(info.value, CheckpointFailed) and isinstance(info.value, TierCkptError)
        with pytest.raises(CheckpointSkipped):
            h2.result()
        assert not h2.committed("local")
        gate.set()
        assert "local" in h1.result()
        assert ck.steps() == [1]
    assert tierckpt.CheckpointSkipped is CheckpointSkipped
    assert "CheckpointSkipped" in tierckpt.__all__


# -- (d) a read-only location --------------------------------------------------------------

READ_ONLY_CHILD = """
import json, os, sys, torch
from tierckpt import Checkpointer, LocalTier, TierCkptError
ro, rw = sys.argv[1], sys.argv[2]
out = {}
try:
    open(os.path.join(ro, "probe"), "w").close()
    print(json.dumps({"not_read_only": True}))
    sys.exit(0)
except OSError:
    pass

def describe(exc):
    return {"type": type(exc).__name__, "family": isinstance(exc, TierCkptError),
            "oserror": isinstance(exc, OSError), "msg": str(exc)}

# a tier folder to be created inside the read-only one
try:
    Checkpointer([LocalTier(os.path.join(ro, "sub"))])
    out["create"] = None
except BaseException as exc:
    out["create"] = describe(exc)
# an existing read-only tier folder: the save fails on the handle with the tier's error
with Checkpointer([LocalTier(ro)]) as ck:
    h = ck.save({"w": torch.ones(8)}, 1)
    try:
        h.wait()
        out["save"] = None
    except BaseException as exc:
        out["save"] = describe(exc)
        out["save_cause"] = describe(exc.errors["local"])
# export into a read-only folder
from tierckpt.backends.local import LocalBackend
from tierckpt.export import export_safetensors
with Checkpointer([LocalTier(rw)]) as ck:
    ck.save({"m": {"w": torch.ones(8)}}, 1).wait()
try:
    export_safetensors(LocalBackend(rw), 1, os.path.join(ro, "export"))
    out["export_new"] = None
except BaseException as exc:
    out["export_new"] = describe(exc)
try:
    export_safetensors(LocalBackend(rw), 1, ro)
    out["export_existing"] = None
except BaseException as exc:
    out["export_existing"] = describe(exc)
print(json.dumps(out))
"""

#: drops the right to override file permissions (root), then runs the child in its place
DROP_DAC = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, from the bounding set
    if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
        print("CANNOT_DROP", ctypes.get_errno(), flush=True)
        sys.exit(3)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def test_read_only_location_raises_backend_error_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    base = Path(f"/tmp/tierckpt-ro-{os.getpid()}-{tmp_path.name}")  # reachable without root
    ro, rw = base / "ro", base / "rw"
    ro.mkdir(parents=True)
    rw.mkdir()
    try:
        ro.chmod(0o555)
        argv = ["-c", textwrap.dedent(READ_ONLY_CHILD), str(ro), str(rw)]
        if os.geteuid() == 0:
            argv = ["-c", textwrap.dedent(DROP_DAC), *argv]
        p = subprocess.run(
            [sys.executable, *argv], capture_output=True, text=True, env=_env(), timeout=300
        )
        if "CANNOT_DROP" in p.stdout:
            pytest.skip("cannot drop CAP_DAC_OVERRIDE here, so no folder is read-only for root")
        assert p.returncode == 0, p.stderr[-3000:]
        got: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
        if got.get("not_read_only"):
            pytest.skip("the folder is writable despite mode 555 (no permission checks here)")
        for case in ("create", "save_cause", "export_new", "export_existing"):
            err = got[case]
            assert err is not None, f"{case}: no error"
            assert err["family"] and err["oserror"], f"{case}: {err}"  # BackendError
            assert err["type"] == "BackendError", f"{case}: {err}"
            assert str(ro) in err["msg"], f"{case}: the message does not name the location"
            assert "read-only" in err["msg"], f"{case}: {err['msg']}"
        assert got["save"]["type"] == "CheckpointFailed"
        assert "read-only" in got["save"]["msg"]
    finally:
        ro.chmod(0o755)
        shutil.rmtree(base, ignore_errors=True)
