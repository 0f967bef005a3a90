"""Bit-exact round trips through the memory and local tiers."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same, trained_state, zoo_state

from tierckpt import Checkpointer, LocalTier, MemoryTier, StateMismatch
from tierckpt.format import shard_name


@pytest.fixture
def tiers(tmp_path: Path) -> list:
    return [
        MemoryTier(keep_last=1, namespace=uuid.uuid4().hex),
        LocalTier(tmp_path / "nvme", keep_last=3),
    ]


@pytest.mark.parametrize("tier", ["memory", "local"])
def test_trained_model_optimizer_scheduler_rng_bit_exact(tiers: list, tier: str) -> None:
    state = trained_state()
    with Checkpointer(tiers) as ck:
        ck.save(state, step=100).wait()
        loaded = ck.load(tier=tier)
    assert_same(state, loaded)


@pytest.mark.parametrize("chunk", [4096, 64 << 20])
def test_zoo_every_dtype_views_nesting(tmp_path: Path, chunk: int) -> None:
    state = zoo_state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=chunk) as ck:
        ck.save(state, step=1).wait()
    with Checkpointer([LocalTier(tmp_path)]) as ck2:  # a fresh checkpointer reads it back
        loaded = ck2.load()
    assert_same(state, loaded)
    # two views of one storage stay views of one storage
    assert (
        loaded["view_b"].untyped_storage().data_ptr()
        == loaded["view_a"].untyped_storage().data_ptr()
    )
    loaded["view_a"][2, 0] = 42.0
    assert loaded["view_b"][0, 0].item() == 42.0
    assert loaded["transposed"].stride() == (1, 8)


def test_load_into_existing_tensors(tiers: list) -> None:
    state = trained_state()
    with Checkpointer(tiers) as ck:
        ck.save(state, step=5).wait()
        target = trained_state(steps=1, seed=7)
        ptrs = {k: v.data_ptr() for k, v in target["model"].items()}
        out = ck.load(into=target)
    assert out is target
    assert {k: v.data_ptr() for k, v in target["model"].items()} == ptrs
    assert_same(target["model"], state["model"])
    assert target["step"] == state["step"]
    for a, b in zip(target["optimizer"]["state"].values(), state["optimizer"]["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_load_into_refuses_mismatch_and_names_key(tiers: list) -> None:
    state = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    with Checkpointer(tiers) as ck:
        ck.save(state, step=1).wait()
        with pytest.raises(StateMismatch, match=r"\['w'\].*float32 \(3, 4\).*\(4, 3\)"):
            ck.load(into={"w": torch.zeros(4, 3), "b": torch.zeros(4)})
        # another float dtype casts (issue 17); float into an integer dtype stays refused
        with pytest.raises(StateMismatch, match=r"\['b'\].*int64"):
            ck.load(into={"w": torch.zeros(3, 4), "b": torch.zeros(4, dtype=torch.int64)})
        with pytest.raises(StateMismatch, match="missing"):
            ck.load(into={"w": torch.zeros(3, 4), "b": torch.zeros(4), "c": torch.zeros(1)})
        # a refused load leaves the target untouched
        target = {"w": torch.ones(3, 4), "b": torch.ones(3)}
        with pytest.raises(StateMismatch):
            ck.load(into=target)
        assert torch.equal(target["w"], torch.ones(3, 4))


def test_steps_retention_and_step_selection(tmp_path: Path) -> None:
    ns = uuid.uuid4().hex
    with Checkpointer(
        [MemoryTier(keep_last=1, namespace=ns), LocalTier(tmp_path, keep_last=2)]
    ) as ck:
        for s in (10, 20, 30, 40):
            ck.save({"x": torch.full((4,), float(s))}, step=s).wait()
        assert ck.steps() == [30, 40]
        assert ck.tier_steps() == {"memory": [40], "local": [30, 40]}
        assert ck.load()["x"][0].item() == 40.0
        assert ck.load(step=30)["x"][0].item() == 30.0
    # retention removed the data of deleted steps too, not only their manifests (format v2:
    # under rank 0's hashed prefix)
    assert sorted(p.name for p in (tmp_path / shard_name(1, 0)).parent.parent.iterdir()) == [
        "000000000030",
        "000000000040",
    ]


def test_refuses_to_overwrite_a_committed_step(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"x": torch.ones(2)}, step=1).wait()
        h = ck.save({"x": torch.zeros(2)}, step=1)
        with pytest.raises(Exception, match="already committed"):
            h.wait()
        assert torch.equal(ck.load(step=1)["x"], torch.ones(2))


def test_empty_state_and_tensor_free_state(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({}, step=1).wait()
        ck.save({"epoch": 3, "name": "run"}, step=2).wait()
        assert ck.load(step=1) == {}
        assert ck.load() == {"epoch": 3, "name": "run"}


def test_map_location_and_parameters(tmp_path: Path) -> None:
    p = torch.nn.Parameter(torch.randn(3))
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"p": p}, step=1).wait()
        out = ck.load(map_location="cpu")
    assert torch.equal(out["p"], p.detach())


@pytest.mark.parametrize("codec", ["zstd", "planes"])
def test_compressed_chunks_of_varying_size_through_one_reader_thread(
    tmp_path: Path, codec: str
) -> None:
    # compressed chunks are read into a per-thread scratch buffer reused from chunk to chunk:
    # one reader thread, chunks whose stored sizes go up and down, and every chunk must
    # decode from its own bytes (a stale tail of a longer chunk must never leak in)
    g = torch.Generator().manual_seed(7)
    state = {
        "noise": torch.randn(70_000, generator=g),  # stores nearly raw
        "zeros": torch.zeros(90_000),  # stores a few bytes
        "steps": torch.arange(50_000, dtype=torch.float32),
        "more_noise": torch.randn(40_000, generator=g).bfloat16(),
        "ids": torch.randint(0, 5, (30_000,)),
    }
    with Checkpointer([LocalTier(tmp_path, codec=codec)], chunk_bytes=64 << 10) as ck:
        stored = ck.save(state, step=1).result()["local"].stored_bytes
    raw = sum(t.numel() * t.element_size() for t in state.values())
    assert stored < raw  # the zeros at least compressed
    with Checkpointer([LocalTier(tmp_path, codec=codec)], io_threads=1) as ck2:
        loaded = ck2.load()
    assert_same(state, loaded)
