"""Locations users already write (s3://, file://, plain paths) build the right tier or are
refused clearly; the CLI takes its global flags before or after the command; python -m works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import Checkpointer, LocalTier, MemoryTier, S3Tier
from tierckpt.cli import main
from tierckpt.urls import as_policy


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "az://container/run"])
def test_local_tier_refuses_a_url_instead_of_writing_a_folder_named_after_it(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="tierckpt.tier"):
        LocalTier(url)
    assert list(tmp_path.iterdir()) == []  # nothing like ./s3:/bucket/run


def test_local_tier_takes_a_file_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "ckpt"
    t = LocalTier(f"file://{target}")
    assert t.path == str(target)
    with Checkpointer([t]) as ck:
        ck.save({"w": torch.arange(4.0)}, step=1).wait()
    assert (target / "manifests").is_dir()
    assert not (tmp_path / "file:").exists()
    with pytest.raises(ValueError, match="file:///absolute/path"):
        LocalTier("file://otherhost/x")


def test_tier_routes_each_scheme(tmp_path: Path) -> None:
    assert isinstance(tierckpt.tier(str(tmp_path), keep_last=2), LocalTier)
    assert tierckpt.tier(f"file://{tmp_path}").path == str(tmp_path)  # type: ignore[attr-defined]
    s3 = tierckpt.tier("s3://bucket/run", keep_last=4, endpoint_url="http://127.0.0.1:9")
    assert isinstance(s3, S3Tier) and s3.keep_last == 4
    mem = tierckpt.tier("memory://ns1")
    assert isinstance(mem, MemoryTier) and mem.namespace == "ns1"
    with pytest.raises(ValueError, match="no tier handles hdfs://"):
        tierckpt.tier("hdfs://nn/run")


def test_checkpointer_takes_a_location_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # what users pass from torch.save / DCP / Lightning habits: one path, a Path, a list that
    # mixes locations and tiers; before, a bare string was iterated ("got '/'")
    monkeypatch.chdir(tmp_path)
    state = {"w": torch.arange(6.0)}
    with Checkpointer(str(tmp_path / "a")) as ck:
        assert [type(t) for t in ck.policy.tiers] == [LocalTier]
        ck.save(state, step=3).wait()
    with Checkpointer(tmp_path / "a") as ck:  # a pathlib.Path: the same folder
        assert torch.equal(ck.load()["w"], state["w"])
    with Checkpointer(["memory://habits", LocalTier(str(tmp_path / "b"), name="disk")]) as ck:
        assert [t.name for t in ck.policy.tiers] == ["memory", "disk"]
        assert ck.policy.tiers[0].namespace == "habits"  # type: ignore[attr-defined]
    assert isinstance(as_policy("s3://bucket/run").tiers[0], S3Tier)
    from tierckpt.dcp import TierReader

    assert TierReader(str(tmp_path / "a")).policy.tiers[0].path == str(tmp_path / "a")  # type: ignore[attr-defined]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.parametrize(
    "tiers, shown",
    [
        (None, "got NoneType None"),
        ({"local": "/tmp/x"}, "got dict"),  # its keys would have become folders
        (b"/ckpt", "got bytes"),
        (7, "got int 7"),
        (["memory://m", 7], "got int 7 in the list"),
    ],
)
def test_checkpointer_refuses_what_is_not_a_tier_or_a_location(
    tiers: object, shown: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match="a folder path or URL") as info:
        Checkpointer(tiers)  # type: ignore[arg-type]
    assert shown in str(info.value)
    assert list(tmp_path.iterdir()) == []  # nothing written for a rejected argument
    with pytest.raises(TypeError, match=r"tierckpt.tier\(location\)"):
        tierckpt.TierPolicy(["/ckpt"])  # type: ignore[list-item]


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_s3_tier_takes_a_named_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    cfg = tmp_path / "config"
    # a named profile brings its own keys: the environment's are not used with it
    cfg.write_text(
        "[profile train]\nregion = eu-west-3\naws_access_key_id = k\naws_secret_access_key = s\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(cfg))
    for var in ("AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    backend = S3Tier("s3://bucket/run", profile="train", driver=driver).make_backend()
    try:
        if driver == "boto3":
            assert backend._client.meta.region_name == "eu-west-3"  # type: ignore[attr-defined]
        else:
            assert backend._store.config["region"] == "eu-west-3"  # type: ignore[attr-defined]
    finally:
        backend.close()
    with pytest.raises(tierckpt.FormatError, match="profile"):
        S3Tier("s3://bucket/run", profile="no-such-profile", driver=driver).make_backend()


@pytest.mark.parametrize(
    "argv",
    [
        ["--debug", "ls", "{d}"],
        ["ls", "{d}", "--debug"],
        ["--endpoint-url", "http://127.0.0.1:9", "ls", "{d}"],
        ["ls", "--json", "{d}"],
    ],
)
def test_global_flags_before_or_after_the_command(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.ones(2)}, step=3).wait()
    rc = main([a.format(d=tmp_path) for a in argv])
    out = capsys.readouterr().out
    assert rc == 0
    assert "3" in out


def test_debug_before_the_command_is_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --debug before the command re-raises (traceback) instead of printing one line
    with pytest.raises(tierckpt.CheckpointNotFound):
        main(["--debug", "ls", str(tmp_path / "missing")])
    assert main(["ls", str(tmp_path / "missing")]) == 1


def test_python_dash_m_tierckpt(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    r = subprocess.run(
        [sys.executable, "-m", "tierckpt", "--version"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("tierckpt ")


def test_refusals_of_tiers_say_what_to_pass_instead(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    with pytest.raises(TypeError, match=r"list\(tiers.values\(\)\)"):
        Checkpointer({"local": LocalTier(str(tmp_path / "a"))})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tierckpt.dcp.TierWriter"):
        Checkpointer(FileSystemWriter(str(tmp_path / "dcp")))  # type: ignore[arg-type]
    # two plain paths are both "local": the message says how to name them
    with pytest.raises(ValueError, match=r"tierckpt.tier\(location, name="):
        Checkpointer([str(tmp_path / "shm"), str(tmp_path / "nvme")])


def test_tier_takes_a_scheme_in_any_case_and_gcs_as_gs() -> None:
    # RFC 3986: schemes are case-insensitive; gcsfs (fsspec) users write gcs://. Before, each
    # was refused by the tier class as not its scheme (and gcs:// was listed as handled)
    assert tierckpt.tier("S3://bucket/run", endpoint_url="http://127.0.0.1:9").url == (  # type: ignore[attr-defined]
        "s3://bucket/run"
    )
    for given in ("gcs://bucket/run", "GS://bucket/run"):
        assert tierckpt.tier(given).url == "gs://bucket/run"  # type: ignore[attr-defined]
    assert tierckpt.tier("AZ://box/run").url == "az://box/run"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"no tier handles azure://.*az://, gs://, s3://$"):
        tierckpt.tier("azure://box/run")


def test_a_missing_azure_account_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("obstore")
    from tierckpt.backends.objstore import ObjectStoreBackend
    from tierckpt.errors import BackendError

    for name in (
        "AZURE_STORAGE_ACCOUNT_NAME",
        "AZURE_STORAGE_ACCOUNT",
        "AZURE_STORAGE_ACCOUNT_KEY",
    ):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BackendError, match="set AZURE_STORAGE_ACCOUNT_NAME"):
        ObjectStoreBackend("az://box/run")
