"""A Checkpointer dropped without ``close()`` (a notebook cell run again, a function that
makes one per call) is collected: its threads end and its leases are given back, so the next
Checkpointer of the same folder in the process saves. Before, the pipeline's threads held it
through its bound methods: it was never collected and refused every later writer of its
location with ``WriterConflict`` ("another writer in this process") until the process ended.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, WriterConflict


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tierckpt-")}


def _ended(threads: set[threading.Thread], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < end:
        time.sleep(0.02)
    return not any(t.is_alive() for t in threads)


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Only explicit collections: what frees a dropped object is what the test checks."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("cycle", [False, True], ids=["plain", "callback-cycle"])
def test_a_cell_run_again_saves_with_a_new_checkpointer(
    tmp_path: Path, cycle: bool, no_automatic_gc: None
) -> None:
    """Each "cell" makes a Checkpointer of the same folder and saves, dropping the previous
    one unclosed; with ``callback-cycle`` each one's callback refers to it (a reference
    cycle: only the cyclic GC frees it, which the lease take runs when the holder is an
    object of this process)."""
    before = _ours()
    for cell in range(3):
        ck = Checkpointer([LocalTier(tmp_path)])
        if cycle:
            ck.add_callback(lambda result, ck=ck: ck.steps)
        ck.save({"w": torch.full((1000,), float(cell))}, step=cell + 1).wait(timeout=60)
        assert ck.steps() == list(range(1, cell + 2))
    started = _ours() - before
    del ck
    gc.collect()
    assert _ended(started), sorted(t.name for t in started if t.is_alive())
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert float(ck.load()["w"][0]) == 2.0


def test_a_checkpointer_dropped_with_a_save_in_flight_commits_it(tmp_path: Path) -> None:
    """The save in flight keeps its Checkpointer alive until it is done on every tier; then
    the dropped object is collected and its threads end."""
    before = _ours()
    state = {f"w{i}": torch.randn(1 << 20) for i in range(16)}  # 64 MiB
    ck = Checkpointer([LocalTier(tmp_path)], chunk_bytes=4 << 20, host_buffer_bytes=16 << 20)
    ck.save(state, step=1)
    started = _ours() - before
    del ck
    gc.collect()
    assert _ended(started, timeout=120), sorted(t.name for t in started if t.is_alive())
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load()
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_second_checkpointer_still_referenced_is_still_refused(tmp_path: Path) -> None:
    """Only a dropped writer gives its location up: two live ones of one folder in one
    process are still one too many."""
    with Checkpointer([LocalTier(tmp_path)]) as first:
        first.save({"w": torch.ones(10)}, step=1).wait(timeout=60)
        with Checkpointer([LocalTier(tmp_path)]) as second, pytest.raises(WriterConflict):
            second.save({"w": torch.ones(10)}, step=2)
        first.save({"w": torch.ones(10)}, step=3).wait(timeout=60)
        assert first.steps() == [1, 3]


def test_a_collection_inside_one_of_its_own_threads_closes_it_from_another(
    tmp_path: Path,
) -> None:
    """The cyclic GC may collect a dropped Checkpointer in any thread, one of its own
    pipeline's included (a commit callback's allocations): its close then runs on another
    thread. Run in the tier thread itself (as that GC pass would), the close waited for the
    very commit it was called from, and the leases stayed."""
    ck = Checkpointer([LocalTier(tmp_path)])
    ck.save({"w": torch.ones(10)}, 1).wait(timeout=60)
    pipeline = ck._pipeline
    assert pipeline is not None
    done = threading.Event()

    def collected_here(result: object) -> None:
        ck.__del__()  # what the GC does when it collects the dropped object in this thread
        done.set()

    ck.add_callback(collected_here)
    ck.save({"w": torch.ones(10)}, 2)
    assert done.wait(30), "the close ran in the thread it waited for"
    assert _ended(set(pipeline._threads))
    assert not list((tmp_path / "leases").iterdir())  # given back
    with Checkpointer([LocalTier(tmp_path)]) as again:
        assert again.steps() == [1, 2]  # the save it was called from committed


def test_a_guarded_checkpointer_dropped_unclosed_is_collected(
    tmp_path: Path, no_automatic_gc: None
) -> None:
    """``guard(optimizer)``'s step hook held the Checkpointer strongly, for as long as the
    optimizer lived: one dropped without ``close()`` kept its threads and leases, and the next
    Checkpointer of its folder raised ``WriterConflict`` into the training loop at its first
    save (found by a soak test of a job making a new Checkpointer per phase)."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for phase in range(3):
        ck = Checkpointer([LocalTier(tmp_path)])
        ck.guard(opt, model)
        model(torch.ones(2, 8)).sum().backward()
        ck.save({"model": model.state_dict(), "phase": phase}, step=phase + 1).wait(timeout=60)
        opt.step()  # the hook of every earlier Checkpointer runs too: dead ones do nothing
        gone = weakref.ref(ck)
        del ck
        gc.collect()
        assert gone() is None, gc.get_referrers(gone())
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert ck.steps() == [1, 2, 3]


def test_close_removes_guard_s_hook(tmp_path: Path) -> None:
    """A job that closes a Checkpointer and makes another per phase (as frameworks do around
    each fit) left one step hook per closed Checkpointer on the optimizer, each holding it
    (and its backends' entries in the library's caches): 150 cycles, 150 hooks."""
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for phase in range(3):
        with Checkpointer([LocalTier(tmp_path)]) as ck:
            ck.guard(opt, model)
            assert len(opt._optimizer_step_pre_hooks) == 1
            ck.save({"model": model.state_dict()}, step=phase + 1).wait(timeout=60)
        assert len(opt._optimizer_step_pre_hooks) == 0
    opt.step()
