"""`tierckpt demo`: the end-to-end story (train, crash and restart from node RAM, lose the
node and restore from S3, compare) in short."""

from __future__ import annotations

import contextlib
import io
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierckpt.demo import scenario as demo


@pytest.fixture(scope="module")
def users_auto_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The user's own ``TIERCKPT_AUTO_STATE_DIR`` while the demo runs."""
    folder = tmp_path_factory.mktemp("users-auto-state")
    before = os.environ.get("TIERCKPT_AUTO_STATE_DIR")
    os.environ["TIERCKPT_AUTO_STATE_DIR"] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            del os.environ["TIERCKPT_AUTO_STATE_DIR"]
        else:
            os.environ["TIERCKPT_AUTO_STATE_DIR"] = before


@pytest.fixture(scope="module")
def quick_demo(users_auto_state: Path) -> tuple[int, str]:
    """One run of ``tierckpt demo --quick`` (exit status, stdout), shared by the tests."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = demo.main(["--quick"])
    return rc, out.getvalue()


def test_quick_demo_keeps_auto_state_in_its_own_folder(
    quick_demo: tuple[int, str], users_auto_state: Path
) -> None:
    """``codec="auto"`` remembers its measurements per tier URL; the demo's URL is the same
    every run while its S3 server is new, so its children keep that state in the demo's own
    work folder: an earlier demo's state never decides what this one stores, and the user's
    folder is left alone."""
    rc, out = quick_demo
    assert rc == 0, out
    assert sorted(p.name for p in users_auto_state.rglob("*")) == []


def test_quick_demo_is_bit_identical(quick_demo: tuple[int, str]) -> None:
    rc, out = quick_demo
    assert rc == 0, out
    # the node is lost at step 24 or, on a loaded machine, at the first step after S3 has
    # committed step 20 (the newest save before the kill)
    killed = re.search(r"node 1 lost after step (\d+)", out)
    assert killed is not None and int(killed.group(1)) >= 24, out
    assert "Continuation is bit-identical" in out
    # the closing table: blocking vs torch.save, bytes per tier, restore time
    assert "torch.save (blocking)" in out
    for tier in ("noderam", "local", "s3"):
        assert f"\n  {tier} " in out
    restored = re.search(r"node 2 restored from S3: step (\d+)", out)
    assert restored is not None, out
    assert 20 <= int(restored.group(1)) <= int(killed.group(1))


def _row(out: str, failure: str) -> list[str]:
    """The cells of the restore table's row that starts with ``failure``."""
    line = next((ln for ln in out.splitlines() if ln.strip().startswith(failure)), None)
    assert line is not None, f"no restore row {failure!r} in:\n{out}"
    return re.split(r"\s{2,}", line.strip())


def test_quick_demo_restarts_the_crashed_process_from_node_ram(
    quick_demo: tuple[int, str],
) -> None:
    """The crash row of the restore table: the restarted process read node RAM only (the
    bytes of each tier are counted in the child), the step saved before --crash-at; the
    node-lost row read S3 only."""
    rc, out = quick_demo
    assert rc == 0, out
    assert re.search(r"process killed with SIGKILL after step 1[4-9]", out), out
    header = _row(out, "failure")
    assert header == ["failure", "from", "step", "node RAM", "local", "S3", "restore"]
    crash = dict(zip(header, _row(out, "process crash (node 1 restarted)"), strict=True))
    assert crash["from"] == "node RAM", out
    assert crash["step"] == "10" and crash["node RAM"].endswith("MiB"), out
    assert float(crash["node RAM"].split()[0]) > 0, out  # a mapped load counts its bytes too
    assert crash["local"] == "0" and crash["S3"] == "0", out  # nothing from disk or S3
    lost = dict(zip(header, _row(out, "node lost"), strict=True))
    assert lost["from"] == "S3" and lost["node RAM"] == "0" and lost["local"] == "0", out
    assert "resumed at step 11 from node RAM" in out


@pytest.mark.slow
def test_demo_fails_when_the_continuation_differs(capsys: pytest.CaptureFixture[str]) -> None:
    """Node 2 skips restoring the RNG state: dropout differs, the demo must exit 1."""
    rc = demo.main(["--quick", "--break-rng"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "MISMATCH node 2 vs reference at step 21" in out
    assert "NOT bit-identical" in out


def test_first_mismatch() -> None:
    ref = {1: 1.0, 2: 0.5, 3: 0.25}
    assert demo._first_mismatch(dict(ref), ref, range(1, 4)) is None
    assert demo._first_mismatch({1: 1.0, 2: 0.5000000001, 3: 0.25}, ref, range(1, 4)) == (
        2,
        0.5000000001,
        0.5,
    )
    assert demo._first_mismatch({1: 1.0}, ref, range(1, 4)) == (2, None, 0.5)


def test_demo_options() -> None:
    args = demo.parse_args(["--quick"])
    assert (args.steps, args.every, args.crash_at, args.kill_at) == (40, 5, 14, 24)
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "100", "--kill-at", "100"])
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "100", "--crash-at", "60", "--kill-at", "50"])
