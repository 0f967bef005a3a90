"""A load on a Checkpointer that is saving at the same time: the checkpoint the load chose is
kept from this process's own retention while it is read (``Checkpointer.protect_steps``), so a
save that commits beside the load never deletes the step under it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt.checkpointer._loading as loading
from tierckpt import Checkpointer, LocalTier, MemoryTier


def _state(value: float) -> dict[str, torch.Tensor]:
    return {f"w{i}": torch.full((4096,), value + i) for i in range(8)}


def _step_1_then_gone(
    ck: Checkpointer, got: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, read: Any
) -> None:
    """``got`` is step 1's state; once the load is over (``read``: the real shard read put
    back), the next save's retention removes step 1 and 2: it was kept only while read."""
    for k, v in _state(1.0).items():
        assert torch.equal(got[k], v)
    monkeypatch.setattr(loading, "_load_from", read)
    ck.save(_state(3.0), 3).wait()
    ck.wait(retention=True)
    assert [c.step for c in ck.checkpoints()] == [3]


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_step_read_while_this_process_commits_a_newer_one_is_not_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    tier = LocalTier(tmp_path / "ck", keep_last=1) if kind == "local" else MemoryTier(keep_last=1)
    ck = Checkpointer([tier])
    try:
        ck.save(_state(1.0), 1).wait()
        original = loading._load_from
        during: list[list[int]] = []

        def save_beside(ctx: Any, t: Any, cid: Any, target: Any = None) -> Any:
            if not during:  # step 2 commits, and its retention pass runs, mid-load
                ck.save(_state(2.0), 2).wait()
                ck.wait(retention=True)
                during.append([c.step for c in ck.checkpoints()])
            return original(ctx, t, cid, target)

        monkeypatch.setattr(loading, "_load_from", save_beside)
        got = ck.load(1)  # an explicit step: no second listing may hide a deletion
        assert during == [[1, 2]]  # step 1 was kept while it was read
        _step_1_then_gone(ck, got, monkeypatch, original)
    finally:
        ck.close()


def test_a_pass_that_chose_the_step_before_the_load_named_it_spares_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retention pass of step 2 asks which steps to keep (none: no load yet), then a load
    of step 1 begins and reads it; the pass must not delete step 1 under the load, although
    step 1 was not protected when the pass chose what to delete."""
    ck = Checkpointer([LocalTier(tmp_path / "ck", keep_last=1)])
    try:
        ck.save(_state(1.0), 1).wait()
        ck.wait(retention=True)
        asked, go_on = threading.Event(), threading.Event()
        calls: list[int] = []

        def protector() -> tuple[int, ...]:
            calls.append(1)
            if len(calls) == 1:  # the pass's first question: it chose step 1 to go
                asked.set()
                go_on.wait(10)
            return ()

        ck.protect_steps(protector)
        reading, read_on = threading.Event(), threading.Event()
        original = loading._load_from

        def slow_read(ctx: Any, t: Any, cid: Any, target: Any = None) -> Any:
            reading.set()
            read_on.wait(10)
            return original(ctx, t, cid, target)

        monkeypatch.setattr(loading, "_load_from", slow_read)
        ck.save(_state(2.0), 2).wait()
        assert asked.wait(10)
        out: dict[str, Any] = {}

        def load() -> None:
            try:
                out["got"] = ck.load(1)
            except BaseException as exc:  # reported below
                out["error"] = exc

        loader = threading.Thread(target=load)
        loader.start()
        assert reading.wait(10)  # the load named step 1 and is reading it
        go_on.set()  # the pass goes on to what it chose
        ck.wait(retention=True)
        during = [c.step for c in ck.checkpoints()]
        read_on.set()
        loader.join(10)
        assert "error" not in out, out.get("error")
        assert during == [1, 2]  # spared by the pass that had chosen it
        assert len(calls) >= 2  # asked again right before the deletion
        _step_1_then_gone(ck, out["got"], monkeypatch, original)
    finally:
        ck.close()


def test_a_slow_deletion_holds_up_only_a_load_of_its_own_step() -> None:
    """A deletion on a store that hangs must not stall other tiers' retention (which asks
    ``steps()``) or loads of other steps; a load of the step being deleted waits for it."""
    from tierckpt.checkpointer._retention import Protectors
    from tierckpt.format import CheckpointId

    protectors = Protectors()
    inside, release = threading.Event(), threading.Event()

    def slow_pass() -> None:
        with protectors.deleting(CheckpointId(5, 0)) as spare:
            assert not spare
            inside.set()
            release.wait(10)

    deleter = threading.Thread(target=slow_pass)
    deleter.start()
    assert inside.wait(10)
    hold, remove = protectors.reading()
    assert protectors.steps() == set()  # another tier's pass: no wait
    hold([6])  # a load of another step: no wait
    assert protectors.steps() == {6}
    waited = threading.Event()
    loader = threading.Thread(target=lambda: (hold([5]), waited.set()))
    loader.start()
    assert not waited.wait(0.3)  # the load of step 5 waits for its deletion
    release.set()
    assert waited.wait(10)
    deleter.join(10)
    loader.join(10)
    assert protectors.steps() == {5, 6}
    with protectors.deleting(CheckpointId(5, 1)) as spare:
        assert spare  # named before this deletion began: kept
    remove()
    assert protectors.steps() == set()
