"""The commit strategy a Checkpointer hands its saves and loads to: the calls come in the
order, and on the threads, that ``tierckpt.commit.CommitStrategy`` documents; the multi-rank
strategy keeps its handshake state per instance."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, MemoryTier
from tierckpt.commit import CommitStrategy, SaveStart, SingleRankCommit
from tierckpt.distributed import MultiRankCommit
from tierckpt.errors import CheckpointFailed, CheckpointNotFound
from tierckpt.format import CheckpointId, Manifest, ShardRef
from tierckpt.pipeline import SaveJob, Tier
from tierckpt.policy import resolve_codec
from tierckpt.restore import LoadedShard


class Recording:
    """A SingleRankCommit that notes every call: (method, thread name, step or tier)."""

    def __init__(self) -> None:
        self.inner = SingleRankCommit(repopulate=True)
        self.calls: list[tuple[str, str, Any]] = []
        self._lock = threading.Lock()

    def _note(self, what: str, detail: Any) -> None:
        with self._lock:
            self.calls.append((what, threading.current_thread().name, detail))

    def begin_save(
        self, step: int, busy: bool, *, timeline: int, agree_timeline: bool
    ) -> SaveStart:
        self._note("begin_save", step)
        return self.inner.begin_save(step, busy, timeline=timeline, agree_timeline=agree_timeline)

    def commit(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> Future[None] | None:
        self._note("commit", tier.name)
        return self.inner.commit(tier, job, ref, raw, stored)

    def retains(self, tier: Tier, job: SaveJob) -> bool:
        self._note("retains", tier.name)
        return self.inner.retains(tier, job)

    def report_failure(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        self._note("report_failure", tier.name)

    @property
    def repopulates(self) -> bool:
        return self.inner.repopulates

    def agree_on_step(
        self, candidates: Sequence[CheckpointId], *, listed: Any = None
    ) -> list[CheckpointId]:
        self._note("agree_on_step", list(candidates))
        return self.inner.agree_on_step(candidates, listed=listed)

    def agree_on_outcome(self, code: int) -> int:
        self._note("agree_on_outcome", code)
        return self.inner.agree_on_outcome(code)

    def settle(self) -> None:
        self.inner.settle()

    def publish_repopulated(self, loaded: LoadedShard | None) -> None:
        self._note("publish_repopulated", None if loaded is None else loaded.manifest.id)
        self.inner.publish_repopulated(loaded)

    def read_manifest(self, tier: Tier, cid: CheckpointId) -> Manifest:
        return self.inner.read_manifest(tier, cid)  # not a step of the protocol's order


def _recorded(ck: Checkpointer) -> Recording:
    rec = Recording()
    strategy: CommitStrategy = rec  # mypy: the fake is a CommitStrategy too
    ck._strategy = strategy  # before the first save: the pipeline takes its hooks then
    return rec


def test_checkpointer_picks_the_strategy_by_world_size(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path / "a")]) as one:
        assert isinstance(one._strategy, SingleRankCommit)
    with Checkpointer([LocalTier(tmp_path / "b")], rank=1, world_size=2) as two:
        assert isinstance(two._strategy, MultiRankCommit)


def test_save_calls_begin_commit_retains_in_order_on_their_threads(tmp_path: Path) -> None:
    with Checkpointer([MemoryTier(namespace="strategy-order"), LocalTier(tmp_path)]) as ck:
        rec = _recorded(ck)
        ck.save({"w": torch.arange(1000.0)}, 7).wait(timeout=60)
        assert rec.calls[0] == ("begin_save", "MainThread", 7)
        for tier in ("memory", "local"):
            mine = [(what, thread) for what, thread, detail in rec.calls if detail == tier]
            # 2. commit on the tier's writer thread, 3. retains after it, on the same thread
            assert mine == [("commit", f"tierckpt-{tier}"), ("retains", f"tierckpt-{tier}")]
        assert len(rec.calls) == 5
        assert ck.steps() == [7]


def test_a_failed_tier_is_reported_and_never_committed(tmp_path: Path) -> None:
    """A failed copy is reported on a pipeline thread and never committed; on a local tier the
    strategy may then be asked whether this rank applies retention (a failed save frees the
    disk: retention also runs after failures there)."""
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        rec = _recorded(ck)
        backend = ck.backend("local")

        def full(name: str) -> Any:
            raise OSError(28, "No space left on device")

        backend.open_writer = full
        with pytest.raises(CheckpointFailed):
            ck.save({"w": torch.ones(10)}, 1).wait(timeout=60)
        ck.close()  # every background call has happened
        names = [c[0] for c in rec.calls]
        # "retains" is asked before the report (a pass that follows a report is counted
        # before it: see Checkpointer.wait(retention=True)); never "commit"
        assert names[0] == "begin_save" and names.count("report_failure") == 1, names
        assert set(names) <= {"begin_save", "report_failure", "retains"}, names
        report = rec.calls[names.index("report_failure")]
        assert report[1].startswith("tierckpt-")  # a pipeline thread, not training's


def test_load_agrees_then_publishes_exactly_once_also_when_it_fails(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.ones(10)}, 3).wait(timeout=60)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        rec = _recorded(ck)
        ck.load()
        assert rec.calls == [
            ("agree_on_step", "MainThread", [CheckpointId(3)]),
            ("publish_repopulated", "MainThread", CheckpointId(3)),
            ("agree_on_outcome", "MainThread", 0),  # every rank ends the load alike
        ]
        rec.calls.clear()
        with pytest.raises(CheckpointNotFound, match="step 9 is not committed on any tier"):
            ck.load(step=9)
        # the id it does not hold goes to the agreement (other ranks must hear of it)
        assert rec.calls == [
            ("agree_on_step", "MainThread", [CheckpointId(9)]),
            ("publish_repopulated", "MainThread", None),
            ("agree_on_outcome", "MainThread", 1),
        ]


def test_multi_rank_handshake_state_belongs_to_each_strategy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a process group the attempt id is TIERCKPT_ATTEMPT_ID, the step, the timeline
    and the count of that step's saves; each strategy (each checkpointer) counts its own."""
    monkeypatch.setenv("TIERCKPT_ATTEMPT_ID", "job7")

    def strategy() -> MultiRankCommit:
        return MultiRankCommit(
            [], rank=1, world_size=2, on_busy="block", repopulate=True, defer=lambda fn: fn()
        )

    a, b = strategy(), strategy()
    assert [
        a.begin_save(s, False, timeline=0, agree_timeline=False).attempt for s in (1, 2, 2)
    ] == ["job7-1.0.1", "job7-2.0.1", "job7-2.0.2"]  # a retry of step 2 is a new attempt
    start = b.begin_save(1, True, timeline=4, agree_timeline=True)
    assert start == SaveStart("job7-1.4.1", True, 4)
    assert not a.repopulates  # no process group: the copies could not be committed together
    private, shared = _tier(MemoryTier(namespace="strategy-mine")), _tier(LocalTier(tmp_path))
    assert a.retains(private, _job(rank=1))  # every rank applies it to its own private copy
    assert not a.retains(shared, _job(rank=1))  # rank 0 alone, on a tier all ranks share
    assert a.retains(shared, _job(rank=0))


def _tier(spec: Any) -> Tier:
    backend = spec.make_backend()
    return Tier(spec, backend, resolve_codec("raw", backend))


def _job(*, rank: int) -> Any:
    return SimpleNamespace(rank=rank)
