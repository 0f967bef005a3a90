"""Golden files of format v2 (hashed prefixes) beside those of v1: both load bit-exactly, and
a change that breaks reading either fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from golden_state import golden_state
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.cli import main as cli_main
from tierckpt.errors import FormatError
from tierckpt.format import (
    FOOTER_SIZE,
    Footer,
    Manifest,
    ShardRef,
    checksum,
    decode_manifest,
    encode_manifest,
    shard_name,
)
from tierckpt.layout import hash_prefix

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_golden_v2_loads_bit_exact(tmp_path: Path, codec: str) -> None:
    root = tmp_path / codec
    shutil.copytree(FIXTURES / "format_v2" / codec, root)
    with Checkpointer([LocalTier(root)]) as ck:
        assert ck.steps() == [42]
        loaded = ck.load()
    assert_same(golden_state(), loaded)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_golden_v2_layout(codec: str) -> None:
    root = FIXTURES / "format_v2" / codec
    raw = (root / "manifests" / "step-000000000042.json").read_bytes()
    assert json.loads(raw)["version"] == 2
    manifest = decode_manifest(raw, where="golden")
    # written with 16 prefixes: rank 0's file under its hash prefix, nothing under steps/
    assert manifest.shards[0].file == f"{hash_prefix(0, 16)}/steps/000000000042/rank-000000.tck"
    assert not (root / "steps").exists()
    shard = (root / manifest.shards[0].file).read_bytes()
    footer = Footer.decode(shard[-FOOTER_SIZE:], file_size=len(shard), where="golden")
    assert footer.version == 1  # v2 changes names only: the shard file is a v1 one


@pytest.mark.parametrize("version", [1, 2])
def test_v1_and_v2_side_by_side_and_inspect_says_which(
    tmp_path: Path, version: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A v1 checkpoint in a tier a v2 writer then writes to: both load, retention finds both."""
    root = tmp_path / "tier"
    shutil.copytree(FIXTURES / f"format_v{version}" / "raw", root)
    with Checkpointer([LocalTier(root, keep_last=1)]) as ck:
        ck.save({"x": torch.ones(3)}, step=50).wait()
        assert ck.steps() == [50]  # step 42 (either format) removed by retention
    assert sorted(p.name for p in root.rglob("*.tck")) == ["rank-000000.tck"]
    shutil.copytree(FIXTURES / f"format_v{version}" / "raw", tmp_path / "again")
    assert cli_main(["inspect", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert ("format v1" if version == 1 else "format v2, 1 prefix used") in out


def _v2_manifest(files: list[str]) -> bytes:
    m = Manifest(
        step=7,
        world_size=len(files),
        shards=tuple(ShardRef(r, f, 4096, "0123456789abcdef") for r, f in enumerate(files)),
        created=1.0,
        library_version="t",
    )
    return encode_manifest(m)


@pytest.mark.parametrize(
    ("file", "why"),
    [
        ("ab/steps/000000000001/rank-000000.tck", "outside step 7's folder"),  # another step
        ("zz/steps/000000000007/rank-000000.tck", "outside step 7's folder"),  # not 2 hex digits
        ("abc/steps/000000000007/rank-000000.tck", "outside step 7's folder"),
        ("ab/../steps/000000000007/rank-000000.tck", "invalid object name"),
        ("ab/steps/000000000007/../../../evil.tck", "invalid object name"),
    ],
)
def test_v2_manifest_names_are_validated(file: str, why: str) -> None:
    """A v2 manifest's files must be ``<2 hex digits>/<the checkpoint's folder>...``, every
    component of the fixed pattern: a hostile name is refused, never followed."""
    good = shard_name(7, 1, prefixes=16)
    assert decode_manifest(_v2_manifest([good]), where="t").shards[0].file == good
    body = json.loads(_v2_manifest([good]))
    body["shards"][0]["file"] = file
    body.pop("checksum")
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = checksum(canon.encode())
    with pytest.raises(FormatError, match=why):
        decode_manifest(json.dumps(body).encode(), where="t")


def test_v1_named_checkpoint_stays_byte_for_byte_v1() -> None:
    """``prefixes=0``: the manifest of v1 names says version 1, readable by tierckpt < v2."""
    assert json.loads(_v2_manifest([shard_name(7, 0, prefixes=0)]))["version"] == 1
    assert json.loads(_v2_manifest([shard_name(7, 0)]))["version"] == 2
