"""Multi-rank commit and load agreement (``tierckpt.distributed``).

The ``distributed`` tests run real processes with gloo on 127.0.0.1 (see ``dist_workers``);
the others drive the commit protocol in one process, with rank and world size given by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt import distributed as tdist
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import CheckpointFailed, CheckpointNotFound, FormatError
from tierckpt.format import manifest_name, rank_failure_name, rank_record_name, shard_name

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3(moto_server: Any, s3_bucket: Callable[[Any], str]) -> dict[str, str]:
    return {"bucket": s3_bucket(moto_server), "endpoint": moto_server.endpoint_url}


# -- completion records -----------------------------------------------------------------------


def _record(**kw: Any) -> tdist.RankRecord:
    base: dict[str, Any] = dict(
        step=5,
        rank=1,
        world_size=2,
        attempt="00000000000000ab-1",
        tier="local",
        file=shard_name(5, 1),
        size=4160,
        index_checksum="0123456789abcdef",
        raw_bytes=4096,
        stored_bytes=4096,
        codec="raw",
    )
    base.update(kw)
    return tdist.RankRecord(**base)


def test_record_round_trip() -> None:
    rec = _record()
    assert tdist.decode_record(tdist.encode_record(rec), where="t") == rec


@pytest.mark.parametrize(
    "blob",
    [
        b"not json",
        b"[]",
        b'{"format": "tierckpt-rank-record", "version": 2}',
        tdist.encode_record(_record(file="../../etc/passwd")),
        tdist.encode_record(_record(rank=2)),
        tdist.encode_record(_record(index_checksum="zz")),
        tdist.encode_record(_record(attempt="a/b")),
        tdist.encode_record(_record(size=-1)),
        tdist.encode_record(_record()).replace(b'"size":4160', b'"size":"4160"'),
        b"{" + b" " * (70 << 10) + b"}",
    ],
)
def test_hostile_records_are_refused(blob: bytes) -> None:
    with pytest.raises(FormatError):
        tdist.decode_record(blob, where="t")


# -- rank 0's wait, in one process -------------------------------------------------------------


def test_wait_for_records_times_out_naming_missing_ranks(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path)
    b.put_atomic(
        rank_record_name(5, 1),
        tdist.encode_record(_record(rank=1, world_size=4, file=shard_name(5, 1))),
    )
    t0 = time.monotonic()
    with tdist.knobs(commit_timeout=0.5, poll_max=0.1), pytest.raises(tdist.CommitTimeout) as ei:
        tdist.wait_for_records(b, "local", 5, 4, "00000000000000ab-1")
    assert time.monotonic() - t0 < 3
    msg = str(ei.value)
    assert "ranks 0, 2, 3 (of 4)" in msg and "no manifest" in msg
    assert isinstance(ei.value, TimeoutError)


@pytest.mark.parametrize("direct_probe_max", [16, 0])  # GET by name, or LIST the folder
def test_wait_ignores_stale_records_until_the_current_attempt_writes(
    tmp_path: Path, direct_probe_max: int
) -> None:
    b = LocalBackend(tmp_path)
    stale = _record(rank=1, attempt="00000000000000ff-1", size=999_999)
    b.put_atomic(rank_record_name(5, 1), tdist.encode_record(stale))
    b.put_atomic(
        rank_record_name(5, 0), tdist.encode_record(_record(rank=0, file=shard_name(5, 0)))
    )
    fresh = _record(rank=1)

    def later() -> None:
        time.sleep(0.3)
        b.put_atomic(rank_record_name(5, 1), tdist.encode_record(fresh), overwrite=True)

    th = threading.Thread(target=later)
    th.start()
    with tdist.knobs(commit_timeout=10, poll_max=0.05, direct_probe_max=direct_probe_max):
        got = tdist.wait_for_records(b, "local", 5, 2, "00000000000000ab-1")
    th.join()
    assert got[1] == fresh and got[1].size == 4160


def _ranks_in_threads(tmp_path: Path) -> tuple[list[Checkpointer], list[dict[str, Any]]]:
    """Two checkpointers in this process acting as ranks 0 and 1 of 2, and their states."""
    cks = [
        Checkpointer([LocalTier(tmp_path)], rank=r, world_size=2, host_buffer_bytes=8 << 20)
        for r in range(2)
    ]
    return cks, [dist_workers.rank_state(r, 1, numel=64) for r in range(2)]


def test_two_ranks_in_threads_without_a_process_group(tmp_path: Path, monkeypatch: Any) -> None:
    """Rank and world size by hand (no torch.distributed): the records still commit."""
    monkeypatch.setenv("TIERCKPT_ATTEMPT_ID", "job7")
    cks, states = _ranks_in_threads(tmp_path)
    with tdist.knobs(commit_timeout=20, poll_max=0.05):
        handles = [ck.save(st, 1) for ck, st in zip(cks, states)]
        for h in handles:
            h.wait(timeout=30)
        tdist.wait_committed(cks[1].backend("local"), 1, timeout=10)
    for r, ck in enumerate(cks):
        assert dist_workers.same(ck.load(), states[r]) == []
        ck.close()
    # no process group: a one-rank-only record of step 2 never commits, and says why
    ck0 = Checkpointer([LocalTier(tmp_path)], rank=0, world_size=2, host_buffer_bytes=8 << 20)
    with tdist.knobs(commit_timeout=0.5, poll_max=0.1):
        h = ck0.save(states[0], 2)
        with pytest.raises(CheckpointFailed, match="ranks 1 "):
            h.wait(timeout=30)
    assert not LocalBackend(tmp_path).exists(manifest_name(2))
    assert ck0.steps() == [1]
    ck0.close()


@pytest.mark.parametrize("direct_probe_max", [16, 0])  # GET by name, or LIST the folder
def test_wait_stops_at_a_failure_record_of_this_attempt_only(
    tmp_path: Path, direct_probe_max: int
) -> None:
    b = LocalBackend(tmp_path)
    b.put_atomic(
        rank_record_name(5, 0),
        tdist.encode_record(_record(rank=0, world_size=3, file=shard_name(5, 0))),
    )
    # a failure left by an earlier attempt at step 5 is not this attempt's
    b.put_atomic(
        rank_failure_name(5, 2),
        tdist.encode_failure(5, 2, "00000000000000ff-1", "local", "OSError: old"),
    )

    def later() -> None:
        time.sleep(0.3)
        b.put_atomic(
            rank_failure_name(5, 1),
            tdist.encode_failure(5, 1, "00000000000000ab-1", "local", "OSError: disk full"),
        )

    th = threading.Thread(target=later)
    th.start()
    t0 = time.monotonic()
    with (
        tdist.knobs(commit_timeout=60, poll_max=0.05, direct_probe_max=direct_probe_max),
        pytest.raises(tdist.RankFailed) as ei,
    ):
        tdist.wait_for_records(b, "local", 5, 3, "00000000000000ab-1")
    th.join()
    assert time.monotonic() - t0 < 10  # not the 60 s commit timeout
    msg = str(ei.value)
    assert "rank(s) 1 reported" in msg and "OSError: disk full" in msg
    assert "old" not in msg and "no manifest" in msg


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"[]",
        b'{"format": "tierckpt-rank-failure", "version": 9}',
        b'{"format": "tierckpt-rank-failure", "version": 1, "step": 5, "rank": 1, '
        b'"attempt": "../x", "error": "e"}',
        b"x" * (65 << 10),
    ],
)
def test_hostile_failure_records_are_refused(blob: bytes) -> None:
    with pytest.raises(FormatError):
        tdist.decode_failure(blob, where="t")


def test_failing_rank_makes_rank0_fail_fast_and_a_retry_commits(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Rank 1's disk is full: rank 0 stops waiting at once (not after the commit timeout),
    names rank 1 and its error, commits nothing; a retry of the step commits."""
    monkeypatch.setenv("TIERCKPT_ATTEMPT_ID", "job8")
    cks, states = _ranks_in_threads(tmp_path)
    real_open = LocalBackend.open_writer
    full = [True]

    def open_writer(self: LocalBackend, name: str) -> Any:
        if full[0] and name == shard_name(1, 1):
            raise OSError(28, "No space left on device")
        return real_open(self, name)

    monkeypatch.setattr(LocalBackend, "open_writer", open_writer)
    with tdist.knobs(commit_timeout=120, poll_max=0.05):
        t0 = time.monotonic()
        handles = [ck.save(st, 1) for ck, st in zip(cks, states)]
        for h in handles:
            with pytest.raises(CheckpointFailed) as ei:
                h.wait(timeout=60)
        assert time.monotonic() - t0 < 30
        assert isinstance(ei.value.__cause__, OSError)  # rank 1: its own error
        with pytest.raises(CheckpointFailed) as ei0:
            handles[0].wait()
        assert isinstance(ei0.value.__cause__, tdist.RankFailed)
        assert "rank(s) 1 reported" in str(ei0.value) and "No space left" in str(ei0.value)
        assert not LocalBackend(tmp_path).exists(manifest_name(1))
        assert cks[0].steps() == []
        full[0] = False  # space freed: the same step again, a new attempt
        handles = [ck.save(st, 1) for ck, st in zip(cks, states)]
        for h in handles:
            h.wait(timeout=60)
        tdist.wait_committed(cks[1].backend("local"), 1, timeout=30)
    for r, ck in enumerate(cks):
        assert dist_workers.same(ck.load(), states[r]) == []
        ck.close()


def test_private_tier_detection(monkeypatch: Any, tmp_path: Path) -> None:
    from tierckpt import MemoryTier

    ck = Checkpointer([MemoryTier(namespace="pt"), LocalTier(tmp_path, name="nvme")])
    mem, nvme = ck._tiers
    assert tdist.is_private_tier(mem) and not tdist.is_private_tier(nvme)
    monkeypatch.setenv("TIERCKPT_PRIVATE_TIERS", "nvme, other")
    assert tdist.is_private_tier(nvme)
    ck.close()


def test_knobs_from_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("TIERCKPT_COMMIT_TIMEOUT_S", "12.5")
    monkeypatch.setenv("TIERCKPT_COMMIT_POLL_MAX_S", "0.25")
    k = tdist.get_knobs()
    assert k.commit_timeout == 12.5 and k.poll_max == 0.25
    with tdist.knobs(commit_timeout=1) as k2:
        assert tdist.get_knobs() is k2 and k2.commit_timeout == 1 and k2.poll_max == 0.25
    assert tdist.get_knobs().commit_timeout == 12.5


# -- real processes ----------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.s3
def test_two_ranks_save_commit_and_load_through_ram_local_and_s3(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    res = dist_workers.run("w_save_load", 2, root=str(tmp_path), s3=s3, timeout=120)
    for rank, r in enumerate(res):
        # rank 0's completion includes the commit; rank 1's only means "my shard is durable"
        # (rank 0 was made the slowest rank there, so the manifest was not there yet)
        assert r["manifest2_after_own_wait"] is (rank == 0)
        # a record left by an earlier, killed attempt at step 3 was ignored and overwritten
        assert r["records3"] == [0, 1] and r["stale3"] == [1]
        assert r["memory_steps"] == [2, 3]  # the RAM tier committed through the store
        assert r["loaded_newest"] == 3 and r["diff_newest"] == []
        assert r["diff_step2"] == []
        assert "committed and readable on every rank" in r["missing_step"]
        assert "step 77: not on any tier" in r["missing_step"]
        # restored bit-exact from S3 into an empty local folder per rank; that tier is not
        # named private, so rank 0 does not commit a copy there that lacks rank 1's file
        assert r["fresh_steps"] == [] and r["restore_step"] == 3 and r["diff_restore"] == []
        assert r["skipped"] == [False, True]  # rank 1 was still flushing: both skipped
    local = LocalBackend(tmp_path / "local")
    manifests = [n for n in local.list("manifests/")]
    assert manifests == [manifest_name(1), manifest_name(2), manifest_name(3)]


@pytest.mark.distributed
@pytest.mark.s3
def test_killed_rank_leaves_no_manifest_and_previous_step_loads(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    res = dist_workers.run(
        "w_kill_save", 3, root=str(tmp_path), s3=s3, victim=2, expect_killed=(2,), timeout=120
    )
    r0, r1, _dead = res
    assert r0["error_types"] == ["CommitTimeout"]
    assert "misses the completion records of ranks 2 (of 3)" in r0["error"]
    assert "previous checkpoint stays the newest" in r0["error"]
    assert r0["manifest2"] == [False, False] and r0["steps"] == [1]
    assert r1["error"] is None  # rank 1's part (its shard and record) succeeded
    # a new job (same world size) loads step 1 on every rank; the dead attempt's files go
    res = dist_workers.run("w_load_after_kill", 3, root=str(tmp_path), s3=s3, timeout=120)
    for r in res:
        assert r["step"] == 1 and r["diff"] == []
        assert r["leftover2"] == [False, False]


@pytest.mark.distributed
def test_failing_rank_fails_the_save_on_every_rank_at_once(tmp_path: Path) -> None:
    """Rank 2's disk fails at step 2 on the shared local tier and the private RAM tier:
    with a 120 s commit timeout every rank still gets its answer within seconds."""
    res = dist_workers.run("w_fail_save", 3, root=str(tmp_path), victim=2, timeout=150)
    r0, r1, r2 = res
    for r in res:
        assert r["seconds"] < 60, r  # not the 120 s commit timeout
        assert r["manifest2"] is False
        assert r["steps"] == [1, 3] and r["diff3"] == []
    assert r0["error_types"] == {"local": "RankFailed", "memory": "RankFailed"}
    local, memory = r0["messages"]["local"], r0["messages"]["memory"]
    assert "rank(s) 2 reported" in local and "No space left" in local
    assert "rank 2: OSError" in memory and "No space left" in memory
    # rank 1's own shard was fine; on the private tier it waits for rank 0's manifest and
    # hears of rank 2's failure through the store
    assert r1["error_types"] == {"memory": "RankFailed"}
    assert r2["error_types"] == {"local": "OSError", "memory": "OSError"}


@pytest.mark.distributed
@pytest.mark.s3
def test_multi_rank_load_from_s3_repopulates_local_tiers(
    tmp_path: Path, s3: dict[str, str]
) -> None:
    res = dist_workers.run("w_repopulate", 2, root=str(tmp_path), s3=s3, timeout=150)
    # rank 1's read failed: the load fails on every rank (rank 0 does not go on alone)
    assert [r["first_error"] for r in res] == ["TierCkptError", "CorruptCheckpoint"]
    assert [r["shared_after_failure"] for r in res] == [[], []]
    for rank, r in enumerate(res):
        assert r["diff_loaded"] == [] and r["diff_shared"] == [] and r["diff_nvme"] == []
        assert r["shared_steps"] == [2] and r["private_steps"] == [2]
        # a node-local folder holds its own rank's shard (and the step's manifest) only
        assert r["private_files"] == [f"rank-{rank:06d}.tck"]
    shared = LocalBackend(tmp_path / "shared-local")
    # the copies keep the source's (S3's, format v2 over 256 prefixes) file names
    assert shared.exists(shard_name(2, 0, prefixes=256))
    assert shared.exists(shard_name(2, 1, prefixes=256))


@pytest.mark.distributed
def test_rank0_blocking_does_not_grow_with_ranks(tmp_path: Path, capsys: Any) -> None:
    """Per-save blocking on rank 0 with 1 vs 2 ranks (and a slow rank 1); prints the numbers."""
    rows = []
    for world, slow in ((1, -1), (2, -1), (2, 1)):
        res = dist_workers.run(
            "w_blocking",
            world,
            root=str(tmp_path),
            steps=18,
            mb=16,
            every=3,
            # the capture copy (16 MiB) must overlap a step's compute: 150 ms leaves it
            # room on a loaded machine (at 50 ms a descheduled copy made wait_captured block
            # and the test fail now and then); rank 1's writes stay slower than its saves
            compute_s=0.15,
            slow_rank=slow,
            slow_write_s=0.15,
            tag=f"s{slow}",
            timeout=120,
        )
        rows.append((world, slow, res[0]))
    with capsys.disabled():
        print()
        for world, slow, r in rows:
            print(
                f"  rank 0, {world} rank(s){' (rank 1 slow)' if slow >= 0 else ''}: blocked per "
                f"save p50 {r['blocked_ms_p50']:.2f} ms, mean {r['blocked_ms_mean']:.2f} ms, "
                f"max {r['blocked_ms_max']:.2f} ms; loop {r['loop_s']:.2f} s"
            )
    for _w, _s, r in rows:
        assert r["failed"] == [] and r["saves"] == 6
        # lazy capture: save() returns at once and the copy overlaps the 150 ms "compute"
        assert r["blocked_ms_p50"] < 40


@pytest.mark.distributed
def test_torchrun_example_trains_and_resumes(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        torchrun = Path(shutil.which("torchrun") or "torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "examples" / "torchrun_train.py"),
        "--dir",
        str(tmp_path / "ck"),
        "--every",
        "4",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(
        [*cmd, "--steps", "8"], capture_output=True, text=True, env=env, timeout=120
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resumed from step 0" in first.stdout and "committed steps [4, 8]" in first.stdout
    second = subprocess.run(
        [*cmd, "--steps", "12"], capture_output=True, text=True, env=env, timeout=120
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 8" in second.stdout
    assert "committed steps [4, 8, 12]" in second.stdout


def test_load_agreement_without_a_group_raises_cleanly(tmp_path: Path) -> None:
    ck = Checkpointer([LocalTier(tmp_path)], rank=1, world_size=2)
    with pytest.raises(CheckpointNotFound):
        ck.load()
    ck.close()


def test_save_refuses_a_bad_attempt_id(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("TIERCKPT_ATTEMPT_ID", "has/slash")
    ck = Checkpointer([LocalTier(tmp_path)], rank=0, world_size=2)
    with pytest.raises(ValueError, match="TIERCKPT_ATTEMPT_ID"):
        ck.save({"x": torch.zeros(3)}, 1)
    ck.close()
