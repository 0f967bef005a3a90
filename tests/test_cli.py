"""The `tierckpt` command: every subcommand, its errors and exit codes, local and S3 URLs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, trained_state

import tierckpt
from tierckpt import Checkpointer, LocalTier
from tierckpt.cli import build_parser, main
from tierckpt.format import manifest_name, shard_name
from tierckpt.testing.s3servers import S3Server

COMMANDS = ["ls", "inspect", "verify", "pull", "push", "gc", "export", "bench", "demo"]


def state_for(step: int) -> dict[str, Any]:
    s = trained_state(steps=2, seed=step)
    s["step"] = step
    s["tied"] = {"a": s["model"]["0.weight"], "b": s["model"]["0.weight"]}
    s["moments"] = torch.zeros(4096)  # compresses well: stored < raw
    return s


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A local tier folder with steps 10, 20, 30 (zstd, so sizes differ from raw)."""
    root = tmp_path / "ckpt"
    with Checkpointer([LocalTier(root, keep_last=None, codec="zstd")], chunk_bytes=4096) as ck:
        for step in (10, 20, 30):
            ck.save(state_for(step), step).result()
    return root


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: --help and usage errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


# -- help and usage ---------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    if command == "bench":
        pytest.importorskip("tierckpt.bench")
    rc, out, _err = run([command, "--help"], capsys)
    assert rc == 0
    assert "usage:" in out


def test_top_level_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["--help"], capsys)
    assert rc == 0
    for c in COMMANDS:
        assert c in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["ls"],
        ["nope"],
        ["inspect", "x", "--step", "-3"],
        ["inspect", "x", "--by", "color"],
        ["gc", "x"],
        ["export", "x"],
        ["export", "x", "out", "--format", "onnx"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = run(argv, capsys)
    assert rc == 2
    assert "error" in err
    assert "Traceback" not in err


def test_semantic_usage_errors_exit_2(
    ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        ["pull", str(ckpt_dir), str(tmp_path / "x")],
        ["push", "s3://bucket/p", str(tmp_path / "x")],
        ["gc", str(ckpt_dir), "--keep-last", "0"],
        ["ls", "hdfs://bucket/x"],
    ):
        rc, _out, err = run(argv, capsys)
        assert rc == 2, argv
        assert "error" in err and "Traceback" not in err


def test_missing_things_exit_1_without_traceback(
    ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv, words in (
        (["ls", str(tmp_path / "absent")], "no such folder"),
        (["inspect", str(ckpt_dir), "--step", "11"], "step 11 is not committed"),
        (["verify", str(ckpt_dir), "--step", "11"], "step 11"),
        (["export", str(tmp_path / "empty"), str(tmp_path / "o")], "no such folder"),
    ):
        rc, _out, err = run(argv, capsys)
        assert rc == 1, argv
        assert words in err
        assert "Traceback" not in err
    (tmp_path / "empty").mkdir()
    rc, _out, err = run(["inspect", str(tmp_path / "empty")], capsys)
    assert rc == 1 and "no committed checkpoint" in err


# -- ls / inspect ---------------------------------------------------------------------------------
def test_ls(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["ls", str(ckpt_dir)], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["STEP", "CREATED", "RAW", "STORED"]
    assert [ln.split()[0] for ln in lines[2:]] == ["10", "20", "30"]
    assert "zstd" in out and "local" in out

    rc, out, _ = run(["ls", str(ckpt_dir), "--json"], capsys)
    doc = json.loads(out)
    assert [c["step"] for c in doc["checkpoints"]] == [10, 20, 30]
    c = doc["checkpoints"][0]
    assert c["stored_bytes"] < c["raw_bytes"] and c["codecs"] == ["zstd"]
    assert c["created"] > 0 and doc["uncommitted"] == []


def test_ls_json_names_the_shard_files_count_and_bytes(
    ckpt_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``files`` held the shard files' total size in bytes (a count, by its name): now
    ``file_count`` and ``file_bytes`` say which is which, and ``files`` stays as it was."""
    rc, out, _ = run(["ls", str(ckpt_dir), "--json"], capsys)
    assert rc == 0
    for c in json.loads(out)["checkpoints"]:
        on_disk = sorted(ckpt_dir.glob(f"*/steps/{c['step']:012d}/rank-*.tck"))
        assert c["file_count"] == len(on_disk) == c["world_size"] == 1, c
        assert c["file_bytes"] == sum(f.stat().st_size for f in on_disk), c
        assert c["files"] == c["file_bytes"] > c["stored_bytes"], c  # headers and index too
    rc, out, _ = run(["ls", "--help"], capsys)
    assert "file_count" in out and "file_bytes" in out


def test_ls_shows_uncommitted_leftovers(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.remove(ckpt_dir / manifest_name(20))
    rc, out, _ = run(["ls", str(ckpt_dir)], capsys)
    assert rc == 0
    assert "uncommitted" in out and "20" in out.splitlines()[-1]


def test_inspect(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["inspect", str(ckpt_dir), "--limit", "0"], capsys)
    assert rc == 0
    assert "step 30" in out
    for name in ("model.0.weight", "optimizer.state.0.exp_avg", "moments", "rng", "tied.a"):
        assert name in out
    rc, out, _ = run(["inspect", str(ckpt_dir), "--step", "10", "--json"], capsys)
    doc = json.loads(out)
    assert doc["step"] == 10
    groups = {g["name"]: g for g in doc["groups"]}
    assert {"model", "optimizer", "rng", "moments"} <= set(groups)
    # stored bytes are attributed per chunk: the zeros' own chunks compress far better
    assert groups["moments"]["ratio"] > 3 * groups["model"]["ratio"]
    assert groups["moments"]["raw_bytes"] == 4096 * 4
    # the tied pair shares one storage: counted once, under the first tensor's group
    assert "tied" not in groups or groups["tied"]["raw_bytes"] == 0
    total = sum(g["raw_bytes"] for g in doc["groups"])
    assert total == doc["raw_bytes"]
    assert abs(sum(g["stored_bytes"] for g in doc["groups"]) - doc["stored_bytes"]) < 64
    shapes = {t["name"]: t["shape"] for t in doc["tensors"]}
    assert shapes["model.0.weight"] == [32, 16]

    rc, out, _ = run(["inspect", str(ckpt_dir), "--by", "dtype", "--json"], capsys)
    names = {g["name"] for g in json.loads(out)["groups"]}
    assert names == {"float32", "uint8"}


# -- verify ---------------------------------------------------------------------------------------
def test_verify_ok(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["verify", str(ckpt_dir)], capsys)
    assert rc == 0
    assert [ln.split()[2] for ln in out.splitlines()] == ["10:", "20:", "30:"]
    rc, out, _ = run(["verify", str(ckpt_dir), "--latest"], capsys)
    assert rc == 0 and "step 30" in out and "step 10" not in out


def _flip_byte_in_chunk(path: Path, chunk: int = 0) -> None:
    from tierckpt.backends.local import LocalBackend
    from tierckpt.restore import read_index, read_manifest

    root = path
    backend = LocalBackend(root)
    m = read_manifest(backend, 20, "t")
    index, _, _ = read_index(backend, m.shards[0], "t")
    rec = index["chunks"][chunk]
    f = root / m.shards[0].file
    data = bytearray(f.read_bytes())
    data[rec.file_offset + rec.stored_size // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def test_verify_names_the_bad_chunk(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_byte_in_chunk(ckpt_dir, chunk=1)
    rc, out, err = run(["verify", str(ckpt_dir)], capsys)
    assert rc == 1
    assert "ok  step 10" in out and "step 30" not in out  # stops at the first bad one
    assert "FAILED step 20" in err
    assert shard_name(20, 0) in err and "chunk: 1" in err
    assert "Traceback" not in err


def test_verify_truncated_shard(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = ckpt_dir / shard_name(30, 0)
    f.write_bytes(f.read_bytes()[:-100])
    rc, _out, err = run(["verify", str(ckpt_dir), "--step", "30"], capsys)
    assert rc == 1 and "truncated" in err and "Traceback" not in err


# -- gc -------------------------------------------------------------------------------------------
def test_gc(ckpt_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a killed save left data without a manifest at step 15
    (ckpt_dir / shard_name(15, 0)).parent.mkdir(parents=True)
    (ckpt_dir / shard_name(15, 0)).write_bytes(b"partial")
    rc, out, _ = run(["gc", str(ckpt_dir), "--keep-last", "2", "--dry-run"], capsys)
    assert rc == 0 and "would delete 1 expired checkpoint(s): 10" in out
    assert "would delete 1 uncommitted leftover(s): 15" in out
    assert (ckpt_dir / manifest_name(10)).exists()

    rc, out, _ = run(["gc", str(ckpt_dir), "--keep-last", "2"], capsys)
    assert rc == 0 and "keeping step(s) 20, 30" in out
    assert not (ckpt_dir / manifest_name(10)).exists()
    assert not (ckpt_dir / shard_name(10, 0)).parent.exists()
    assert not (ckpt_dir / shard_name(15, 0)).parent.exists()
    # a stray temporary file of an unfinished write
    tmp = (ckpt_dir / shard_name(30, 0)).parent / "rank-000001.tck.abc123.tmp"
    tmp.write_bytes(b"x")
    rc, out, _ = run(["gc", str(ckpt_dir), "--keep-last", "1", "--abort-incomplete"], capsys)
    assert rc == 0
    assert Checkpointer([LocalTier(ckpt_dir)]).steps() == [30]
    assert not tmp.exists()


# -- export ---------------------------------------------------------------------------------------
def test_export_safetensors_loads_and_matches(
    ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    out_dir = tmp_path / "hf"
    rc, out, _ = run(["export", str(ckpt_dir), str(out_dir), "--step", "20"], capsys)
    assert rc == 0, out
    want = state_for(20)
    model = load_file(out_dir / "model.safetensors")
    assert set(model) == set(want["model"])
    for k, v in want["model"].items():
        assert_same(model[k], v.contiguous())
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    net.load_state_dict(model)  # what a Hugging Face user does with it
    opt = load_file(out_dir / "optimizer.safetensors")
    assert_same(opt["state.0.exp_avg"], want["optimizer"]["state"][0]["exp_avg"])
    assert_same(load_file(out_dir / "rng.safetensors")["rng"], want["rng"])
    # tied weights are stored once (as Hugging Face stores them); the metadata names the alias
    from safetensors import safe_open

    tied = load_file(out_dir / "tied.safetensors")
    assert set(tied) == {"a"}
    assert_same(tied["a"], want["model"]["0.weight"])
    with safe_open(out_dir / "tied.safetensors", "pt") as f:
        assert f.metadata()["b"] == "a"

    doc = json.loads((out_dir / "state.json").read_text())
    assert doc["step"] == 20 and doc["state"]["step"] == 20
    assert (
        doc["state"]["optimizer"]["param_groups"][0]["lr"]
        == want["optimizer"]["param_groups"][0]["lr"]
    )
    assert doc["state"]["model"]["0.weight"] == {
        "$safetensors": "model.safetensors",
        "name": "0.weight",
    }
    assert doc["aliases"] == {"tied.safetensors:b": "tied.safetensors:a"}
    assert doc["state"]["scheduler"]["step_size"] == 2


def test_export_single_file(
    ckpt_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    rc, _out, _ = run(["export", str(ckpt_dir), str(tmp_path / "one"), "--single-file"], capsys)
    assert rc == 0
    flat = load_file(tmp_path / "one" / "state.safetensors")
    want = state_for(30)
    assert_same(flat["model.2.bias"], want["model"]["2.bias"])
    assert_same(flat["optimizer.state.1.exp_avg_sq"], want["optimizer"]["state"][1]["exp_avg_sq"])
    assert sorted(os.listdir(tmp_path / "one")) == ["state.json", "state.safetensors"]


# -- bench / demo delegation ---------------------------------------------------------------------
def test_bench_delegates(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_main(argv: list[str]) -> int:
        seen.append(argv)
        return 3

    fake = types.ModuleType("tierckpt.bench")
    fake.main = fake_main  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tierckpt.bench", fake)
    monkeypatch.setattr(tierckpt, "bench", fake, raising=False)
    assert main(["bench", "--size", "1", "--help"]) == 3
    assert seen == [["--size", "1", "--help"]]


def test_demo_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = run(["demo", "--steps", "4", "--every", "10"], capsys)
    assert rc == 2 and "--steps" in err


# -- S3 -------------------------------------------------------------------------------------------
@pytest.mark.s3
def test_push_pull_ls_verify_on_s3(
    ckpt_dir: Path,
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run1"
    ep = ["--endpoint-url", moto_server.endpoint_url]
    # --codec keep: the bytes as stored, so the copy pulled back is byte-identical
    rc, out, err = run(["push", str(ckpt_dir), url, *ep, "--all", "--codec", "keep"], capsys)
    assert rc == 0, err
    assert out.count("committed") == 3
    rc, out, _ = run(["push", str(ckpt_dir), url, *ep, "--step", "30"], capsys)
    assert rc == 0 and "skip step 30: already committed" in out

    rc, out, _ = run(["ls", url, *ep, "--json"], capsys)
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [10, 20, 30]
    # a scheme is case-insensitive, as tier() reads it (before, the CLI refused S3://)
    rc, upper, _ = run(["ls", f"S3://{bucket}/run1", *ep, "--json"], capsys)
    assert rc == 0 and json.loads(upper)["checkpoints"] == json.loads(out)["checkpoints"]
    rc, out, _ = run(["verify", url, *ep], capsys)
    assert rc == 0 and out.count("ok  step") == 3
    rc, out, _ = run(["inspect", url, *ep, "--json"], capsys)
    assert json.loads(out)["step"] == 30

    dest = tmp_path / "node2"
    rc, out, _ = run(["pull", url, str(dest), *ep, "--codec", "keep"], capsys)  # the newest
    assert rc == 0 and "copied step 30" in out
    for name in (manifest_name(30), shard_name(30, 0)):
        assert (dest / name).read_bytes() == (ckpt_dir / name).read_bytes()
    with Checkpointer([LocalTier(dest)]) as ck:
        assert ck.steps() == [30]
        assert_same(ck.load()["optimizer"], state_for(30)["optimizer"])

    rc, out, _ = run(["gc", url, *ep, "--keep-last", "1"], capsys)
    assert rc == 0 and "10, 20" in out
    rc, out, _ = run(["ls", url, *ep, "--json"], capsys)
    assert [c["step"] for c in json.loads(out)["checkpoints"]] == [30]

    dest2 = tmp_path / "exported"
    rc, _out, _ = run(["export", url, str(dest2), *ep], capsys)
    assert rc == 0 and (dest2 / "model.safetensors").exists()


@pytest.mark.s3
def test_pull_refuses_a_corrupt_chunk(
    ckpt_dir: Path,
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = s3_bucket(moto_server)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server.endpoint_url)  # no --endpoint-url
    url = f"s3://{bucket}/run"
    assert run(["push", str(ckpt_dir), url, "--step", "20", "--codec", "keep"], capsys)[0] == 0
    _flip_byte_in_chunk(ckpt_dir, chunk=0)
    key = f"run/{shard_name(20, 0)}"
    moto_server.admin.put_object(
        Bucket=bucket, Key=key, Body=(ckpt_dir / shard_name(20, 0)).read_bytes()
    )
    rc, _out, err = run(["verify", url], capsys)
    assert rc == 1 and "chunk: 0" in err
    dest = tmp_path / "dest"
    rc, _out, err = run(["pull", url, str(dest)], capsys)
    assert rc == 1 and "does not match its checksum" in err and "Traceback" not in err
    assert not (dest / manifest_name(20)).exists()
    assert not (dest / shard_name(20, 0)).exists()


@pytest.mark.s3
def test_missing_bucket_is_a_clean_failure(
    moto_server: S3Server, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _out, err = run(
        ["ls", "s3://no-such-bucket-here/x", "--endpoint-url", moto_server.endpoint_url], capsys
    )
    assert rc == 1 and "NoSuchBucket" in err and "Traceback" not in err


# -- entry points ---------------------------------------------------------------------------------
def test_module_entry_point(ckpt_dir: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "ls", str(ckpt_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "30" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "inspect", str(ckpt_dir), "--step", "99"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr


def test_parser_builds() -> None:
    assert build_parser().prog == "tierckpt"
