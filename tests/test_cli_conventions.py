"""The CLI tells the truth and says what to do: ``ls`` shows the codecs a checkpoint is stored
with, a pushed copy is labelled with the tier it is on, a wait longer than 2 s prints a line,
missing credentials and an endpoint nobody answers at come with a hint."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(50_000), "ids": torch.arange(50_000)}


@pytest.mark.s3
def test_ls_shows_the_stored_codecs_and_push_labels_the_copy(
    tmp_path: Path,
    moto_server,
    s3_bucket,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    bucket = s3_bucket(moto_server)
    ep = ["--endpoint-url", moto_server.endpoint_url]
    url = f"s3://{bucket}/run"
    with Checkpointer([S3Tier(url, endpoint_url=moto_server.endpoint_url)]) as ck:  # codec auto
        ck.save(_state(), step=1).wait()
    rc, out, err = _run(["ls", url, *ep, "--json"], capsys)
    assert rc == 0, err
    (c,) = json.loads(out)["checkpoints"]
    assert "auto" not in c["codecs"] and c["codecs"]
    rc, out2, _ = _run(["inspect", url, *ep, "--json"], capsys)
    assert c["codecs"] == json.loads(out2)["codecs"]  # ls and inspect agree

    local = tmp_path / "local"
    from tierckpt import LocalTier

    with Checkpointer([LocalTier(local, codec="raw")]) as ck:
        ck.save(_state(), step=2).wait()
    dest = f"s3://{bucket}/pushed"
    rc, _out, err = _run(["push", str(local), dest, *ep], capsys)
    assert rc == 0, err
    rc, out, _ = _run(["ls", dest, *ep, "--json"], capsys)
    (c,) = json.loads(out)["checkpoints"]
    # where it is; how it is stored: with the S3 tier's codec (auto: compressed), not raw
    assert c["tier"] == "s3" and "raw" not in c["codecs"] and c["codecs"]
    back = tmp_path / "back"
    assert _run(["pull", dest, str(back), *ep], capsys)[0] == 0
    rc, out, _ = _run(["ls", str(back), "--json"], capsys)
    assert json.loads(out)["checkpoints"][0]["tier"] == "local"
    with Checkpointer([LocalTier(back)]) as ck:
        assert torch.equal(ck.load()["ids"], _state()["ids"])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierckpt", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )


def test_unreachable_endpoint_gets_a_hint() -> None:
    port = _closed_port()
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    p = _cli(["ls", "s3://bucket/run", "--endpoint-url", f"http://127.0.0.1:{port}"], env)
    assert p.returncode == 1, p.stderr
    assert f"is --endpoint-url right? nothing answered at 127.0.0.1:{port}" in p.stderr
    assert "Traceback" not in p.stderr


def test_an_endpoint_from_the_environment_is_named_by_the_hint() -> None:
    """``STORAGE_EMULATOR_HOST`` pointing ``gs://`` at an emulator nobody answers at: the hint
    names that variable (it said "is --endpoint-url right?" where no --endpoint-url was
    given)."""
    pytest.importorskip("obstore")
    port = _closed_port()
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"127.0.0.1:{port}"}
    p = _cli(["ls", "gs://bucket/prefix"], env)
    assert p.returncode == 1, p.stderr
    assert f"hint: is STORAGE_EMULATOR_HOST right? nothing answered at 127.0.0.1:{port}" in (
        p.stderr
    ), p.stderr
    assert "--endpoint-url right" not in p.stderr and "Traceback" not in p.stderr


def test_the_hint_names_where_the_endpoint_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.cli._hints import hint_for

    refused = ConnectionRefusedError("refused")
    for name in ("STORAGE_EMULATOR_HOST", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:4443")
    hint = hint_for(refused, None, ["gs://bucket/prefix"])
    assert hint == "hint: is STORAGE_EMULATOR_HOST right? nothing answered at localhost:4443"
    # an --endpoint-url given wins, as it does for the store
    hint = hint_for(refused, "http://127.0.0.1:9000", ["gs://bucket/prefix"])
    assert hint == "hint: is --endpoint-url right? nothing answered at 127.0.0.1:9000"
    # the variable of another scheme is not the one used
    assert "STORAGE_EMULATOR_HOST" not in hint_for(refused, None, ["s3://bucket/prefix"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    hint = hint_for(refused, None, ["s3://bucket/prefix", "/tmp/run"])
    assert hint == (
        "hint: is AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL) right? nothing answered at minio:9000"
    )
    # none set: the cloud's own endpoint, no option or variable to blame
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    hint = hint_for(refused, None, ["s3://bucket/prefix"])
    assert hint.startswith("hint: nothing answered at") and "right?" not in hint, hint


def test_a_wait_prints_a_line_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same command in this process, the notice's 2 s shortened to 0 (how long botocore
    takes to give up on a refused connection varies with its random backoff)."""
    from tierckpt.cli import _hints

    monkeypatch.setattr(_hints, "WAIT_NOTICE_S", 0.0)
    for k, v in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = _closed_port()
    rc, _out, err = _run(
        ["ls", "s3://bucket/run", "--endpoint-url", f"http://127.0.0.1:{port}"], capsys
    )
    assert rc == 1
    assert "tierckpt: waiting for s3://bucket/run (" in err, err
    assert f"nothing answered at 127.0.0.1:{port}" in err


@pytest.mark.s3
def test_missing_credentials_get_a_hint(moto_server, s3_bucket, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    bucket = s3_bucket(moto_server)
    empty = tmp_path / "empty"
    empty.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=str(empty),
        AWS_SHARED_CREDENTIALS_FILE=str(empty),
        AWS_EC2_METADATA_DISABLED="true",
        AWS_DEFAULT_REGION="us-east-1",
    )
    p = _cli(["ls", f"s3://{bucket}/run", "--endpoint-url", moto_server.endpoint_url], env)
    assert p.returncode == 1
    assert "set AWS_PROFILE" in p.stderr and "AWS_ACCESS_KEY_ID" in p.stderr, p.stderr


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("s3:/bucket/run", "s3://bucket/run"),
        ("s3:bucket", "s3://bucket"),
        ("file:/x", "file:///x"),
        ("s3//bucket/run", "s3://bucket/run"),  # a colon short
    ],
)
def test_a_url_a_slash_short_is_refused_not_taken_for_a_folder(
    typed: str,
    meant: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``s3:/bucket/run`` is a path to a folder ``s3:`` in the working directory: a training
    job given it saved every checkpoint there, on this machine's disk, instead of to S3; the
    CLI said only 'no such folder'. Both say what was meant and write nothing."""
    from tierckpt import LocalTier, tier

    monkeypatch.chdir(tmp_path)
    for make in (tier, LocalTier):
        with pytest.raises(ValueError, match=f"did you mean '{meant}'"):
            make(typed)
    rc, _out, err = _run(["ls", typed], capsys)
    assert rc == 2 and f"did you mean '{meant}'" in err, err
    rc, _out, err = _run(["gc", typed, "--keep-last", "1"], capsys)
    assert rc == 2 and f"did you mean '{meant}'" in err, err
    assert list(tmp_path.iterdir()) == []
    assert LocalTier(f"./{typed}").path == f"./{typed}"  # a folder really named so: ./ first


def test_a_file_url_with_a_host_is_refused_not_read_as_a_relative_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``file://tmp/run`` names the host ``tmp``: the CLI read it as the relative folder
    ``tmp/run`` (gc or push there acted on another folder than the training job's, which
    refuses the URL). Both refuse it the same way."""
    from tierckpt import LocalTier

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp" / "run").mkdir(parents=True)
    with pytest.raises(ValueError, match="names the host 'tmp'"):
        LocalTier("file://tmp/run")
    for argv in (["ls", "file://tmp/run"], ["gc", "file://tmp/run", "--keep-last", "1"]):
        rc, _out, err = _run(argv, capsys)
        assert rc == 2 and "file:///absolute/path" in err and "names the host 'tmp'" in err, err


def test_ls_shows_which_checkpoints_are_pinned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An operator about to run gc sees what a pin keeps (it showed nothing of pins)."""
    from tierckpt import LocalTier

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for step in (1, 2, 3):
            ck.save(_state(), step=step).wait()
        ck.pin(2, reason="eval")
        ck.wait(retention=True)
    rc, out, _err = _run(["ls", str(tmp_path)], capsys)
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:1].isdigit()}
    assert rc == 0 and rows["2"].endswith("pinned") and "pinned" not in rows["1"] + rows["3"]
    assert rows["3"].endswith("newest")
    rc, out, _err = _run(["ls", str(tmp_path), "--json"], capsys)
    doc = json.loads(out)
    assert [c["pinned"] for c in doc["checkpoints"]] == [False, True, False]


def test_gc_says_which_uncommitted_saves_it_keeps_and_what_removes_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A save killed after the newest commit leaves an uncommitted step: gc said 'deleted 0
    uncommitted leftover(s)' while ls listed it. A killed writer's temporary file (no process
    holds its lock) goes with every gc, whatever its step: the dry run said it kept it while
    the real run deleted it; now both name it."""
    from tierckpt import LocalTier
    from tierckpt.format import shard_name

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for step in (1, 2):
            ck.save(_state(), step=step).wait()
    dead = tmp_path / f"{shard_name(3, 0)}.0123456789ab.tmp"  # a save of 3 killed midway
    dead.parent.mkdir(parents=True)
    dead.write_bytes(b"x" * 100)
    done = (tmp_path / shard_name(4, 0)).parent  # a save of 4 whose shard file completed
    done.mkdir(parents=True)
    (tmp_path / shard_name(4, 0)).write_bytes(b"x" * 100)
    rc, out, _err = _run(["gc", str(tmp_path), "--keep-last", "5", "--dry-run"], capsys)
    # no live writer's lock holds 3's temporary: the sweep removes it, as the dry run says
    assert rc == 0 and "would delete 1 uncommitted leftover(s): 3" in out, out
    assert "of which 3: not older than the newest checkpoint" in out, out
    assert "kept 1 uncommitted save(s)" in out and ": 4 (shard files without a manifest" in out
    assert dead.exists()
    rc, out, _err = _run(["gc", str(tmp_path), "--keep-last", "5", "--abort-incomplete"], capsys)
    assert rc == 0 and "aborted every unfinished write" in out, out
    assert "deleted 1 uncommitted leftover(s): 3" in out, out
    assert not dead.exists() and (tmp_path / shard_name(4, 0)).exists()


def test_ls_of_a_folder_a_level_off_names_the_tier_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ls`` of the folder above a tier, or of one inside it, said only 'no committed
    checkpoint': now it names the tier folder meant."""
    from tierckpt import LocalTier

    run = tmp_path / "jobs" / "run-7"
    with Checkpointer([LocalTier(run)]) as ck:
        ck.save(_state(), step=1).wait()
    for where in (tmp_path, tmp_path / "jobs"):
        rc, out, _err = _run(["ls", str(where)], capsys)
        assert rc == 0 and f"tier folders below this one: {run}" in out, out
    rc, out, _err = _run(["ls", str(run / "manifests")], capsys)
    assert f"inside the tier folder {run}: tierckpt ls {run}" in out, out
    # the data's hashed folder: its steps/ list as uncommitted saves, which hid the hint
    hashed = next(p for p in run.iterdir() if p.name not in ("manifests", "leases"))
    rc, out, _err = _run(["ls", str(hashed)], capsys)
    assert f"inside the tier folder {run}: tierckpt ls {run}" in out, out
    (tmp_path / "empty").mkdir()
    rc, out, _err = _run(["ls", str(tmp_path / "empty")], capsys)
    assert "hint" not in out


def test_a_reader_that_goes_away_ends_ls_quietly(tmp_path: Path) -> None:
    """``tierckpt ls DIR | head -1``: the pipe's reader closes it; ls printed
    'tierckpt ls: error: BrokenPipeError: [Errno 32] Broken pipe' (and exit status 1)."""
    from tierckpt import LocalTier

    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(_state(), step=1).wait()
    p = subprocess.Popen(
        [sys.executable, "-m", "tierckpt", "ls", str(tmp_path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # before the child writes a byte: its first write meets a closed pipe
    err = p.stderr.read()
    assert p.wait(timeout=180) == 141 and err == "", err


def test_gc_marks_what_it_keeps_because_pinned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gc --keep-last 1`` keeps a pinned older step: its 'keeping' line said only '1, 3'."""
    from tierckpt import LocalTier

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for step in (1, 2, 3):
            ck.save(_state(), step=step).wait()
        ck.pin(1)
    rc, out, _err = _run(["gc", str(tmp_path), "--keep-last", "1"], capsys)
    assert rc == 0 and "keeping step(s) 1 (pinned), 3" in out, out
    assert "1 older than --keep-last 1 kept because pinned" in out
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        assert ck.steps() == [1, 3]
    rc, out, _err = _run(["gc", str(tmp_path), "--keep-last", "5", "--dry-run"], capsys)
    assert "pinned" not in out  # kept by the rule anyway


@pytest.mark.s3
def test_ls_of_a_prefix_a_level_off_names_the_tier_prefix(
    s3_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As for a local folder: ``ls`` of the prefix above a tier's, or of one inside it, said
    only 'no committed checkpoint' (or listed the tier's data as uncommitted saves); now it
    names the tier prefix meant."""
    from tierckpt.format import shard_name

    bucket = s3_bucket(s3_server)
    ep = ["--endpoint-url", s3_server.endpoint_url]
    run = f"s3://{bucket}/jobs/run-7"
    with Checkpointer([S3Tier(run, endpoint_url=s3_server.endpoint_url)]) as ck:
        ck.save(_state(), step=1).wait()
    for where in (f"s3://{bucket}", f"s3://{bucket}/jobs"):
        rc, out, _err = _run(["ls", where, *ep], capsys)
        assert rc == 0 and f"hint: tier prefixes below this one: {run}" in out, out
    hashed = shard_name(1, 0).split("/")[0]  # the data's hashed prefix, e.g. "de"
    for inside in ("manifests", hashed, f"{hashed}/steps"):
        rc, out, _err = _run(["ls", f"{run}/{inside}", *ep], capsys)
        assert rc == 0 and f"inside the tier prefix {run}: tierckpt ls {run}" in out, out
    rc, out, _err = _run(["ls", f"s3://{bucket}/elsewhere", *ep], capsys)
    assert rc == 0 and "hint" not in out, out
    rc, out, _err = _run(["ls", run, *ep], capsys)
    assert rc == 0 and "hint" not in out, out


@pytest.mark.s3
def test_ls_lists_what_it_can_when_the_hint_cannot_list(
    moto_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A role may list only below its prefix: the hint's listings above it fail; ls still
    answers (it failed with that error instead)."""
    from tierckpt.cli import _hints
    from tierckpt.errors import BackendError

    def denied(*_args: object) -> str:
        raise BackendError("s3://b/: list failed: AccessDenied")

    monkeypatch.setattr(_hints, "tier_prefixes_near", denied)
    bucket = s3_bucket(moto_server)
    rc, out, err = _run(
        ["ls", f"s3://{bucket}/jobs", "--endpoint-url", moto_server.endpoint_url], capsys
    )
    assert rc == 0 and "no committed checkpoint" in out and "AccessDenied" not in out + err
