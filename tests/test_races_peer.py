"""A peer pull's receiving end: the populate thread and the arriving pieces race on one map.

While the pieces of a pulled shard arrive in a shared map of the receiver's file, a thread
populates the pages ahead of them (``tierckpt.peer._wire.populate_ahead``). Both touch the
same pages at once; the populate must never lose a byte that arrived before, during or after
it got to that page. Here the "receive" writes its pieces in a scrambled order while the
populate runs in small steps, each side held back in turn by events, so every interleaving
of a piece and its pages' populate is exercised."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import torch
from helpers import new_shared_map

from tierckpt.peer._wire import populate_ahead

MiB = 1 << 20
PIECE = 256 << 10


def test_pieces_received_while_the_pages_are_populated_all_stay(shm: Path) -> None:
    size = 16 * MiB
    path = os.path.join(shm, "recv-race.tmp")
    mm = new_shared_map(path, size)
    try:
        bufs = [torch.frombuffer(mm, dtype=torch.uint8)]  # dropped before the map closes
        order = list(range(size // PIECE))
        random.Random(5).shuffle(order)
        half = threading.Event()
        stop = threading.Event()
        populated: list[int] = []

        def receive() -> None:
            for n, i in enumerate(order):
                if n == len(order) // 2:
                    half.set()  # the rest arrives while the populate runs
                bufs[0][i * PIECE : (i + 1) * PIECE] = (i % 251) + 1

        def populate() -> None:
            half.wait(10)  # half the pieces are in: their pages must keep them
            populated.append(populate_ahead(bufs[0], stop, step=64 << 10))

        rx = threading.Thread(target=receive)
        fill = threading.Thread(target=populate)
        rx.start()
        fill.start()
        rx.join(60)
        fill.join(60)
        bufs.clear()
        if populated == [0]:
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert populated == [size]
        for i in range(size // PIECE):
            piece = mm[i * PIECE : (i + 1) * PIECE]
            assert piece == bytes([(i % 251) + 1]) * PIECE, f"piece {i} lost bytes"
    finally:
        mm.close()
        os.unlink(path)
