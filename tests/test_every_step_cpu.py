"""Library CPU per checkpoint on the every-step path: what each cut changes, tested by
behaviour (never by timing)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from helpers import assert_same, wait_in_a_thread

from tierckpt import Checkpointer, LocalTier
from tierckpt import capture as capture_mod
from tierckpt.arena import ALIGN, HUGE_PAGE, HostArena
from tierckpt.capture import CaptureStreams, ChunkHash, copy_chunk
from tierckpt.format import checksum
from tierckpt.pipeline._copyteam import CopyTeam
from tierckpt.plan import build_plan


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0]


def _vma_field(addr: int, field: str) -> str | None:
    """``field`` of the mapping of this process that holds ``addr`` (``/proc/self/smaps``)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages")
def test_arena_is_huge_page_aligned_and_eligible_for_huge_pages() -> None:
    """A direct-I/O write pins each page it reads from: the arena asks for huge pages before
    its first touch, from a huge-page boundary, so each write pins 512x fewer pages."""
    a = HostArena(3, HUGE_PAGE)
    ptr = a.buffer.data_ptr()
    assert ptr % HUGE_PAGE == 0
    assert a.buffer.numel() == 3 * HUGE_PAGE
    mode = _thp_mode()
    if mode is None or mode == "never":
        pytest.skip(f"transparent huge pages are {mode or 'missing'} here")
    assert a.huge_pages
    # the kernel's own word that the arena's mapping may hold huge pages
    assert _vma_field(ptr, "THPeligible") == "1"
    a.slot(2).fill_(5)  # usable end to end
    assert int(a.buffer[-1]) == 5 and int(a.buffer[0]) == 0
    a.close()


def test_small_arena_keeps_page_alignment_and_no_huge_pages() -> None:
    a = HostArena(2, 4 * ALIGN)
    assert a.buffer.data_ptr() % ALIGN == 0
    assert not a.huge_pages  # 32 KiB: not worth a 2 MiB alignment
    a.close()


# -- checksums taken as the chunk is copied ------------------------------------------------


def _odd_state(sizes: list[int]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(sizes))
    return {
        f"t{i}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }


#: pieces of every kind: tiny ones sharing a block, ones crossing one or many block
#: boundaries, an odd-sized last piece that tears the last block
_SPLITS = {
    "tiny_pieces": [1, 3, 7, 100, 4095, 4097, 13, 1],
    "one_piece": [150_001],
    "mixed": [5, 60_000, 3, 12_345, 1, 77_777, 9],
    "exact_blocks": [8192, 8192, 4096],
}


@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("split", sorted(_SPLITS))
@pytest.mark.parametrize("block", [4096, 5000])
def test_hash_taken_while_copying_is_xxh3_of_the_chunk(
    monkeypatch: pytest.MonkeyPatch, threads: int, split: str, block: int
) -> None:
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", block)
    monkeypatch.setattr(capture_mod, "SPLIT_MIN_BYTES", 1)
    state = _odd_state(_SPLITS[split])
    chunk_bytes = 64 << 10  # several chunks: some start mid-tensor
    plan = build_plan(state, chunk_bytes)
    arena = HostArena(len(plan.chunks), chunk_bytes)
    arena.buffer.fill_(0xAB)
    with CopyTeam(threads) as team:
        for i, chunk in enumerate(plan.chunks):
            hasher = ChunkHash()
            assert (
                copy_chunk(plan, chunk, arena.slot(i), CaptureStreams(), {}, team, hasher) is None
            )
            raw = memoryview(arena.slot(i)[: chunk.raw_size].numpy())
            want = b"".join(
                bytes(plan.sources[p.span][p.src_offset : p.src_offset + p.length].numpy())
                for p in chunk.pieces
            )
            assert bytes(raw) == want  # every byte where the layout says
            assert hasher.digest == checksum(raw) == xxhash.xxh3_64_hexdigest(want)
            assert bool((arena.slot(i)[chunk.raw_size :] == 0xAB).all())
    torn = sum(c.raw_size % block != 0 for c in plan.chunks)
    assert torn >= 1 or split == "exact_blocks"  # a torn last block (the exact case: none)


def test_hash_stops_when_someone_waits_and_the_bytes_are_still_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", 4096)
    monkeypatch.setattr(capture_mod, "SPLIT_MIN_BYTES", 1)
    state = _odd_state([100_003])
    plan = build_plan(state, 128 << 10)
    (chunk,) = plan.chunks
    stop = threading.Event()
    real = capture_mod._copy_all
    calls = 0

    def copy_then_wait(copies: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 5:
            stop.set()  # a waiter arrives mid-chunk
        real(copies)

    monkeypatch.setattr(capture_mod, "_copy_all", copy_then_wait)
    arena = HostArena(1, 128 << 10)
    with CopyTeam(2) as team:
        hasher = ChunkHash(stop)
        copy_chunk(plan, chunk, arena.slot(0), CaptureStreams(), {}, team, hasher)
    assert hasher.digest is None  # the chunk is hashed after the copy instead
    assert torch.equal(arena.slot(0)[: chunk.raw_size], state["t0"])


def test_a_helper_that_fails_mid_chunk_raises_and_nothing_waits_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", 4096)
    monkeypatch.setattr(capture_mod, "SPLIT_MIN_BYTES", 1)
    state = _odd_state([40_000])
    plan = build_plan(state, 64 << 10)
    (chunk,) = plan.chunks
    real = capture_mod._copy_all
    lead = threading.get_ident()

    def fail_on_helper(copies: Any) -> None:
        if threading.get_ident() != lead:
            raise OSError("helper copy failed")
        real(copies)

    monkeypatch.setattr(capture_mod, "_copy_all", fail_on_helper)
    arena = HostArena(1, 64 << 10)
    with CopyTeam(3) as team:
        hasher = ChunkHash()
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                copy_chunk(plan, chunk, arena.slot(0), CaptureStreams(), {}, team, hasher)
            except BaseException as exc:
                errors.append(exc)
            done.set()

        threading.Thread(target=run, daemon=True).start()
        assert done.wait(60), "the copy hung on a failed helper"
    assert [str(e) for e in errors] == ["helper copy failed"]
    assert hasher.digest is None


def _counting_checksum(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import tierckpt.pipeline._capture as pipeline_mod

    sizes: list[int] = []
    real = pipeline_mod.checksum

    def counting(data: Any) -> str:
        sizes.append(len(memoryview(data).cast("B")))
        return real(data)

    monkeypatch.setattr(pipeline_mod, "checksum", counting)
    return sizes


def test_lazy_save_takes_checksums_while_copying_and_loads_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nobody waits for the capture: no chunk is read back for its checksum, and the stored
    checksums are right (the load verifies every chunk)."""
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", 64 << 10)
    sums = _counting_checksum(monkeypatch)
    state = {**_odd_state([300_001, 5, 1_000_000]), "w": torch.randn(200_000), "step": 3}
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=256 << 10) as ck:
        h = ck.save(state, step=1)
        deadline = time.monotonic() + 60
        while not h.captured and time.monotonic() < deadline:
            time.sleep(0.005)  # polls `captured`: no wait that would stop the hashing
        assert h.captured
        h.wait()
        assert sums == []  # every chunk's checksum was taken as it was copied
        assert_same(state, ck.load())  # a wrong checksum would fail the load


def test_blocking_save_leaves_checksums_until_after_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter arrives before the first copy: the copy, which training waits for, hashes
    nothing; every chunk is hashed after it, as before."""
    import tierckpt.pipeline._capture as pipeline_mod

    sums = _counting_checksum(monkeypatch)
    real = pipeline_mod.copy_chunk
    waiting = threading.Event()

    def after_the_waiter(*args: Any, **kwargs: Any) -> Any:
        assert waiting.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "copy_chunk", after_the_waiter)
    state = {"w": torch.randn(300_000), "b": torch.randn(7)}
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=256 << 10) as ck:
        h = ck.save(state, step=1)
        wait_in_a_thread(h.wait_captured, h.capture_awaited, waiting)
        h.wait()
        n_chunks = -(-(300_000 * 4 + 7 * 4) // (256 << 10))
        assert len(sums) == n_chunks  # each chunk hashed once, after its copy
        assert_same(state, ck.load())


def test_a_save_whose_commit_is_awaited_hashes_and_writes_while_it_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save(...).wait()``: the commit is waited for, not the capture, so copying first buys
    nothing. The chunks are hashed as they are copied (no chunk read back: ``sums`` stays
    empty) and the first chunk goes on to its tier before the last one is copied (it waited
    for the whole capture before: a blocking save to S3 started its upload ~35 ms late per
    256 MiB)."""
    import tierckpt.pipeline._capture as pipeline_mod

    sums = _counting_checksum(monkeypatch)
    real_copy, real_encode = pipeline_mod.copy_chunk, pipeline_mod._encode
    encoded, waited = threading.Event(), threading.Event()
    order: list[str] = []

    def copy(plan: Any, chunk: Any, *args: Any, **kwargs: Any) -> Any:
        if chunk.seq == 0:
            assert waited.wait(60)  # the waiter is there before the first copy
        if chunk.seq == len(plan.chunks) - 1:
            order.append("last copy waits" if encoded.wait(10) else "last copy timed out")
        return real_copy(plan, chunk, *args, **kwargs)

    def encode(*args: Any, **kwargs: Any) -> Any:
        out = real_encode(*args, **kwargs)
        encoded.set()
        return out

    monkeypatch.setattr(pipeline_mod, "copy_chunk", copy)
    monkeypatch.setattr(pipeline_mod, "_encode", encode)
    state = {"w": torch.randn(300_000), "b": torch.randn(7)}
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=256 << 10) as ck:
        h = ck.save(state, step=1)
        wait_in_a_thread(h.wait, h.commit_awaited, waited)
        h.wait()
        assert not h.capture_awaited.is_set()
        assert order == ["last copy waits"]  # a chunk was done before the last copy
        assert sums == []  # every chunk's checksum was taken as it was copied
        assert_same(state, ck.load())
