"""``inspect`` / ``verify`` of a step whose save is here but uncommitted (in flight, or left by a
killed writer) say so, name the committed steps and what ``tierckpt gc`` does about it; they
said only "step N is not committed here"."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.cli import main
from tierckpt.format import manifest_name, shard_name


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(1000)}


def _committed(root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[int], list[int]]:
    rc, out, _err = _run(["ls", str(root), "--json"], capsys)
    assert rc == 0
    doc = json.loads(out)
    return [c["step"] for c in doc["checkpoints"]], doc["uncommitted"]


@pytest.fixture
def tier_dir(tmp_path: Path) -> Path:
    """Steps 1 and 3 committed; 2 and 4 saved without their manifest (killed before the
    commit); 5 only a temporary (killed while writing)."""
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for step in (1, 2, 3, 4):
            ck.save(_state(), step=step).wait()
        ck.wait(retention=True)
    os.remove(root / manifest_name(2))
    os.remove(root / manifest_name(4))
    tmp = root / f"{shard_name(5, 0)}.0123456789ab.tmp"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"x" * 100)
    return root


@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_an_abandoned_save_is_named_with_the_committed_steps_and_the_gc_that_removes_it(
    command: str, tier_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tier_dir
    rc, _out, err = _run([command, str(root), "--step", "5"], capsys)
    assert rc == 1
    assert "step 5 is not committed here" in err
    assert "uncommitted save here (unfinished writes only, no manifest): abandoned" in err, err
    assert "Committed here: 1, 3 (newest 3)" in err, err
    # its temporary's lock is free (its writer killed): a plain gc removes it, as it does
    assert f"`tierckpt gc {root} --keep-last 2` removes it (its writer was killed" in err, err
    assert "--abort-incomplete" not in err, err

    rc, _out, err = _run([command, str(root), "--step", "4"], capsys)
    assert rc == 1 and "uncommitted save here (shard files, no manifest): abandoned" in err, err
    assert "--abort-incomplete" not in err, err  # it has no unfinished write to discard
    assert "stay until a newer checkpoint commits" in err, err

    rc, _out, err = _run([command, str(root), "--step", "2"], capsys)
    assert rc == 1 and "older than the newest checkpoint" in err, err
    assert f"`tierckpt gc {root} --keep-last 2` removes it as a leftover" in err, err

    rc, _out, err = _run([command, str(root), "--step", "9"], capsys)
    assert rc == 1 and "step 9 is not committed here and no save of it is either" in err, err
    assert "Committed here: 1, 3 (newest 3)" in err and "gc" not in err, err


def test_the_gc_commands_named_do_what_the_message_says(
    tier_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The commands the messages name remove what they say and no committed checkpoint."""
    root = tier_dir
    assert _committed(root, capsys) == ([1, 3], [2, 4, 5])
    rc, out, _err = _run(["gc", str(root), "--keep-last", "2", "--dry-run"], capsys)
    assert rc == 0 and "would delete 2 uncommitted leftover(s): 2, 5" in out, out
    rc, out, _err = _run(["gc", str(root), "--keep-last", "2"], capsys)
    assert "deleted 2 uncommitted leftover(s): 2, 5" in out, out
    # 2: a leftover; 5: a temporary no live writer holds (its lock is free), whatever its step
    assert rc == 0 and _committed(root, capsys) == ([1, 3], [4])
    assert "kept 1 uncommitted save(s)" in out, out
    rc, _out, _err = _run(["gc", str(root), "--keep-last", "2", "--abort-incomplete"], capsys)
    assert rc == 0 and _committed(root, capsys) == ([1, 3], [4])


def test_a_save_in_flight_is_named_with_the_live_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        ck.save(_state(), step=1).wait()
        ck.wait(retention=True)  # its pass has swept: the temporary below stays
        tmp = root / f"{shard_name(2, 0)}.0123456789ab.tmp"  # a save of 2 being written
        tmp.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(b"x" * 100)
        rc, _out, err = _run(["inspect", str(root), "--step", "2"], capsys)
        assert rc == 1
        assert "probably in flight, as a live writer holds this location (rank 0:" in err, err
        assert f"pid {os.getpid()}" in err and "Committed here: 1 (newest 1)" in err, err


def test_no_committed_checkpoint_names_the_uncommitted_save(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    tmp = root / f"{shard_name(7, 0)}.0123456789ab.tmp"  # the first save, killed
    tmp.parent.mkdir(parents=True)
    tmp.write_bytes(b"x" * 100)
    rc, _out, err = _run(["inspect", str(root)], capsys)
    assert rc == 1 and "no committed checkpoint here" in err, err
    assert "Step 7 has an uncommitted save here (unfinished writes only" in err, err
    assert "No checkpoint is committed here" in err, err


def test_many_committed_checkpoints_name_the_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for step in range(1, 13):
            ck.save(_state(), step=step).wait()
    rc, _out, err = _run(["verify", str(root), "--step", "99"], capsys)
    assert rc == 1
    assert "12 checkpoints are committed here, the newest 3, 4, 5, 6, 7, 8, 9, 10, 11, 12" in err


@pytest.mark.s3
def test_an_open_upload_on_s3_is_named_as_an_uncommitted_save(
    moto_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    """On S3 a save killed mid-upload leaves an open multipart upload, not a file."""
    from tierckpt import S3Tier

    bucket = s3_bucket(moto_server)
    ep = ["--endpoint-url", moto_server.endpoint_url]
    url = f"s3://{bucket}/run"
    with Checkpointer([S3Tier(url, endpoint_url=moto_server.endpoint_url)]) as ck:
        ck.save(_state(), step=1).wait()
        ck.wait(retention=True)
    moto_server.admin.create_multipart_upload(Bucket=bucket, Key=f"run/{shard_name(2, 0)}")
    rc, _out, err = _run(["verify", url, "--step", "2", *ep], capsys)
    assert rc == 1
    assert "uncommitted save here (unfinished writes only, no manifest): abandoned" in err, err
    assert "Committed here: 1 (newest 1)" in err, err
    assert f"`tierckpt gc {url} --keep-last 1 --abort-incomplete` removes it" in err, err
    rc, _out, _err = _run(["gc", url, "--keep-last", "1", "--abort-incomplete", *ep], capsys)
    assert rc == 0
    rc, out, _err = _run(["ls", url, "--json", *ep], capsys)
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [1] and doc["uncommitted"] == []
