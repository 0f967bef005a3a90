"""The pipeline reports every stage of a save (plan, arena wait, capture, encode, checksum,
write, sync, commit) to subscribers as StageEvents; a failing subscriber never fails a save,
and with nobody subscribed nothing is timed."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.format import shard_name
from tierckpt.pipeline import StageEvent

CHUNK = 64 << 10


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(1)
    # compressible (zeros) and incompressible (random) tensors, several chunks each
    return {
        "zeros": torch.zeros(5 * CHUNK // 4),
        "noise": torch.randn(3 * CHUNK // 4, generator=g),
        "small": torch.arange(7, dtype=torch.bfloat16),
        "step": 5,
    }


class _Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[StageEvent] = []

    def __call__(self, event: StageEvent) -> None:
        with self.lock:
            self.events.append(event)

    def by(self, stage: str, tier: str | None) -> list[StageEvent]:
        return [e for e in self.events if e.stage == stage and e.tier == tier]


def test_every_stage_is_reported_per_tier_with_its_bytes(tmp_path: Path) -> None:
    tiers = [
        LocalTier(tmp_path / "raw", name="raw", codec="raw"),
        LocalTier(tmp_path / "zstd", name="zstd", codec="zstd"),
        LocalTier(tmp_path / "copy", name="copy", codec="raw", source="raw"),
    ]
    rec = _Recorder()
    with Checkpointer(tiers, chunk_bytes=CHUNK) as ck:
        ck._get_pipeline().subscribe(rec)
        results = ck.save(_state(), step=3).result(timeout=120)
    raw_bytes = results["raw"].raw_bytes
    assert {e.step for e in rec.events} == {3}

    # shared work, once per chunk: arena wait and capture carry every raw byte
    n_chunks = len(rec.by("capture", None))
    assert n_chunks >= 8  # the state spans several 64 KiB chunks
    assert len(rec.by("plan", None)) == 1 and rec.by("plan", None)[0].nbytes == raw_bytes
    for stage in ("arena_wait", "capture"):
        assert sum(e.nbytes for e in rec.by(stage, None)) == raw_bytes
    # encode/checksum run once per distinct codec (raw: checksum only; zstd: both)
    assert len(rec.by("encode", None)) == n_chunks
    assert len(rec.by("checksum", None)) == 2 * n_chunks
    # the follower re-reads the source's file: its checksums are its own
    assert len(rec.by("checksum", "copy")) == n_chunks

    for tier in ("raw", "zstd", "copy"):
        writes = rec.by("write", tier)
        assert len(writes) == n_chunks + 1  # every chunk, then index + footer
        chunk_bytes = sum(e.nbytes for e in writes[:-1])
        assert chunk_bytes == results[tier].stored_bytes
        (sync,) = rec.by("sync", tier)
        assert sync.nbytes == os.path.getsize(tmp_path / tier / shard_name(3, 0))
        (commit,) = rec.by("commit", tier)
        assert commit.nbytes == raw_bytes
    # the zeros compress: zstd wrote fewer bytes than it captured
    assert results["zstd"].stored_bytes < raw_bytes
    assert all(e.seconds >= 0 for e in rec.events)
    assert any(e.seconds > 0 for e in rec.by("write", "raw"))


def test_a_failing_listener_does_not_fail_the_save(tmp_path: Path) -> None:
    calls = defaultdict(int)

    def broken(event: StageEvent) -> None:
        calls[event.stage] += 1
        raise RuntimeError("listener bug")

    state = _state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=CHUNK) as ck:
        ck._get_pipeline().subscribe(broken)
        ck.save(state, step=1).result(timeout=120)
        loaded = ck.load(1)
    assert calls["commit"] == 1 and calls["capture"] >= 8
    for k in ("zeros", "noise", "small"):
        assert_same(loaded[k], state[k])


def test_unsubscribed_and_unobserved_saves_emit_nothing(tmp_path: Path) -> None:
    rec = _Recorder()
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=CHUNK) as ck:
        pipeline = ck._get_pipeline()
        assert pipeline._emitter(0, None) is None  # nobody listens: no stage is timed
        unsubscribe = pipeline.subscribe(rec)
        ck.save(_state(), step=1).result(timeout=120)
        seen = len(rec.events)
        unsubscribe()
        ck.save(_state(), step=2).result(timeout=120)
        assert pipeline._emitter(0, None) is None
    assert seen > 0 and len(rec.events) == seen
    assert {e.step for e in rec.events} == {1}
