"""Corruption on every tier: flipped bytes in a chunk, the index, the footer, the manifest, a
zeroed page, truncated files, a missing shard — in RAM, on the local disk and on S3.

``load()`` must detect each one by checksum (or size), name the tier, the file and (for a chunk)
the chunk, and fall back to the same step on the next tier that holds it, in the order RAM →
local → S3. When no tier has a good copy it raises, unless the caller allows the previous
committed step (``fallback="previous"``). ``load(tier=...)`` and ``tierckpt verify`` check one
tier on demand.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from rel_util import Recorder, read_shard_parts, replace_object

from tierckpt import (
    Checkpointer,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptChunk,
    LocalTier,
    MemoryTier,
    S3Tier,
    TierCkptError,
)
from tierckpt.backends.memory import MemoryBackend
from tierckpt.format import manifest_name, shard_name

pytestmark = pytest.mark.s3

TIERS = ("memory", "local", "s3")
SHARD = shard_name(2, 0)
MANIFEST = manifest_name(2)


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(80_000, generator=g), "b": torch.randn(300, generator=g)},
        "moments": torch.zeros(40_000).index_fill_(0, torch.arange(0, 40_000, 7), 1.5),
        "step": step,
    }


@dataclass
class Store:
    ck: Checkpointer
    saved: dict[int, dict[str, Any]]
    originals: dict[tuple[str, str], bytes]
    namespace: str
    local: Path
    s3_url: str
    endpoint: str

    def backend(self, tier: str) -> Any:
        return self.ck.backend(tier)

    def restore(self) -> None:
        for (tier, name), data in self.originals.items():
            replace_object(self.backend(tier), name, data)


@pytest.fixture(scope="module")
def store(moto_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    bucket = f"tierckpt-corrupt-{uuid.uuid4().hex[:8]}"
    moto_server.admin.create_bucket(Bucket=bucket)
    ns = f"corrupt-{uuid.uuid4().hex}"
    local = tmp_path_factory.mktemp("corrupt-nvme")
    s3_url = f"s3://{bucket}/run"
    tiers = [
        MemoryTier(namespace=ns, keep_last=None),
        LocalTier(local, keep_last=None),
        S3Tier(s3_url, endpoint_url=moto_server.endpoint_url),  # zstd: compressed chunks
    ]
    ck = Checkpointer(tiers, chunk_bytes=64 << 10, repopulate=False)
    saved = {s: _state(s) for s in (1, 2)}
    for s, st in saved.items():
        ck.save(st, s).wait(timeout=60)
    originals = {(t, n): bytes(ck.backend(t).get(n)) for t in TIERS for n in (SHARD, MANIFEST)}
    yield Store(ck, saved, originals, ns, local, s3_url, moto_server.endpoint_url)
    ck.close()
    MemoryBackend.clear_namespace(ns)


# -- corruptions: each edits one object's bytes on one backend -------------------------------


def _flip(data: bytes, pos: int, bits: int = 0x5A) -> bytes:
    b = bytearray(data)
    b[pos] ^= bits
    return bytes(b)


def _chunk1(backend: Any) -> tuple[int, int]:
    """File offset and stored size of chunk 1 of the shard on this backend."""
    blob, ft = read_shard_parts(backend, 2)
    rec = json.loads(blob[ft.index_offset : ft.index_offset + ft.index_length])["chunks"][1]
    return int(rec[3]), int(rec[2])


@dataclass(frozen=True)
class Corruption:
    name: str
    target: str  # SHARD or MANIFEST
    edit: Callable[[bytes, Any], bytes | None]  # None: delete the object
    expect: str  # regex the error must match (besides tier and file)
    chunk: bool = False


def _chunk_flip(data: bytes, backend: Any) -> bytes:
    off, n = _chunk1(backend)
    return _flip(data, off + n // 2)


def _chunk_zero_page(data: bytes, backend: Any) -> bytes:
    off, n = _chunk1(backend)
    start = off + min(n // 2, max(n - 4096, 0))
    b = bytearray(data)
    b[start : start + 4096] = bytes(len(b[start : start + 4096]))
    return bytes(b)


def _index_flip(data: bytes, backend: Any) -> bytes:
    _, ft = read_shard_parts(backend, 2)
    return _flip(data, ft.index_offset + ft.index_length // 2)


def _manifest_flip(data: bytes, backend: Any) -> bytes:
    pos = data.index(b'"size": ') + len(b'"size": ') + 1  # a digit of the shard size
    return _flip(data, pos, 0x01)  # still a digit: valid JSON, wrong value


CORRUPTIONS = [
    Corruption("chunk byte flipped", SHARD, _chunk_flip, r"chunk 1 .*checksum", chunk=True),
    Corruption("chunk page zeroed", SHARD, _chunk_zero_page, r"chunk 1 .*checksum", chunk=True),
    Corruption("index byte flipped", SHARD, _index_flip, r"index bytes do not match"),
    Corruption(
        "footer byte flipped (index checksum)",
        SHARD,
        lambda d, b: _flip(d, len(d) - 30),
        r"footer checksum mismatch",
    ),
    Corruption("footer magic flipped", SHARD, lambda d, b: _flip(d, len(d) - 2), r"bad magic"),
    Corruption("shard truncated by 100 bytes", SHARD, lambda d, b: d[:-100], r"truncated"),
    Corruption("shard truncated to half", SHARD, lambda d, b: d[: len(d) // 2], r"truncated"),
    Corruption("shard missing", SHARD, lambda d, b: None, r"does not exist"),
    Corruption("manifest byte flipped", MANIFEST, _manifest_flip, r"manifest checksum mismatch"),
    Corruption(
        "manifest truncated", MANIFEST, lambda d, b: d[: len(d) // 2], r"manifest is not valid JSON"
    ),
]


def _corrupt(store: Store, tier: str, c: Corruption) -> None:
    b = store.backend(tier)
    new = c.edit(store.originals[(tier, c.target)], b)
    if new is None:
        b.delete(c.target)
    else:
        replace_object(b, c.target, new)


def _names_where(msg: str, tier: str, c: Corruption) -> None:
    assert re.search(rf"tier '?{tier}'?", msg), msg
    assert c.target in msg, msg
    if c.chunk:
        assert "chunk 1 " in msg, msg


def _loaded_from(caplog: pytest.LogCaptureFixture) -> str:
    for r in reversed(caplog.records):
        if r.getMessage().startswith("loaded step"):
            return r.getMessage().split(" from tier ")[1].split(":")[0]
    raise AssertionError("no 'loaded step' log record")


@pytest.mark.parametrize("c", CORRUPTIONS, ids=[c.name for c in CORRUPTIONS])
def test_corruption_detected_named_and_fallen_back(
    store: Store, c: Corruption, caplog: pytest.LogCaptureFixture, record: Recorder
) -> None:
    caplog.set_level(logging.INFO, logger="tierckpt")
    ck, good = store.ck, store.saved[2]
    try:
        for i, tier in enumerate(TIERS):
            # detection on one tier, on demand: load(tier=...) names tier, file and chunk
            _corrupt(store, tier, c)
            with pytest.raises(TierCkptError) as ei:
                ck.load(step=2, tier=tier)
            err = ei.value
            assert isinstance(err, (CorruptCheckpoint, CheckpointNotFound)), repr(err)
            cause = err.__cause__ or err
            assert re.search(c.expect, str(err)), str(err)
            _names_where(str(err), tier, c)
            if c.chunk:
                assert isinstance(cause, CorruptChunk) and cause.chunk == 1
                assert cause.tier == tier and cause.file == SHARD
            # fallback: this tier and every faster one are bad -> the next tier serves step 2
            caplog.clear()
            if i < len(TIERS) - 1:
                assert_same(good, ck.load())
                src = _loaded_from(caplog)
                assert src == TIERS[i + 1], src
                warned = [
                    r.getMessage() for r in caplog.records if "failed, trying" in r.getMessage()
                ]
                assert len(warned) == i + 1, warned
                for t, w in zip(TIERS, warned):
                    _names_where(w, t, c)
                record(
                    "corruption",
                    f"{c.name} on {'+'.join(TIERS[: i + 1])}",
                    f"detected ({type(err).__name__}), step 2 loaded from {src}",
                )
        # every tier bad: an error naming each tier, unless the previous step is allowed
        with pytest.raises(TierCkptError) as ei:
            ck.load()
        msg = str(ei.value)
        for t in TIERS:
            assert f"step 2 on tier '{t}'" in msg, msg
        assert_same(store.saved[1], ck.load(fallback="previous"))
        record(
            "corruption",
            f"{c.name} on every tier",
            f"load() raised {type(ei.value).__name__} naming all 3 tiers; "
            "fallback='previous' loaded step 1",
        )
    finally:
        store.restore()
    assert_same(good, ck.load(tier="s3"))


# -- `tierckpt verify` on local folders and S3 ------------------------------------------------


def _verify(store: Store, tier: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    from tierckpt.cli import main

    url = str(store.local) if tier == "local" else store.s3_url
    rc = main(["verify", url, "--step", "2", "--endpoint-url", store.endpoint])
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.mark.parametrize("tier", ["local", "s3"])
def test_cli_verify_names_file_and_chunk(
    store: Store, tier: str, capsys: pytest.CaptureFixture[str], record: Recorder
) -> None:
    rc, out = _verify(store, tier, capsys)
    assert rc == 0 and "ok  step 2" in out, out
    try:
        for c in CORRUPTIONS:
            _corrupt(store, tier, c)
            rc, out = _verify(store, tier, capsys)
            assert rc == 1, (c.name, out)
            assert "FAILED step 2" in out or "error" in out, (c.name, out)
            assert c.target in out, (c.name, out)
            if c.chunk:
                assert "chunk: 1" in out, (c.name, out)
            record(
                "corruption",
                f"tierckpt verify: {c.name} on {tier}",
                "exit 1, names file" + (" and chunk" if c.chunk else ""),
            )
            store.restore()
    finally:
        store.restore()
