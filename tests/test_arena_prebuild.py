"""The host arena is allocated, touched (and with CUDA pinned) on a background thread started
when the Checkpointer is made, never inside the first save's capture; the default budget is
divided among the ranks of the node (LOCAL_WORLD_SIZE)."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import fake_cuda
import pytest
import torch

from tierckpt import Checkpointer, MemoryTier, arena, config
from tierckpt.pipeline import _capture as capture_mod
from tierckpt.pipeline import _prebuild


def _tier() -> MemoryTier:
    return MemoryTier(namespace=uuid.uuid4().hex)


def test_arena_exists_before_the_first_save_and_capture_does_not_allocate_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TIERCKPT_ARENA_PREBUILD", "1")
    built_in: list[str] = []
    real = arena.HostArena

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            built_in.append(threading.current_thread().name)
            super().__init__(*a, **k)

    monkeypatch.setattr(_prebuild, "HostArena", Recording)
    monkeypatch.setattr(capture_mod, "HostArena", Recording)
    with Checkpointer([_tier()], host_buffer_bytes=1 << 20, chunk_bytes=64 << 10) as ck:
        prebuild = ck._arena_prebuild
        assert prebuild is not None, "no arena is being built at construction"
        prebuild.thread.join(30)
        assert prebuild.done()
        assert built_in == ["tierckpt-arena"]
        w = torch.randn(50_000)
        ck.save({"w": w, "step": 1}, step=1).wait()
        assert torch.equal(ck.load()["w"], w)
        pipeline = ck._pipeline
        assert pipeline is not None and pipeline.arena is not None
        # the first save used the arena built ahead: capture allocated none
        assert built_in == ["tierckpt-arena"]
        assert pipeline.arena.nbytes == (1 << 20) // (64 << 10) * (64 << 10)


def test_prebuild_off_by_default_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_ARENA_PREBUILD", raising=False)
    with Checkpointer([_tier()], host_buffer_bytes=1 << 20) as ck:
        assert ck._arena_prebuild is None


def test_unused_prebuilt_arena_is_released_at_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERCKPT_ARENA_PREBUILD", "1")
    ck = Checkpointer([_tier()], host_buffer_bytes=1 << 20, chunk_bytes=64 << 10)
    prebuild = ck._arena_prebuild
    assert prebuild is not None
    ck.close()
    assert ck._arena_prebuild is None
    assert prebuild.take() is None  # taken by close(), and closed


def test_prebuild_thread_pins_on_the_rank_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CUDA, the arena thread selects the constructing thread's device before pinning, so
    cudaHostRegister creates no context on GPU 0 (mocked CUDA surface)."""
    cuda = fake_cuda.install(monkeypatch)
    monkeypatch.delenv("TIERCKPT_ARENA_PREBUILD", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    registered: list[str] = []
    monkeypatch.setattr(
        arena, "register_host", lambda p, n: registered.append(threading.current_thread().name)
    )
    monkeypatch.setattr(arena, "unregister_host", lambda p: None)
    ck = Checkpointer([_tier()], host_buffer_bytes=1 << 20, chunk_bytes=64 << 10)
    try:
        prebuild = ck._arena_prebuild
        assert prebuild is not None
        prebuild.thread.join(30)
    finally:
        ck.close()
    assert registered == ["tierckpt-arena"]
    assert cuda.devices_of("tierckpt-arena") == {5}


def test_default_budget_is_divided_by_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_HOST_BUFFER_BYTES", raising=False)
    monkeypatch.setattr(config, "total_ram", lambda: 512 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert config.host_buffer_bytes() == 32 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert config.host_buffer_bytes() == 4 << 30
    monkeypatch.setattr(config, "total_ram", lambda: 4 << 30)
    assert config.host_buffer_bytes() == 256 << 20  # never below the floor
