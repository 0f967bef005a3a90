"""Golden files of format v1: a change that breaks reading them fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from golden_state import golden_state
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.format import FOOTER_SIZE, Footer, decode_index, decode_manifest

FIXTURES = Path(__file__).parent / "fixtures" / "format_v1"


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_golden_v1_loads_bit_exact(tmp_path: Path, codec: str) -> None:
    root = tmp_path / codec
    shutil.copytree(FIXTURES / codec, root)
    with Checkpointer([LocalTier(root)]) as ck:
        assert ck.steps() == [42]
        loaded = ck.load()
    assert_same(golden_state(), loaded)


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_golden_v1_layout(codec: str) -> None:
    root = FIXTURES / codec
    manifest = decode_manifest(
        (root / "manifests" / "step-000000000042.json").read_bytes(), where="golden"
    )
    assert manifest.step == 42 and manifest.world_size == 1
    assert manifest.metadata == {"note": "golden v1"}
    shard = (root / manifest.shards[0].file).read_bytes()
    assert shard[-FOOTER_SIZE:][:8] == b"TIERCKPT" and shard[-8:] == b"TCKPTEND"
    footer = Footer.decode(shard[-FOOTER_SIZE:], file_size=len(shard), where="golden")
    index = decode_index(
        shard[footer.index_offset : footer.index_offset + footer.index_length],
        file_size=len(shard),
        where="golden",
    )
    assert len(index["chunks"]) > 3
    assert all(c.file_offset % 4096 == 0 for c in index["chunks"])
    assert {c["id"] for c in index["codecs"]} <= {"raw", codec}
    raw_json = json.loads(shard[footer.index_offset : footer.index_offset + footer.index_length])
    assert raw_json["version"] == 1 and raw_json["checksum_algo"] == "xxh3_64"
