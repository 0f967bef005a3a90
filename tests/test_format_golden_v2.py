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
from tierckpt.format import FOOTER_SIZE, Footer, decode_manifest
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
