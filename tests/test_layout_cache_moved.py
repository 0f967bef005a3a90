"""The layout cache reuses the last layout when a storage moved but the state is laid out the
same: a tensor copied afresh at every ``save()`` (a buffer ``guard`` snapshots) must not make
every save lay its state out again on the capture thread."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.pipeline._layoutcache import LayoutCache
from tierckpt.plan import collect_state, layout_plan


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(32, 48, generator=g)
    return {
        "w": torch.randn(1000, generator=g),
        "base": base,
        "base_t": base.t(),  # shares base's storage
        "buf": torch.randn(77, generator=g),
        "ids": torch.arange(50, dtype=torch.int64),
        "step": 0,
    }


def _same_layout(got: Any, want: Any) -> None:
    assert got.tensors == want.tensors and got.spans == want.spans
    assert got.chunks == want.chunks and got.data_bytes == want.data_bytes
    assert [(s.data_ptr(), s.numel()) for s in got.sources] == [
        (s.data_ptr(), s.numel()) for s in want.sources
    ]


def test_a_tensor_copied_at_every_save_still_reuses_the_layout() -> None:
    state = _state()
    cache = LayoutCache()
    keep = []  # old copies stay alive, so each new copy lands at another address
    for round_ in range(4):
        keep.append(state["buf"])
        state["buf"] = state["buf"].clone()  # what guard does to a buffer at save()
        want = layout_plan(collect_state(state), 64 << 10)
        got = cache.layout(collect_state(state), 64 << 10)
        _same_layout(got, want)
        assert cache.hits + cache.moved == round_  # laid out once, then reused
    assert cache.moved == 3


def test_a_changed_sharing_of_storages_is_laid_out_afresh() -> None:
    """Same shapes and offsets, but a tensor that shared a storage now has its own (or the
    reverse): the key differs, the layout is made again and equals layout_plan's."""
    state = _state()
    cache = LayoutCache()
    cache.layout(collect_state(state), 64 << 10)
    alone = torch.empty_like(state["base"]).copy_(state["base"])
    state["base_t"] = alone.t()  # no longer a view of base
    got = cache.layout(collect_state(state), 64 << 10)
    assert cache.hits + cache.moved == 0
    _same_layout(got, layout_plan(collect_state(state), 64 << 10))
    state["w"] = state["base"].view(-1)[:1000]  # w now shares base's storage
    got = cache.layout(collect_state(state), 64 << 10)
    assert cache.hits + cache.moved == 0
    _same_layout(got, layout_plan(collect_state(state), 64 << 10))


def test_saves_with_a_fresh_copy_each_time_load_back_each_state(tmp_path: Path) -> None:
    state = _state()
    keep = []
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=64 << 10) as ck:
        for step in range(1, 4):
            keep.append(state["buf"])
            state["buf"] = state["buf"] * 2  # a new storage of the same shape each save
            state["step"] = step
            ck.save(state, step=step).wait()
            assert_same(state, ck.load(step=step))
        layouts = ck._pipeline._layouts  # type: ignore[union-attr]
        assert layouts.hits + layouts.moved == 2
