"""Tiers that copy from another tier's durable file (``source=``) instead of the host arena."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, trained_state

from tierckpt import (
    Checkpointer,
    CheckpointFailed,
    LocalTier,
    MemoryTier,
    S3Tier,
    TierPolicy,
)
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import CorruptChunk


def _state() -> dict[str, Any]:
    s = trained_state()
    g = torch.Generator().manual_seed(5)
    s["emb"] = torch.randn(1 << 20, generator=g)  # 4 MiB of real-looking floats
    s["moment"] = torch.zeros(300_000)  # compresses to nothing
    s["ids"] = torch.arange(70_001)
    return s


@pytest.mark.s3
def test_s3_copies_from_local_and_restores_bit_exact(
    tmp_path: Path, moto_server: Any, s3_bucket: Any
) -> None:
    bucket = s3_bucket(moto_server)
    s3 = S3Tier(
        f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, source="local", keep_last=2
    )
    tiers = [MemoryTier(namespace=uuid.uuid4().hex), LocalTier(tmp_path / "nvme"), s3]
    states = []
    with Checkpointer(tiers, chunk_bytes=1 << 20, host_buffer_bytes=4 << 20) as ck:
        for step in (1, 2, 3):
            st = _state()
            st["emb"].add_(step)
            states.append(st)
            res = ck.save(st, step=step).result()
        # local is raw; S3 re-encoded what it read back (auto on a remote tier compresses)
        assert res["local"].codec == "raw"
        assert "planes" in res["s3"].codec and res["s3"].stored_bytes < res["local"].stored_bytes
        assert ck.steps("s3") == [2, 3]
    with Checkpointer(
        [S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)]
    ) as fresh:
        assert_same(states[2], fresh.load())
        assert_same(states[1], fresh.load(step=2))


class _GatedWriter:
    """Wraps a backend so that every write of its objects waits for ``gate`` (a stalled link)."""

    def __init__(self, backend: LocalBackend) -> None:
        real = backend.open_writer
        self.gate = threading.Event()
        self.writes = 0

        def open_writer(name: str) -> Any:
            w = real(name)
            write = w.write

            def gated(offset: int, data: Any) -> None:
                assert self.gate.wait(60), "the test never opened the gate"
                self.writes += 1
                write(offset, data)

            w.write = gated  # type: ignore[method-assign]
            return w

        backend.open_writer = open_writer  # type: ignore[method-assign]


@pytest.mark.parametrize("follow", [True, False])
def test_a_stalled_follower_does_not_hold_the_arena(tmp_path: Path, follow: bool) -> None:
    """Two arena slots, 16 chunks, a tier whose writes are stalled: fed from the arena it
    stops capture; copying from the local tier, capture and the local commit finish."""
    state = {"x": torch.randn(4 << 20)}  # 16 MiB in 16 chunks of 1 MiB
    tiers = [
        LocalTier(tmp_path / "fast"),
        LocalTier(tmp_path / "slow", name="slow", source="local" if follow else None),
    ]
    with Checkpointer(tiers, chunk_bytes=1 << 20, host_buffer_bytes=2 << 20) as ck:
        slow = _GatedWriter(ck.backend("slow"))
        h = ck.save(state, step=1)
        if follow:
            ck.wait_captured(timeout=30)
            h.wait("local", timeout=30)
            assert slow.writes == 0 and not h.done("slow")
        else:
            with pytest.raises(TimeoutError):
                ck.wait_captured(timeout=1.0)  # the arena's two slots wait for the stalled tier
        slow.gate.set()
        h.wait(timeout=60)
        assert slow.writes >= 16
    with Checkpointer([LocalTier(tmp_path / "slow", name="slow")]) as ck2:
        assert_same(state, ck2.load())


def test_source_failure_fails_the_follower_and_the_next_save_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers = [LocalTier(tmp_path / "a", name="a"), LocalTier(tmp_path / "b", name="b", source="a")]
    state = _state()
    with Checkpointer(tiers, chunk_bytes=1 << 20) as ck:
        real = LocalBackend.open_writer
        full = [True]

        def open_writer(self: LocalBackend, name: str) -> Any:
            if full[0] and self.root == str(tmp_path / "a"):
                raise OSError(28, "No space left on device")
            return real(self, name)

        monkeypatch.setattr(LocalBackend, "open_writer", open_writer)
        with pytest.raises(CheckpointFailed) as ei:
            ck.save(state, step=1).wait()
        assert set(ei.value.errors) == {"a", "b"}
        assert "copies from tier 'a', whose copy failed" in str(ei.value.errors["b"])
        assert "No space left" in str(ei.value.errors["b"])
        full[0] = False
        ck.save(state, step=2).wait()
        assert ck.steps("b") == [2]
    with Checkpointer([LocalTier(tmp_path / "b", name="b")]) as ck2:
        assert_same(state, ck2.load())


def test_a_chunk_corrupted_on_the_source_is_not_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiers = [LocalTier(tmp_path / "a", name="a"), LocalTier(tmp_path / "b", name="b", source="a")]
    with Checkpointer(tiers, chunk_bytes=1 << 20) as ck:
        a = ck.backend("a")
        real = a.read_into

        def flip(name: str, offset: int, out: memoryview) -> None:
            real(name, offset, out)
            if name.endswith(".tck"):  # the shard file (not the writer lease)
                out[len(out) // 2] ^= 0x40  # a bit rot between write and read-back

        monkeypatch.setattr(a, "read_into", flip)
        h = ck.save(_state(), step=1)
        with pytest.raises(CheckpointFailed) as ei:
            h.wait()
        assert list(ei.value.errors) == ["b"]
        err = ei.value.errors["b"]
        assert isinstance(err, CorruptChunk) and "does not match its checksum" in str(err)
        assert h.committed("a") and ck.steps("b") == []


def test_saves_the_source_skips_come_from_the_arena(tmp_path: Path) -> None:
    tiers = [
        LocalTier(tmp_path / "a", name="a", every=2, keep_last=None),
        LocalTier(tmp_path / "b", name="b", source="a", keep_last=None),
    ]
    states = [_state() for _ in range(3)]
    for i, st in enumerate(states):
        st["ids"].add_(i)
    with Checkpointer(tiers, chunk_bytes=1 << 20) as ck:
        for i, st in enumerate(states):
            ck.save(st, step=i).wait()
        assert ck.steps("a") == [0, 2] and ck.steps("b") == [0, 1, 2]
        for i, st in enumerate(states):
            assert_same(st, ck.load(step=i, tier="b"))


def test_policy_refuses_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must name a tier listed before it"):
        TierPolicy([LocalTier(tmp_path, name="a", source="b"), LocalTier(tmp_path, name="b")])
    with pytest.raises(ValueError, match="must name a tier listed before it"):
        TierPolicy([LocalTier(tmp_path, name="a", source="a")])
    with pytest.raises(ValueError, match="copies from 'a' itself"):
        TierPolicy(
            [
                LocalTier(tmp_path, name="a"),
                LocalTier(tmp_path, name="b", source="a"),
                LocalTier(tmp_path, name="c", source="b"),
            ]
        )
    with pytest.raises(ValueError, match="source must be a tier name"):
        LocalTier(tmp_path, source="")


def test_many_saves_in_flight_with_a_follower(tmp_path: Path) -> None:
    """Saves queued back to back: every follower copy pairs with its own source file."""
    tiers = [
        MemoryTier(namespace=uuid.uuid4().hex, keep_last=2),
        LocalTier(tmp_path / "a", name="a", keep_last=1),
        # every copy, however far behind (by default a follower skips older waiting copies
        # beyond max_behind=2; tests/reliability/test_outages.py checks that bound)
        LocalTier(tmp_path / "b", name="b", source="a", keep_last=None, max_behind=6),
    ]
    states = [{"x": torch.full((300_000,), float(i)), "i": i} for i in range(6)]
    with Checkpointer(tiers, chunk_bytes=256 << 10, host_buffer_bytes=1 << 20) as ck:
        handles = [ck.save(st, step=i) for i, st in enumerate(states)]
        for h in handles:
            h.wait()
        assert ck.steps("b") == list(range(6))
        for i, st in enumerate(states):
            assert_same(st, ck.load(step=i, tier="b"))
    assert threading.active_count() < 50
