"""The capture thread's fast paths: host chunks copied with memmove (bounds checked against the
storage as it is at copy time) and the last save's layout reused while the state's tensors
stay where they were (never holding a storage between saves)."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from torch.multiprocessing.reductions import StorageWeakRef

from tierckpt import Checkpointer, CheckpointFailed, LocalTier
from tierckpt import capture as capture_mod
from tierckpt.arena import HostArena
from tierckpt.capture import CaptureStreams, copy_chunk
from tierckpt.plan import build_plan, collect_state, layout_plan

#: pieces from this size on are copied with the GIL released (the same bytes either way)
RELEASE_GIL_BYTES: int = getattr(capture_mod, "RELEASE_GIL_BYTES", 256 << 10)


def _layout_cache() -> Any:
    from tierckpt.pipeline._layoutcache import LayoutCache

    return LayoutCache()


def _state() -> dict[str, Any]:
    """Small and large pieces (both sides of RELEASE_GIL_BYTES), shared storages, a
    transposed view, a strided slice, an empty tensor and bf16/fp32/int64 dtypes."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(64, 96, generator=g)
    big = torch.randn(RELEASE_GIL_BYTES // 2 + 123, generator=g)  # > RELEASE_GIL_BYTES bytes
    s: dict[str, Any] = {f"s{i}": torch.randn(3 + i % 17, generator=g) for i in range(60)}
    s.update(
        big=big,
        big_bf16=big[:100_001].to(torch.bfloat16),
        base=base,
        base_t=base.t(),  # a view of the same storage
        strided=torch.randn(50, 40, generator=g)[::3, 1::2],
        ints=torch.arange(1000, dtype=torch.int64),
        empty=torch.empty(0, 5),
        step=7,
    )
    return s


def _span_bytes(plan: Any, p: Any) -> torch.Tensor:
    return plan.sources[p.span][p.src_offset : p.src_offset + p.length]


def test_host_copy_puts_every_piece_where_the_layout_says() -> None:
    chunk_bytes = 384 << 10  # spans cut across chunk boundaries; pieces on both sides
    plan = build_plan(_state(), chunk_bytes)
    lengths = [p.length for c in plan.chunks for p in c.pieces]
    assert max(lengths) >= RELEASE_GIL_BYTES > min(lengths)
    arena = HostArena(len(plan.chunks), chunk_bytes)
    arena.buffer.fill_(0xAB)
    for i, chunk in enumerate(plan.chunks):
        assert copy_chunk(plan, chunk, arena.slot(i), CaptureStreams(), {}) is None
    for i, chunk in enumerate(plan.chunks):
        slot = arena.slot(i)
        for p in chunk.pieces:
            assert torch.equal(slot[p.dst_offset : p.dst_offset + p.length], _span_bytes(plan, p))
        assert bool((slot[chunk.raw_size :] == 0xAB).all())  # nothing written past the chunk


def test_large_pieces_are_copied_too() -> None:
    big = torch.randn(3 * RELEASE_GIL_BYTES // 4 + 5)  # one piece over the GIL threshold
    plan = build_plan({"w": big}, 4 << 20)
    arena = HostArena(1, 4 << 20)
    copy_chunk(plan, plan.chunks[0], arena.slot(0), CaptureStreams(), {})
    n = big.numel() * 4
    assert n >= RELEASE_GIL_BYTES
    assert torch.equal(arena.slot(0)[:n], big.view(torch.uint8))


def test_a_storage_freed_after_save_fails_that_save_clearly_and_the_next_one_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An FSDP-style storage freed between save() and its capture: the save fails naming
    why (it is not read out of bounds), training goes on, the next save commits."""
    import tierckpt.pipeline._capture as pipeline_mod

    state = _state()
    victim = state["big"]
    real = pipeline_mod.copy_chunk
    freed = threading.Event()

    def free_first(*args: Any, **kwargs: Any) -> Any:
        if not freed.is_set():
            victim.untyped_storage().resize_(0)
            freed.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "copy_chunk", free_first)
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10) as ck:
        h = ck.save(state, step=1)
        ck.wait_captured()
        with pytest.raises(CheckpointFailed, match="freed or resized after save"):
            h.wait()
        assert ck.steps() == []
        state["big"] = torch.randn(10)  # the state as it is now
        ck.save(state, step=2).wait()
        assert ck.steps() == [2]
        assert_same(state, ck.load())


def test_layout_cache_gives_the_layout_layout_plan_gives() -> None:
    state = _state()
    cache = _layout_cache()
    for round_ in range(3):
        collected = collect_state(state)
        want = layout_plan(collect_state(state), 64 << 10)
        got = cache.layout(collected, 64 << 10)
        assert cache.hits == round_
        assert got.tree == want.tree and got.parameters == want.parameters
        assert got.tensors == want.tensors and got.spans == want.spans
        assert got.chunks == want.chunks and got.data_bytes == want.data_bytes
        assert got.devices == want.devices
        assert [(s.data_ptr(), s.numel()) for s in got.sources] == [
            (s.data_ptr(), s.numel()) for s in want.sources
        ]
        state["step"] += 1  # not a tensor: the tree changes, the layout does not


@pytest.mark.parametrize(
    "change",
    ["replace_same_shape", "reshape", "dtype", "new_view", "add", "chunk_bytes", "conj"],
)
def test_layout_cache_lays_out_afresh_when_anything_it_depends_on_changes(change: str) -> None:
    state = _state()
    cache = _layout_cache()
    cache.layout(collect_state(state), 64 << 10)
    chunk = 64 << 10
    if change == "replace_same_shape":  # same shape, a new storage
        state["s3"] = torch.randn_like(state["s3"])
    elif change == "reshape":
        state["base"] = state["base"].view(96, 64)
    elif change == "dtype":
        state["ints"] = state["ints"].view(torch.float64)
    elif change == "new_view":
        state["base_row"] = state["base"][5]
    elif change == "add":
        state["extra"] = torch.ones(4)
    elif change == "chunk_bytes":
        chunk = 128 << 10
    elif change == "conj":
        state["c"] = torch.randn(4, dtype=torch.complex64).conj()
    want = layout_plan(collect_state(state), chunk)
    got = cache.layout(collect_state(state), chunk)
    assert cache.hits == 0
    assert got.tensors == want.tensors and got.spans == want.spans and got.chunks == want.chunks
    if change == "conj":  # resolved each time: never remembered
        cache.layout(collect_state(state), chunk)
        assert cache.hits == 0


def test_repeated_saves_reuse_the_layout_and_load_back_each_state(tmp_path: Path) -> None:
    state = _state()
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=64 << 10) as ck:
        for step in range(1, 4):
            ck.save(state, step=step).wait()
            assert_same(state, ck.load(step=step))
            for v in state.values():  # the optimizer step: in place, same storages
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.add_(1)
        assert ck._pipeline._layouts.hits == 2  # type: ignore[union-attr]
        state["new"] = torch.full((33,), 5.0)  # a changed state: laid out afresh
        ck.save(state, step=4).wait()
        assert ck._pipeline._layouts.hits == 2  # type: ignore[union-attr]
        assert_same(state, ck.load(step=4))


def test_the_layout_cache_keeps_no_storage_alive(tmp_path: Path) -> None:
    """Once a save is captured it holds no storage of the state, cached layout or not."""
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10) as ck:
        state = _state()
        for step in (1, 2):  # the second save reuses the layout
            ck.save(state, step=step).wait()
        refs = [
            StorageWeakRef(v.untyped_storage())
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.numel()
        ]
        del state
        gc.collect()
        assert not [r for r in refs if not r.expired()]


def _copy_team(threads: int) -> Any:
    from tierckpt.pipeline._copyteam import CopyTeam

    return CopyTeam(threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_big_host_chunk_split_among_copy_threads_lands_whole(threads: int) -> None:
    """Cuts fall inside pieces, between them, and among many small ones."""
    g = torch.Generator().manual_seed(2)
    s: dict[str, Any] = {f"s{i}": torch.randn(100 + i, generator=g) for i in range(300)}
    s.update(big=torch.randn((5 << 20) // 4 + 17, generator=g), mid=torch.randn(99_999))
    chunk_bytes = 8 << 20
    plan = build_plan(s, chunk_bytes)
    assert plan.chunks[0].raw_size >= capture_mod.SPLIT_MIN_BYTES
    arena = HostArena(len(plan.chunks), chunk_bytes)
    arena.buffer.fill_(0xCD)
    with _copy_team(threads) as team:
        for i, chunk in enumerate(plan.chunks):
            copy_chunk(plan, chunk, arena.slot(i), CaptureStreams(), {}, team)
    for i, chunk in enumerate(plan.chunks):
        slot = arena.slot(i)
        for p in chunk.pieces:
            assert torch.equal(slot[p.dst_offset : p.dst_offset + p.length], _span_bytes(plan, p))
        assert bool((slot[chunk.raw_size :] == 0xCD).all())


def test_copy_team_raises_the_first_error_after_every_part_finished() -> None:
    done: list[str] = []
    gate = threading.Event()

    def slow_ok() -> None:
        gate.wait(10)
        done.append("slow")

    def bad() -> None:
        gate.set()
        raise ValueError("part failed (injected)")

    with _copy_team(3) as team:
        with pytest.raises(ValueError, match="injected"):
            team.run([bad, slow_ok, slow_ok])
        assert done == ["slow", "slow"]  # no helper still copies when run() returns
        team.run([lambda: done.append("again")] * 3)  # the team still works
    assert done.count("again") == 3
