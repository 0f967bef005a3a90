"""`tierckpt demo`: the end-to-end story (train, SIGKILL, restore from S3, compare) in short."""

from __future__ import annotations

import re

import pytest

from tierckpt.demo import scenario as demo


def test_quick_demo_is_bit_identical(capsys: pytest.CaptureFixture[str]) -> None:
    rc = demo.main(["--quick"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # the kill comes at step 24 or, on a loaded machine, at the first step after S3 has
    # committed step 20 (the newest save before the kill)
    killed = re.search(r"killed with SIGKILL after step (\d+)", out)
    assert killed is not None and int(killed.group(1)) >= 24, out
    assert "Continuation is bit-identical" in out
    # the closing table: blocking vs torch.save, bytes per tier, restore time
    assert "torch.save (blocking)" in out
    for tier in ("memory", "local", "s3"):
        assert f"\n  {tier} " in out
    restored = re.search(r"from S3: step (\d+)", out)
    assert "Restore on node 2" in out and restored is not None, out
    assert 20 <= int(restored.group(1)) <= int(killed.group(1))


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
        2, 0.5000000001, 0.5)
    assert demo._first_mismatch({1: 1.0}, ref, range(1, 4)) == (2, None, 0.5)


def test_demo_options() -> None:
    args = demo.parse_args(["--quick"])
    assert (args.steps, args.every, args.kill_at) == (40, 5, 24)
    with pytest.raises(SystemExit):
        demo.parse_args(["--steps", "100", "--kill-at", "100"])
