"""A load starts its reader threads while it lists the tiers and the ranks agree, so its first
reads do not each wait for a thread to be started (25-35 ms of a 0.1 s restore from node RAM
with four ranks restarting on two cores)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, catalog
from tierckpt.checkpointer._readpool import warm


def _read_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tierckpt-read")]


def _wait_for(cond: Any, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return bool(cond())


def test_reader_threads_start_while_the_tiers_are_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    # reader threads of other tests' checkpointers may be alive still: count this one's
    others = set(_read_threads())

    def ours() -> set[threading.Thread]:
        return set(_read_threads()) - others

    with Checkpointer([LocalTier(tmp_path / "t")]) as ck:
        ck.save(state, 1).wait()
    gate, listing = threading.Event(), threading.Event()
    real = catalog.committed_ids

    def held_listing(backend: Any) -> Any:
        listing.set()
        assert gate.wait(60)
        return real(backend)

    # the load lists its tiers through catalog.list_tiers
    monkeypatch.setattr(catalog, "committed_ids", held_listing)
    ck = Checkpointer([LocalTier(tmp_path / "t")], io_threads=2)
    got: dict[str, Any] = {}
    loader = threading.Thread(target=lambda: got.update(ck.load()))
    loader.start()
    try:
        assert listing.wait(30)
        # no read has been submitted yet: the threads are there before the first one is
        assert _wait_for(lambda: len(ours()) >= 4), _read_threads()
    finally:
        gate.set()
        loader.join(60)
    assert torch.equal(got["w"], state["w"])
    ck.close()
    assert _wait_for(lambda: not ours()), ours()


def test_warm_starts_the_threads_and_submits_still_run() -> None:
    pool = ThreadPoolExecutor(3, thread_name_prefix="tierckpt-read-unit")
    warm(pool, 3)
    fut = pool.submit(lambda: 7)  # may be queued behind a placeholder; never lost
    assert fut.result(30) == 7
    assert _wait_for(lambda: len(pool._threads) == 3)
    # the placeholders ended: all three threads take work
    barrier = threading.Barrier(3, timeout=30)
    assert [f.result(30) for f in [pool.submit(barrier.wait) for _ in range(3)]]
    pool.shutdown()


def test_warm_on_a_pool_already_shut_down_is_harmless() -> None:
    pool = ThreadPoolExecutor(2)
    pool.shutdown()
    warm(pool, 2)  # the starter finds the pool closed and ends quietly
    time.sleep(0.2)
    assert not pool._threads


def test_a_close_from_another_thread_during_a_load_lets_the_load_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``close()`` while a load on another thread reads (an evaluator thread, a signal
    handler): the load finishes bit-exact and the reader threads end after it. Before, the
    close shut the pool the load was reading with down, and the load failed with "cannot
    schedule new futures after shutdown"."""
    from tierckpt.checkpointer import _loading

    state = {f"w{i}": torch.randn(1 << 16) for i in range(8)}
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10) as ck:
        ck.save(state, 1).wait(timeout=60)
    ck = Checkpointer([LocalTier(tmp_path)], chunk_bytes=64 << 10)
    real = _loading.read_shard

    def read_shard(*args: Any, **kwargs: Any) -> Any:
        closer = threading.Thread(target=ck.close)  # closes while this load holds its pool
        closer.start()
        closer.join(60)
        assert not closer.is_alive()
        return real(*args, **kwargs)

    monkeypatch.setattr(_loading, "read_shard", read_shard)
    before = {t for t in threading.enumerate() if t.name.startswith("tierckpt-read")}
    got = ck.load()
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert _wait_for(
        lambda: (
            not [
                t
                for t in threading.enumerate()
                if t.name.startswith("tierckpt-read") and t not in before
            ]
        )
    )
