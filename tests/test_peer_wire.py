"""The receiving end of a peer transfer allocates its fresh tmpfs pages ahead of the arriving
bytes (``tierckpt.peer._wire.populate_ahead``), so that a pull does not stall on a page fault
per 4 KiB: pages allocated without a byte written, bytes already received kept, a stop
honoured (a failed round)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import new_shared_map

from tierckpt.peer._wire import populate_ahead

MiB = 1 << 20


@pytest.fixture
def shared_map(shm: Path) -> Iterator[tuple[str, mmap.mmap]]:
    """A new 8 MiB + 1 page tmpfs file, mapped shared (as a receiver maps its file)."""
    path = os.path.join(shm, "recv.tmp")
    size = 8 * MiB + mmap.PAGESIZE
    mm = new_shared_map(path, size)
    yield path, mm
    mm.close()


def _allocated(path: str) -> int:
    return os.stat(path).st_blocks * 512


def test_populate_ahead_allocates_every_page_and_keeps_received_bytes(
    shared_map: tuple[str, mmap.mmap],
) -> None:
    path, mm = shared_map
    size = len(mm)
    assert _allocated(path) == 0  # a fresh file: no page yet
    mm[3 * MiB : 3 * MiB + 5] = b"abcde"  # bytes that arrived before the filler got there
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    done = populate_ahead(buf, threading.Event(), step=MiB)
    del buf
    if done == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert done == size
    assert _allocated(path) >= size  # every page allocated, none written by it
    assert mm[3 * MiB : 3 * MiB + 5] == b"abcde"
    assert mm[: 3 * MiB].count(0) == 3 * MiB and mm[-mmap.PAGESIZE :].count(0) == mmap.PAGESIZE


def test_populate_ahead_stops_when_told(shared_map: tuple[str, mmap.mmap]) -> None:
    path, mm = shared_map
    stop = threading.Event()
    stop.set()
    buf = torch.frombuffer(mm, dtype=torch.uint8)
    assert populate_ahead(buf, stop, step=MiB) == 0
    del buf
    assert _allocated(path) == 0
