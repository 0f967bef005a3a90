"""The memory tier's recycling pool stays within what the next save can reuse.

Buffers of deleted objects are kept for new writes (fresh memory is slow to touch the first
time). A state whose size changes between saves gives the last chunk of every shard a new
size: pooled by exact length and reused only by an exact match, those buffers piled up (to
644 MiB for a 17-32 MiB state over 300 saves) and stayed after ``close()``. Now a write
takes a pooled buffer that fits with a little to spare, the pool holds at most about one
checkpoint, and the namespace's last backend to close drops it (its objects stay).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
import torch

from tierckpt import Checkpointer, MemoryTier
from tierckpt.backends import memory as mem

MiB = 1 << 20
CHUNK = 2 * MiB
_names = itertools.count()


@pytest.fixture
def namespace() -> Iterator[str]:
    ns = f"pool-bound-{os.getpid()}-{next(_names)}"
    yield ns
    mem.MemoryBackend.clear_namespace(ns)


def _pattern(size: int, seed: int) -> bytes:
    return (seed.to_bytes(4, "little") * (size // 4 + 1))[:size]


def _save(b: mem.MemoryBackend, name: str, size: int, seed: int) -> bytes:
    """Write an object of ``size`` bytes in ``CHUNK`` pieces and a small tail (a shard's
    chunks, its index and footer), as the pipeline does, and commit it."""
    data = _pattern(size, seed) + b"index" * 100
    w = b.open_writer(name)
    for off in range(0, size, CHUNK):
        w.write(off, data[off : min(off + CHUNK, size)])
    w.write(size, data[size:])
    w.commit()
    return data


def _loop(b: mem.MemoryBackend, sizes: list[int]) -> tuple[list[int], int, list[bytearray]]:
    """keep_last=1: save each size, then delete the previous object. Returns the pool's
    bytes after each save, the largest object's buffers' bytes, and every recyclable buffer
    the objects were written in (kept alive, so a buffer never seen before is a fresh
    allocation)."""
    pooled: list[int] = []
    largest = 0
    seen: dict[int, bytearray] = {}
    for i, size in enumerate(sizes):
        data = _save(b, f"obj-{i}", size, i)
        if i:
            b.delete(f"obj-{i - 1}")
        assert bytes(b.read(f"obj-{i}", 0, len(data))) == data
        assert bytes(b.read(f"obj-{i}", CHUNK - 7, 2 * CHUNK)) == data[CHUNK - 7 : 3 * CHUNK - 7]
        # the last chunk (its buffer may be longer than it) and the index after it
        assert bytes(b.read(f"obj-{i}", size - 9, 20)) == data[size - 9 : size + 11]
        blobs = [
            x for x in b._space.objects[f"obj-{i}"].blobs if len(x) >= MiB
        ]  # the recycled ones
        for blob in blobs:
            seen.setdefault(id(blob), blob)
        largest = max(largest, sum(map(len, blobs)))
        pooled.append(b._space.pooled)
    return pooled, largest, list(seen.values())


def test_a_state_whose_size_changes_keeps_the_pool_within_one_checkpoint(namespace: str) -> None:
    b = mem.MemoryBackend(namespace)
    # 7 MiB and then some: three full chunks and a last one of a new size (>= 1 MiB) each save
    sizes = [7 * MiB + (i * 37 * 4096) % MiB for i in range(40)]
    pooled, largest, _ = _loop(b, sizes)
    # one checkpoint: the largest object's buffers (a reused one may be a little longer)
    assert largest <= max(sizes) + max(sizes) // 4
    assert max(pooled) <= largest, f"the pool grew to {max(pooled) / MiB:.1f} MiB"
    b.close()


def test_a_steady_state_reuses_its_buffers(namespace: str) -> None:
    """The reason the pool exists: after the first two saves, a save of the same size, or a
    little smaller, writes into the buffers of the checkpoint retention deleted."""
    b = mem.MemoryBackend(namespace)
    _, _, buffers = _loop(b, [7 * MiB + 5 * 4096] * 10)
    n = len(buffers)
    assert n == 2 * 4, f"a same-size save allocated fresh buffers: {n} for objects of 4"
    b.close()
    # the last chunk shrinks by 16 KiB each save: the previous one's buffer still fits it
    mem.MemoryBackend.clear_namespace(namespace)
    b = mem.MemoryBackend(namespace)
    _, _, buffers = _loop(b, [8 * MiB - i * 16384 for i in range(10)])
    n = len(buffers)
    assert n == 2 * 4, f"{n} buffers for objects of 4"
    b.close()


def test_closing_the_last_backend_of_a_namespace_releases_the_pool(namespace: str) -> None:
    first, second = mem.MemoryBackend(namespace), mem.MemoryBackend(namespace)
    data = _save(first, "old", 5 * MiB, 1)
    _save(first, "new", 5 * MiB, 2)
    first.delete("old")
    space = mem._spaces[namespace]
    assert space.pooled >= 4 * MiB
    first.close()
    assert space.pooled >= 4 * MiB, "another backend of the namespace still saves"
    second.close()
    pooled = space.pooled
    assert pooled == 0, f"{pooled} bytes still pooled after the last close()"
    # the objects stay: a later backend of the namespace (a new Checkpointer) reads them
    data = _pattern(5 * MiB, 2) + b"index" * 100
    assert bytes(mem.MemoryBackend(namespace).read("new", 0, len(data))) == data


def test_memory_tier_pool_is_bounded_and_released_at_close(namespace: str) -> None:
    """End to end: a growing replay buffer beside fixed weights, saved to a MemoryTier."""
    w = torch.randn(MiB)  # 4 MiB of weights
    with Checkpointer(
        [MemoryTier(keep_last=1, namespace=namespace)],
        host_buffer_bytes=32 * MiB,
        chunk_bytes=CHUNK,
    ) as ck:
        space = mem._spaces[namespace]
        most = 0
        for s in range(1, 31):
            replay = torch.arange(300_000 + s * 9_000, dtype=torch.float32)
            ck.save({"w": w, "replay": replay, "step": s}, s).wait(timeout=60)
            ck.wait(retention=True)
            most = max(most, space.pooled)
        state_bytes = w.nbytes + replay.nbytes
        got = ck.load()
        assert got["step"] == 30 and torch.equal(got["replay"], replay)
    assert most <= state_bytes + CHUNK, f"pool {most / MiB:.1f} MiB, state {state_bytes / MiB:.1f}"
    pooled = space.pooled
    assert pooled == 0, f"close() kept {pooled} bytes of recycled buffers"
