"""The capture path on a CUDA GPU: side-stream copies into the pinned arena, lazy capture
semantics, bit-exact restore. Skipped without CUDA; run on a GPU by
``benchmarks/gpu_session.sh``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier, MemoryTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cuda_state() -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(1024, 1536, device="cuda", generator=g).bfloat16()
    return {
        "w": w,
        "w_t": w.t(),  # a non-contiguous view of the same storage
        "moment": torch.randn(3, 100_003, device="cuda", generator=g),
        "small": [torch.arange(i, device="cuda", dtype=torch.float16) for i in range(1, 60)],
        "ids": torch.randint(0, 1000, (4099,), device="cuda", generator=g),
        "step": 7,
    }


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree


@pytest.mark.parametrize("codec", ["raw", "planes"])
def test_cuda_state_round_trips_bit_exact(tmp_path: Path, codec: str) -> None:
    state = _cuda_state()
    expected = _to_cpu(state)
    tiers = [MemoryTier(namespace=uuid.uuid4().hex), LocalTier(tmp_path, codec=codec)]
    with Checkpointer(tiers, chunk_bytes=1 << 20, host_buffer_bytes=4 << 20) as ck:
        h = ck.save(state, step=1)
        ck.wait_captured()
        # captured: training may change the state now; the checkpoint keeps the saved values
        state["moment"].add_(1.0)
        state["w"].zero_()
        h.wait()
        pipeline = ck._pipeline
        assert pipeline is not None and pipeline.arena is not None and pipeline.arena.pinned
        assert pipeline.arena.buffer.is_pinned()
        from_memory = ck.load(tier="memory", map_location="cpu")
    assert_same(expected, from_memory)
    with Checkpointer([LocalTier(tmp_path, codec=codec)]) as ck2:
        from_disk = ck2.load(map_location="cpu")
        on_gpu = ck2.load(map_location="cuda")
    assert_same(expected, from_disk)
    assert on_gpu["w"].is_cuda and torch.equal(on_gpu["w"].cpu(), expected["w"])


def test_lazy_capture_waits_for_queued_gpu_work(tmp_path: Path) -> None:
    """save() while kernels that write the state are still queued: the checkpoint holds the
    values those kernels produce (capture is ordered after them on the GPU)."""
    x = torch.zeros(64 << 20, device="cuda", dtype=torch.uint8)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        a = a @ a / 64.0  # keep the GPU busy so the next write is still queued at save()
    x.fill_(9)
    with Checkpointer([LocalTier(tmp_path)], host_buffer_bytes=256 << 20) as ck:
        ck.save({"x": x}, step=1).wait()
        out = ck.load(map_location="cpu")
    assert int(out["x"].min()) == 9 and int(out["x"].max()) == 9
