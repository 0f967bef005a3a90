"""The host arena: exact-size page-locking through cudaHostRegister (a fake cudart here; the
real one runs in benchmarks/gpu_check.py on a GPU), and its fallbacks."""

from __future__ import annotations

import gc
import logging
from typing import Any

import pytest
import torch

import tierckpt.arena as arena_mod
from tierckpt.arena import ALIGN, HostArena


class FakeCudart:
    def __init__(self, register_error: int = 0) -> None:
        self.register_error = register_error
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if self.register_error:
            return self.register_error
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = size
        assert flags == 1  # portable, as torch's own pinned memory
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        return 0 if self.registered.pop(ptr, None) is not None else 712  # not registered


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(arena_mod, "_cudart", lambda: fake)
    return fake


def test_pins_exactly_the_arena_bytes_and_unpins_once(cudart: FakeCudart) -> None:
    a = HostArena(3, 5 * ALIGN, pin=True)
    assert a.pinned
    ptr = a.buffer.data_ptr()
    assert ptr % ALIGN == 0
    # exactly n_slots x slot_bytes: not rounded up to a power of two as torch's pinned
    # allocator would (3 x 20 KiB = 60 KiB, not 64 KiB)
    assert cudart.registered == {ptr: 3 * 5 * ALIGN}
    a.slot(2).fill_(7)  # usable end to end
    assert int(a.buffer[-1]) == 7
    a.close()
    a.close()
    assert cudart.registered == {}
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]
    assert not a.pinned


def test_an_arena_dropped_without_close_is_unpinned(cudart: FakeCudart) -> None:
    a = HostArena(2, ALIGN, pin=True)
    ptr = a.buffer.data_ptr()
    assert ptr in cudart.registered
    del a
    gc.collect()
    assert cudart.registered == {}


def test_registration_failure_falls_back_or_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeCudart(register_error=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(arena_mod, "_cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        a = HostArena(2, ALIGN)  # pin=None: pinned when CUDA is there, if the OS lets it
    assert not a.pinned and "not pinned" in caplog.text and "ulimit -l" in caplog.text
    a.slot(0).fill_(1)
    a.close()
    assert [c[0] for c in fake.calls] == ["register"]  # nothing to unregister
    with pytest.raises(RuntimeError, match="cudaHostRegister of 8192 bytes failed"):
        HostArena(2, ALIGN, pin=True)  # asked for explicitly: an error, not a fallback


def test_no_cuda_no_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> Any:
        raise AssertionError("cudart must not be touched without CUDA")

    monkeypatch.setattr(arena_mod, "_cudart", boom)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a = HostArena(2, ALIGN)
    assert not a.pinned
    a.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_real_registration_is_seen_as_pinned_by_torch() -> None:
    a = HostArena(2, 1 << 20)
    assert a.pinned and a.buffer.is_pinned()
    src = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
    a.slot(0).view(torch.float32).copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(a.slot(0).view(torch.float32), src.cpu())
    a.close()
    assert not a.buffer.is_pinned()
