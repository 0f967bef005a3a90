"""Retention runs after the commit is reported: ``h.wait()`` / ``Checkpointer.wait()`` return
once a save is durable, while the pass that deletes the older checkpoints runs on the tier's
thread before it takes its next job there. ``wait(retention=True)``, the checkpointer's
listings and ``close()`` wait for those passes; and a pass lists the tier once."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_retention_requests import _per_save

from tierckpt import Checkpointer, CheckpointId
from tierckpt.backends.local import LocalBackend
from tierckpt.policy import LocalTier
from tierckpt.testing.faultproxy import FaultProxy
from tierckpt.testing.s3servers import S3Server

WAIT = 120  # generous: only reached when something is wrong


class _Gate:
    """Holds a tier's deletions of manifests (the first thing a retention pass deletes)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.deleting = threading.Event()


def _gated_tier(path: Path, gate: _Gate, keep_last: int = 1) -> LocalTier:
    class Gated(LocalBackend):
        def delete(self, name: str) -> None:
            if name.startswith("manifests/"):
                gate.deleting.set()
                assert gate.open.wait(WAIT), "the test never opened the gate"
            super().delete(name)

    class GatedTier(LocalTier):
        def make_backend(self) -> LocalBackend:
            return Gated(self.path)

    return GatedTier(path, keep_last=keep_last)


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1 << 14,), v)}


def _manifests(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "manifests").glob("*.json"))


def _data_steps(path: Path) -> set[str]:
    """The step folders holding data files (any layout)."""
    return {p.parent.name for p in path.rglob("*.tck")}


def test_wait_returns_while_old_checkpoints_are_still_being_deleted(tmp_path: Path) -> None:
    """The commit is reported before the pass; the tier takes its next job after the pass."""
    gate = _Gate()
    ck = Checkpointer([_gated_tier(tmp_path, gate)])
    try:
        ck.save(_state(1), 1).wait(timeout=WAIT)
        h2 = ck.save(_state(2), 2)
        h2.wait(timeout=WAIT)  # before: timed out, retention (held) ran before the report
        assert h2.committed("local")
        assert gate.deleting.wait(WAIT)  # the pass runs after the report, on the tier thread
        assert len(_manifests(tmp_path)) == 2  # step 1 not deleted yet (held)
        h3 = ck.save(_state(3), 3)
        # the tier thread finishes the pass before its next job: step 3 waits for the gate
        with pytest.raises(TimeoutError):
            h3.wait(timeout=0.5)
        gate.open.set()
        h3.wait(timeout=WAIT)
        ck.wait(timeout=WAIT, retention=True)
        assert ck.steps() == [3]
    finally:
        gate.open.set()
        ck.close()
    assert _manifests(tmp_path) == ["step-000000000003.json"]


def test_wait_with_retention_and_listings_wait_for_the_pass(tmp_path: Path) -> None:
    gate = _Gate()
    ck = Checkpointer([_gated_tier(tmp_path, gate)])
    try:
        ck.save(_state(1), 1).wait(timeout=WAIT)
        ck.save(_state(2), 2).wait(timeout=WAIT)
        assert gate.deleting.wait(WAIT)
        with pytest.raises(TimeoutError, match="retention"):
            ck.wait(timeout=0.2, retention=True)  # the pass is held: cannot be over
        seen: dict[str, object] = {}

        def listing() -> None:
            seen["steps"] = ck.steps()

        th = threading.Thread(target=listing)
        th.start()
        th.join(0.5)
        assert th.is_alive() and not seen  # steps() waits for the pass already started
        gate.open.set()
        th.join(WAIT)
        assert seen["steps"] == [2]  # never the checkpoint the reported commit deletes
        ck.wait(timeout=WAIT, retention=True)
        assert _manifests(tmp_path) == ["step-000000000002.json"]
        assert _data_steps(tmp_path) == {"000000000002"}
    finally:
        gate.open.set()
        ck.close()


def test_close_completes_the_deletions(tmp_path: Path) -> None:
    """Nothing the rules remove is left behind a clean close, even when the close starts
    while the pass is running."""
    gate = _Gate()
    ck = Checkpointer([_gated_tier(tmp_path, gate)])
    closed = threading.Event()
    try:
        ck.save(_state(1), 1).wait(timeout=WAIT)
        ck.save(_state(2), 2).wait(timeout=WAIT)
        assert gate.deleting.wait(WAIT)

        def close() -> None:
            ck.close()
            closed.set()

        th = threading.Thread(target=close)
        th.start()
        assert not closed.wait(0.5)  # the pass is held: close() cannot be over
        gate.open.set()
        th.join(WAIT)
        assert closed.is_set()
    finally:
        gate.open.set()
        ck.close()
    assert _manifests(tmp_path) == ["step-000000000002.json"]
    assert _data_steps(tmp_path) == {"000000000002"}


def _counting_tier(path: Path, lists: list[str], keep_last: int) -> LocalTier:
    class Counting(LocalBackend):
        def list(self, prefix: str = "") -> list[str]:
            lists.append(prefix)
            return super().list(prefix)

    class CountingTier(LocalTier):
        def make_backend(self) -> LocalBackend:
            return Counting(self.path)

    return CountingTier(path, keep_last=keep_last)


def test_a_steady_pass_lists_the_tier_once_and_keeps_every_rule(tmp_path: Path) -> None:
    """Before: three listings per save (the manifests, the pins, every object)."""
    lists: list[str] = []
    per_save = []
    with Checkpointer([_counting_tier(tmp_path, lists, keep_last=2)]) as ck:
        for s in range(1, 8):
            before = len(lists)
            ck.save(_state(s), s).wait(timeout=WAIT)
            ck.wait(timeout=WAIT, retention=True)
            per_save.append(len(lists) - before)
            if s == 3:
                ck.pin(3)  # read from the same listing: must still be kept
        assert ck.steps() == [3, 6, 7]
        assert ck.pinned() == [CheckpointId(3)]
    # the first save also picks its timeline (one listing of the manifests)
    assert per_save[1:] == [1] * 6, per_save


def test_rules_that_keep_every_checkpoint_list_only_the_manifests(tmp_path: Path) -> None:
    """A tier whose rules keep all of many checkpoints (a large keep_last) listed every
    object of the tier at each save, to find nothing to remove: with 1,100 checkpoints on S3,
    saves were 35x slower than with keep_last=None. After a pass that kept many and removed
    none, a pass asks the manifests alone, and lists every object only to remove one."""
    from tierckpt.retention import MANIFESTS_FIRST

    lists: list[str] = []
    n = MANIFESTS_FIRST + 4
    tier = _counting_tier(tmp_path, lists, keep_last=n)
    per_save: dict[int, list[str]] = {}
    with Checkpointer([tier]) as ck:
        for s in range(1, n + 3):
            before = len(lists)
            ck.save(_state(s), s).wait(timeout=WAIT)
            ck.wait(timeout=WAIT, retention=True)
            per_save[s] = lists[before:]
        assert ck.steps() == list(range(3, n + 3))
    for s in range(MANIFESTS_FIRST + 1, n + 1):  # everything kept: the manifests alone
        assert per_save[s] == ["manifests/"], (s, per_save[s])
    assert per_save[n + 1] == ["manifests/", ""]  # one to remove: every object listed
    assert per_save[n + 2] == [""]  # removing one per save: one listing, as before


@pytest.mark.s3
def test_a_steady_pass_sends_one_listing_to_an_object_store(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        counts = _per_save(proxy, bucket, "obstore", 2, range(1, 6))
    for c in counts[1:]:
        assert c["list"] == 1 and c["uploads"] == 0, counts
    assert all(c["DELETE"] >= 1 for c in counts[2:]), counts


def test_a_callback_inside_the_commit_or_the_pass_may_list(tmp_path: Path) -> None:
    """``on_commit`` runs inside the report and ``protect_steps`` inside the pass, both on the
    tier's thread: listing from there must not wait for that thread's own pass."""
    seen: list[list[int]] = []
    holder: dict[str, Checkpointer] = {}

    def on_commit(_r: object) -> None:
        seen.append(holder["ck"].steps())

    def protect() -> list[int]:
        seen.append(holder["ck"].steps())
        return []

    with Checkpointer([LocalTier(tmp_path, keep_last=1)], on_commit=on_commit) as ck:
        holder["ck"] = ck
        ck.protect_steps(protect)
        for s in (1, 2, 3):
            ck.save(_state(s), s).wait(timeout=WAIT)
        ck.wait(timeout=WAIT, retention=True)
        assert ck.steps() == [3]
    assert seen and all(steps[-1] in (1, 2, 3) for steps in seen), seen


def test_the_dcp_writers_pass_is_waited_for_too(tmp_path: Path) -> None:
    """The DCP writer commits itself and queues the pass on the tier's thread
    (``Pipeline.retain_later``): a wait for retention waits for that pass as well (before:
    it returned at once, while the pass had still to delete the older checkpoint)."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    gate = _Gate()
    w = TierWriter([_gated_tier(tmp_path, gate)], 1)
    try:
        dcp.save({"w": torch.ones(64)}, storage_writer=w, no_dist=True)
        dcp.save({"w": torch.full((64,), 2.0)}, storage_writer=w, checkpoint_id=2, no_dist=True)
        assert gate.deleting.wait(WAIT)
        pipeline = w._pipeline
        assert pipeline is not None
        assert not pipeline.wait_retention(timeout=0.2)  # the pass is held: cannot be over
        gate.open.set()
        assert pipeline.wait_retention(timeout=WAIT)
        assert _manifests(tmp_path) == ["step-000000000002.json"]
    finally:
        gate.open.set()
        w.close()
