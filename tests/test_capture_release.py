"""A save holds the saved storages (on the GPU: device memory) only until their copies into
the arena complete, not until the slowest tier commits."""

from __future__ import annotations

import gc
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.pipeline import _capture as capture_mod


class _StalledTier:
    """Every write of the tier's objects waits for ``gate`` (an upload that takes long)."""

    def __init__(self, backend: Any) -> None:
        real = backend.open_writer
        self.gate = threading.Event()

        def open_writer(name: str) -> Any:
            w = real(name)
            write = w.write

            def gated(offset: int, data: Any) -> None:
                assert self.gate.wait(60), "the test never opened the gate"
                write(offset, data)

            w.write = gated
            return w

        backend.open_writer = open_writer


def test_sources_are_released_once_captured_not_at_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    real = capture_mod.layout_plan

    def layout(*a: Any, **k: Any) -> Any:
        plan = real(*a, **k)
        refs.extend(weakref.ref(s) for s in plan.sources)
        return plan

    monkeypatch.setattr(capture_mod, "layout_plan", layout)
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tiers = [LocalTier(tmp_path / "fast"), LocalTier(tmp_path / "slow", name="slow")]
    # an arena with room for every chunk, so capture completes while the slow tier waits
    with Checkpointer(tiers, chunk_bytes=64 << 10, host_buffer_bytes=4 << 20) as ck:
        ck.guard(opt, model)
        slow = _StalledTier(ck.backend("slow"))
        # the eagerly copied buffer (not guarded) is the save's own storage: it must go too
        state = {"model": model.state_dict(), "extra": torch.randn(10_000)}
        h = ck.save(state, step=1)
        ck.wait_captured(timeout=30)
        assert not h.done("slow")
        gc.collect()
        assert refs, "no source was laid out"
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} saved storages still held after capture"
        slow.gate.set()
        h.wait(timeout=60)
        loaded = ck.load()
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert torch.equal(loaded["extra"], state["extra"])
