"""Storage spans whose size is a multiple of 16 start 16-byte aligned in the shard file
(``tierckpt.plan.SPAN_ALIGN``, ``noderam_map.MAP_ALIGNMENT``), so a node-RAM restore maps an
optimizer's moments instead of copying them.

Laid out in order of appearance, Adam's 0-d fp32 ``step`` (4 bytes) before the fp32
``exp_avg`` / ``exp_avg_sq`` left every later fp32 storage at a file offset that is not a
multiple of 16, and :mod:`tierckpt.noderam_map` copies such a storage out of the mapping: a
restore copied the whole optimizer state. A dtype group now lays out such spans first, the
odd-sized ones (``step``) after them: still gapless, so every reader reads it as before.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier, NodeRamTier
from tierckpt.noderam_map import MAP_ALIGNMENT, MAP_MIN_BYTES
from tierckpt.plan import build_plan
from tierckpt.restore import read_index, read_manifest


def _tier(shm: Path, **kw: Any) -> NodeRamTier:
    return NodeRamTier(path=shm, namespace="run", stale_after_s=None, keep_last=None, **kw)


def _adam_state() -> dict[str, Any]:
    torch.manual_seed(0)
    # weights of 256 KiB (mapped when aligned), biases of 1 KiB (copied: small)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        loss = model(torch.randn(4, 256)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": 2}


def _mapping_ranges(shm: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of files under ``shm``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(shm)):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    return out


def _mapped(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    p = t.untyped_storage().data_ptr()
    return any(a <= p < b for a, b in ranges)


def _index(ck: Checkpointer, step: int) -> dict[str, Any]:
    b: Any = ck.backend("noderam")
    ref = read_manifest(b, step, "noderam").shard_for(0)
    return read_index(b, ref, "noderam")[0]


def _file_positions(index: dict[str, Any]) -> list[int]:
    """Where each storage's first byte lies in the shard file (raw chunks)."""
    chunks = index["chunks"]
    out = []
    for off, _n in index["storages"]:
        (c,) = [c for c in chunks if c.logical_offset <= off < c.logical_offset + c.raw_size]
        assert c.stored_size == c.raw_size
        out.append(c.file_offset + off - c.logical_offset)
    return out


def _check_alignment(index: dict[str, Any]) -> None:
    """Every storage of a size that is a multiple of 16 starts 16-aligned in the file."""
    unaligned = [
        (i, pos, n)
        for i, (pos, (_off, n)) in enumerate(zip(_file_positions(index), index["storages"]))
        if n % MAP_ALIGNMENT == 0 and pos % MAP_ALIGNMENT
    ]
    assert unaligned == [], f"storages (index, file position, size) unaligned: {unaligned}"


def test_adam_moments_restored_from_node_ram_are_mapped_not_copied(shm: Path) -> None:
    state = _adam_state()
    with Checkpointer([_tier(shm)]) as ck:
        ck.save(state, 1).wait(timeout=60)
        index = _index(ck, 1)
    with Checkpointer([_tier(shm)]) as ck:
        got = ck.load()
        assert_same(state, got)
        ranges = _mapping_ranges(shm)
        assert ranges, "the load did not map the node-RAM segment"
        moments = {
            f"{p}.{k}": v
            for p, per in got["opt"]["state"].items()
            for k, v in per.items()
            if k in ("exp_avg", "exp_avg_sq")
        }
        big = {k: v for k, v in moments.items() if v.untyped_storage().nbytes() >= MAP_MIN_BYTES}
        assert len(big) == 4  # the two weights' exp_avg and exp_avg_sq
        copied = sorted(k for k, v in big.items() if not _mapped(v, ranges))
        assert copied == [], f"optimizer moments copied out of the mapping: {copied}"
        weights = [
            v for v in got["model"].values() if v.untyped_storage().nbytes() >= MAP_MIN_BYTES
        ]
        assert weights and all(_mapped(w, ranges) for w in weights)
        del got, moments, big, weights
    _check_alignment(index)


#: sizes not a multiple of 16 in every dtype, views sharing their base, a scalar, an empty one
def _odd_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(37, 129, generator=g)
    return {
        "w": w,
        "wt": w.t(),
        "tail": w[3:, 1:],
        "step": torch.tensor(3.0),
        "m": torch.randn(64, 64, generator=g),
        "b16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "flag": torch.tensor([True, False, True]),
        "i16": torch.randint(-999, 999, (4097,), dtype=torch.int16, generator=g),
        "f64": torch.randn(33, generator=g, dtype=torch.float64),
        "c128": torch.randn(5, generator=g, dtype=torch.complex128),
        "big": torch.randn(70_001, generator=g),
        "empty": torch.zeros(0),
        "p": torch.nn.Parameter(torch.randn(7, generator=g)),
    }


def test_layout_puts_odd_sized_spans_last_in_their_dtype_group() -> None:
    state = _odd_state()
    plan = build_plan(state, 4096)
    spans = plan.spans
    # gapless, grouped by dtype in order of first appearance
    assert [s.logical_offset for s in spans] == [0] + [
        a.logical_offset + a.nbytes for a in spans[:-1]
    ]
    assert plan.data_bytes == spans[-1].logical_offset + spans[-1].nbytes
    groups = [s.dtype for s in spans]
    order = list(dict.fromkeys(groups))
    assert order == ["float32", "bfloat16", "uint8", "bool", "int16", "float64", "complex128"]
    assert groups == sorted(groups, key=order.index)
    for dtype in order:
        mine = [s for s in spans if s.dtype == dtype]
        sizes = [s.nbytes for s in mine]
        aligned = [n for n in sizes if n % MAP_ALIGNMENT == 0]
        odd = [n for n in sizes if n % MAP_ALIGNMENT]
        assert sizes == aligned + sorted(odd, reverse=True), dtype
        for s in mine[: len(aligned) + 1]:  # each of those, and the first odd one, aligned
            assert (s.logical_offset - mine[0].logical_offset) % MAP_ALIGNMENT == 0, dtype
    # fp32: "m" (the one of a size that is a multiple of 16, after the 4-byte "step", as
    # Adam's moments are), then the others largest first: "big", "w" (with "wt", "tail"), "p"
    fp32 = [s.nbytes for s in spans if s.dtype == "float32"]
    assert fp32 == [64 * 64 * 4, 70_001 * 4, 37 * 129 * 4, 7 * 4, 4]
    # all aligned: the layout is exactly the one in order of appearance, as before
    even = {"a": torch.zeros(8), "b": torch.zeros(4, dtype=torch.float64), "c": torch.zeros(12)}
    assert [s.nbytes for s in build_plan(even, 4096).spans] == [32, 48, 32]


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_reordered_layout_round_trips_through_every_read_path(
    shm: Path, tmp_path: Path, codec: str
) -> None:
    state = _odd_state()
    tiers = [_tier(shm), LocalTier(tmp_path / "disk", codec=codec, keep_last=None)]
    # small chunks, so spans cross chunks; saved twice: the second save reuses the first one's
    # layout (LayoutCache)
    with Checkpointer(tiers, chunk_bytes=4096) as ck:
        for step in (1, 2):
            ck.save(state, step).wait(timeout=60)
        index = _index(ck, 2)
    _check_alignment(index)  # (of the node-RAM copy: raw)
    spans = index["storages"]
    assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(spans)), "a gap in the stream"
    assert spans[-1][0] + spans[-1][1] == index["data_bytes"]
    chunks = index["chunks"]
    assert sum(c.raw_size for c in chunks) == index["data_bytes"]
    assert all(
        a.logical_offset + a.raw_size == b.logical_offset for a, b in itertools.pairwise(chunks)
    )
    with Checkpointer([_tier(shm), LocalTier(tmp_path / "disk", keep_last=None)]) as ck:
        for step in (1, 2):
            for tier in ("noderam", "local"):
                got = ck.load(step=step, tier=tier)
                assert_same(state, got)
                assert (
                    got["wt"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
                )
                del got
    with Checkpointer([_tier(shm, map=False)]) as ck:
        assert_same(state, ck.load(step=2))
