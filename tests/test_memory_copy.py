"""The memory tier copies a large write with the GIL released (native streaming copy or
ctypes' memmove), a small one by slice assignment; the bytes are the same either way."""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest

from tierckpt.backends import memory as mem


@pytest.mark.parametrize("native", [True, False])
def test_large_writes_copy_without_the_gil(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    calls: list[int] = []
    memmove = ctypes.memmove

    def copy(dst: int, src: int, n: int) -> Any:
        calls.append(n)
        return memmove(dst, src, n)

    if native:
        monkeypatch.setattr(mem._native, "copier", lambda gil=False: copy)
    else:  # the native copy not built yet: ctypes' memmove
        monkeypatch.setattr(mem._native, "copier", lambda gil=False: None)
        monkeypatch.setattr(mem.ctypes, "memmove", copy)
    b = mem.MemoryBackend(f"copy-{os.getpid()}-{native}")
    big = os.urandom(mem.NOGIL_BYTES + 4097)
    small = os.urandom(1000)
    w = b.open_writer("obj")
    w.write(0, big)
    w.write(len(big), memoryview(bytearray(small)))
    w.commit()
    assert calls == [len(big)]
    assert bytes(b.read("obj", 0, len(big) + len(small))) == big + small
    mem.MemoryBackend.clear_namespace(f"copy-{os.getpid()}-{native}")
