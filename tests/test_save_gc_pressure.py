"""A save of thousands of tensors keeps few Python containers alive at once.

Python's cyclic garbage collector runs a generation-0 collection every 700 net container
allocations, and containers still alive at a generation-1 collection are promoted; enough of
them make the next collection a full one, which in a training process of a few hundred
thousand objects holds the GIL for about 0.1 s (docs/benchmarks.md, twentieth session). So the
two per-save steps that ran over every tensor building containers now build text or one flat
list: the index's tensor and storage tables (``ShardLayout.index_tables``, made once per
layout and kept by the layout cache) and the layout cache's key. These tests count the
containers those steps leave alive, and check that the index bytes are the same as before.
"""

from __future__ import annotations

import copy
import gc
import json
from pathlib import Path
from typing import Any

import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.format import EncodedTable, encode_index
from tierckpt.pipeline._layoutcache import LayoutCache, _key
from tierckpt.plan import collect_state, layout_plan

N = 2000


def _many(n: int = N) -> dict[str, Any]:
    base = torch.arange(24.0).reshape(4, 6)
    state: dict[str, Any] = {f"p{i}": torch.full((3 + i % 5,), float(i)) for i in range(n)}
    state.update(
        base=base,
        base_t=base.t(),  # a view of base's storage, transposed
        strided=torch.arange(10)[1:9:3],
        empty=torch.zeros(0, 3),
        scalar=torch.tensor(2.5),
        half=torch.ones(7, dtype=torch.bfloat16),
        step=12,
    )
    return state


def _alive_after(fn: Any) -> tuple[Any, int]:
    """What ``fn()`` returns, and how many GC-tracked objects it holds that were not alive
    before (reachable from it; the collector off, so that ids stay unique): other threads'
    objects made meanwhile are not counted."""
    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in gc.get_objects()}
        out = fn()
        seen: set[int] = set()
        todo = [out]
        while todo:
            o = todo.pop()
            if id(o) in seen or not gc.is_tracked(o):
                continue
            seen.add(id(o))
            todo.extend(gc.get_referents(o))
        return out, len(seen - before)
    finally:
        gc.enable()


def _list_index(layout: Any) -> dict[str, Any]:
    """The index skeleton as the tree before the twentieth session built it: a list per tensor
    record, its shape and strides, and per storage."""
    return {
        "tree": layout.tree,
        "tensors": [t.to_json() for t in layout.tensors],
        "storages": [[s.logical_offset, s.nbytes] for s in layout.spans],
        "data_bytes": layout.data_bytes,
    }


def test_the_index_tables_are_the_same_bytes_as_the_records_json() -> None:
    layout = layout_plan(collect_state(_many(50)), 4096)
    tensors, storages = layout.index_tables()
    assert tensors.text == json.dumps([t.to_json() for t in layout.tensors], separators=(",", ":"))
    assert storages.text == json.dumps(
        [[s.logical_offset, s.nbytes] for s in layout.spans], separators=(",", ":")
    )
    assert (tensors.length, storages.length) == (len(layout.tensors), len(layout.spans))
    assert tensors.dims == sum(len(t.shape) for t in layout.tensors)
    head = {"format": "tierckpt-shard", "version": 1, "step": 3, "chunks": [], "codecs": []}
    # the whole index, counts included, byte for byte
    assert encode_index({**head, **layout.index_skeleton()}) == encode_index(
        {**head, **_list_index(layout)}
    )


def test_an_index_skeleton_of_thousands_of_tensors_holds_no_list_per_tensor() -> None:
    layout = layout_plan(collect_state(_many()), 64 << 20)
    layout.index_tables()  # made once per layout, as the first save's first tier does
    skeleton, alive = _alive_after(layout.index_skeleton)
    assert isinstance(skeleton["tensors"], EncodedTable)
    assert alive < 50, alive  # before: three lists per tensor and one per storage (> 8,000)
    _, alive_lists = _alive_after(lambda: _list_index(layout))
    assert alive_lists > 3 * N  # what the same tables cost as lists: the count can tell


def test_the_layout_key_of_thousands_of_tensors_is_one_flat_record() -> None:
    tensors = collect_state(_many()).tensors
    keyed, alive = _alive_after(lambda: _key(tensors, 64 << 20))
    assert keyed is not None
    assert alive < 50, alive  # before: a tuple and a torch.Size per tensor (> 4,000)


def test_a_reused_layout_keeps_its_tables_and_a_changed_one_makes_new_ones() -> None:
    cache = LayoutCache()
    state = _many(100)
    first = cache.layout(collect_state(state), 4096)
    again = cache.layout(collect_state(state), 4096)
    tables = again.index_tables()  # made once for the remembered layout ...
    assert tables == first.index_tables()
    third = cache.layout(collect_state(state), 4096)
    assert cache.hits == 2 and third.index_tables() is tables  # ... and shared from then on
    state["p0"] = torch.zeros(2, 2)  # another shape: another layout, other tables
    changed = cache.layout(collect_state(state), 4096)
    assert changed.index_tables() is not tables
    assert changed.index_tables()[0].text == json.dumps(
        [t.to_json() for t in changed.tensors], separators=(",", ":")
    )


def test_saves_of_a_changing_state_load_back_as_saved(tmp_path: Path) -> None:
    """Through the checkpointer: the tables travel with the cached layout, and a state whose
    shapes change between saves gets its own."""
    ck = Checkpointer([LocalTier(tmp_path, keep_last=None)])
    saved: dict[int, Any] = {}
    try:
        state = _many(300)
        for step in range(1, 5):
            if step == 3:
                state["p7"] = torch.arange(12.0).reshape(3, 4)[:, 1:]
                state["extra"] = torch.ones(5, dtype=torch.float16)
            ck.save(state, step).wait()
            saved[step] = copy.deepcopy(state)  # strides and shared storages as they are
            for v in state.values():
                if torch.is_tensor(v) and v.is_floating_point():
                    v.add_(1)
        for step, want in saved.items():
            assert_same(ck.load(step), want)
    finally:
        ck.close()
