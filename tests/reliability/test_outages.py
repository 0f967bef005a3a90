"""Outages of a tier: checkpointing goes on, training is held for a bounded time, and everything
recovers by itself.

A blackholed S3 (the fault proxy accepts every connection and never answers) behind the local
disk (``source="local"``): the follower holds at most ``max_behind`` local steps, older copies
are skipped and counted, local retention keeps the disk bounded, S3 commits again once the
blackhole ends, and a fresh process restores and saves. The same S3 fed from the host arena
with a state larger than the arena: each save holds training at most about ``save_deadline``,
the local tier commits every step, S3's copies fail with ``SaveDeadlineExceeded`` and later
recover. A tier whose writes hang (a gate): its given-up copy never commits the bytes its
blocked thread writes late from a reused arena slot, and ``wait()`` does not hang on it. A
local disk left full of old steps (by a follower that once held them all): the first save
fails with ENOSPC, runs retention anyway, and the next one commits on both tiers, in a fresh
process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from rel_util import Recorder, local_leftovers, state_hash

import tierckpt
from tierckpt import (
    Checkpointer,
    CheckpointFailed,
    CopySkipped,
    LocalTier,
    S3Tier,
    SaveDeadlineExceeded,
    TierSpec,
)
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.errors import BackendError
from tierckpt.testing.faultproxy import Fault, FaultProxy

HERE = Path(__file__).resolve().parent
#: what a blackhole does: accept, read the request, never answer
BLACKHOLE = [Fault("stall", seconds=600)]
#: generous slack over the deadline for a loaded 2-core machine (capture of 16 MiB, threads)
SLACK_S = 8.0


def _state(step: int, n: int = 1 << 20) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step}


def _committed_on(h: Any, tier: str) -> bool:
    try:
        h.wait(tier, timeout=120)
    except CheckpointFailed:
        return False
    return True


def _run_child(code: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter importing the tierckpt this test imports; its
    last stdout line is JSON."""
    lib = Path(tierckpt.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib), str(HERE), str(HERE.parent)])}
    r = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=HERE,
    )
    assert r.returncode == 0, f"child failed ({r.returncode}):\n{r.stdout}\n{r.stderr[-4000:]}"
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


# -- (a) a follower behind a blackholed S3 --------------------------------------------------

_RESTORE_AND_SAVE = """
import json, sys
from rel_util import state_hash
from tierckpt import Checkpointer, LocalTier, S3Tier
bucket, endpoint, nvme, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=endpoint)
with Checkpointer([s3]) as ck:
    got = ck.load()
    out = {"s3_steps": ck.steps(), "hash": state_hash(got)}
tiers = [LocalTier(nvme, keep_last=2), S3Tier(f"s3://{bucket}/run", endpoint_url=endpoint,
                                               source="local")]
with Checkpointer(tiers) as ck:
    got["step"] = step
    ck.save(got, step).wait(timeout=120)
    out["saved_both"] = ck.tier_steps()
print(json.dumps(out))
"""


@pytest.mark.s3
def test_follower_behind_a_blackholed_s3_keeps_local_bounded_and_recovers(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    keep_last, max_behind = 2, 2
    nvme = tmp_path / "nvme"
    saved: dict[int, dict[str, Any]] = {}
    most_local = 0
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            source="local",
            codec="raw",
            connect_timeout=1,
            read_timeout=2,
            max_attempts=2,
        )
        with Checkpointer(
            [LocalTier(nvme, keep_last=keep_last), s3], chunk_bytes=1 << 20, repopulate=False
        ) as ck:
            saved[1] = _state(1)
            ck.save(saved[1], 1).wait(timeout=120)
            proxy.set_faults(BLACKHOLE)
            handles = []
            for step in range(2, 22):
                saved[step] = _state(step)
                h = ck.save(saved[step], step)
                h.wait("local", timeout=120)  # the local tier commits every step
                handles.append(h)
                local = ck.steps("local")
                # step folders, format v1 or v2 (<hh>/steps/<step>)
                folders = [p for p in nvme.glob("*/steps/*") if p.is_dir()]
                folders += [p for p in nvme.glob("steps/*") if p.is_dir()]
                most_local = max(most_local, len(local), len(folders))
                assert len(local) <= keep_last + max_behind, (step, local)
                assert len(folders) <= keep_last + max_behind, (step, folders)
            # every S3 copy of the outage ends: skipped at once, or failed after its timeouts
            for h in handles:
                assert not _committed_on(h, "s3")
            skipped = [h.step for h in handles if isinstance(h.errors["s3"], CopySkipped)]
            counts = ck.tier_counts()["s3"]
            assert counts["skipped"] == len(skipped) >= len(handles) // 2, (counts, skipped)
            msg = str(handles[len(handles) // 2].errors["s3"])
            assert "max_behind=2" in msg and "'s3'" in msg and "'local'" in msg, msg
            assert counts["committed"] == 1 and counts["skipped"] + counts["failed"] == 20
            # the blackhole ends: the same process commits on S3 again, by itself
            proxy.set_faults([])
            recovered = None
            for step in range(22, 30):
                saved[step] = _state(step)
                if _committed_on(ck.save(saved[step], step), "s3"):
                    recovered = step
                    break
            assert recovered is not None, ck.tier_counts()
            assert len(ck.steps("local")) <= keep_last + max_behind
            s3_steps = ck.steps("s3")
    assert s3_steps == [1, recovered]
    assert local_leftovers(nvme)["tmp_files"] == []
    # a fresh process restores the newest step from S3 and saves on both tiers
    out = _run_child(
        _RESTORE_AND_SAVE, bucket, moto_server.endpoint_url, str(nvme), str(recovered + 1)
    )
    assert out["hash"] == state_hash(saved[recovered])
    assert out["saved_both"]["s3"][-1] == out["saved_both"]["local"][-1] == recovered + 1
    record(
        "outages",
        "S3 blackholed behind local (source='local'), keep_last=2, 20 saves",
        f"local held at most {most_local} steps (bound {keep_last + max_behind}); "
        f"{len(skipped)} S3 copies skipped (CopySkipped, counted), the others failed on their "
        f"timeouts; S3 committed step {recovered} in the same process after the blackhole; a "
        "fresh process restored it bit-exact and saved on both tiers",
    )


# -- (b) a blackholed S3 fed from the arena, state larger than the arena ---------------------


@pytest.mark.s3
def test_a_blackholed_s3_does_not_hold_the_local_commits_of_a_small_state(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A small state (an arena of two slots, sized to it) and S3 fed from the arena, which
    stops answering: before, S3's pending copies held both slots, capture waited for them and
    the local disk committed nothing more until ``save_deadline`` (30 s): a kill in that
    window lost every step saved since, though save() had returned for each. Now the arena
    grows past a tier that made no progress for two seconds (within ``host_buffer_bytes``),
    and every step commits locally long before the deadline."""
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, codec="raw")
        ck = Checkpointer(
            [LocalTier(tmp_path / "nvme", keep_last=None), s3],
            save_deadline=120,  # far past every wait below: only growth lets local go on
            repopulate=False,
        )
        try:
            for step in (1, 2):
                ck.save(_state(step), step).wait(timeout=60)
            proxy.set_faults(BLACKHOLE)
            handles = [ck.save(_state(step), step) for step in range(3, 11)]
            for h in handles:
                h.wait("local", timeout=60)  # before: not until the deadline, 120 s
            # the local listing does not wait for S3's retention pass, blocked in the store
            # (before: about a minute); bounded as a listing of a silent store is
            listed: list[list[int]] = []
            th = threading.Thread(target=lambda: listed.append(ck.steps("local")), daemon=True)
            th.start()
            th.join(30)
            assert listed == [list(range(1, 11))]
            arena = ck._pipeline.arena  # type: ignore[union-attr]
            assert arena is not None and arena.n_slots > 2
            assert arena.nbytes <= ck.host_buffer_bytes
            assert [r for r in caplog.records if "the arena grows past" in r.getMessage()]
            with Checkpointer([LocalTier(tmp_path / "nvme")], repopulate=False) as fresh:
                for step in (3, 10):
                    assert state_hash(fresh.load(step=step)) == state_hash(_state(step))
            assert not any(local_leftovers(tmp_path / "nvme").values())
        finally:
            proxy.set_faults([])
            ck.close(timeout=5)


@pytest.mark.s3
def test_the_arena_grows_only_past_what_a_stalled_tier_holds_and_shrinks_after(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 (every 10th step) stops answering while saves come faster than a slow local disk
    commits them. Before, once S3 had stalled for two seconds every capture that found no
    free slot grew the arena, though S3 held two slots and the rest were the local disk's
    backlog: a soak test's arena went from 2 slots to 492 (1.5 GB of RSS), never shrank, and
    the disk stayed ~100 saves behind after S3 came back. Now the arena grows by at most the
    slots stalled tiers hold, and gives the grown slots back once nothing is stalled."""
    real_commit = LocalBackend.open_writer

    def slow_writer(self: LocalBackend, name: str) -> Any:
        w = real_commit(self, name)
        commit = w.commit

        def slow_commit() -> None:
            time.sleep(0.02)  # a disk slower than the training loop's saves
            commit()

        w.commit = slow_commit  # type: ignore[method-assign]
        return w

    monkeypatch.setattr(LocalBackend, "open_writer", slow_writer)
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            codec="raw",
            every=10,
            read_timeout=2,
            connect_timeout=1,
            max_attempts=2,
        )
        ck = Checkpointer(
            [LocalTier(tmp_path / "nvme", keep_last=3), s3], save_deadline=60, repopulate=False
        )
        try:
            ck.save(_state(1, 1 << 12), 1).wait(timeout=60)
            arena = ck._pipeline.arena  # type: ignore[union-attr]
            assert arena is not None
            base = arena.live_slots
            proxy.set_faults(BLACKHOLE)
            most = 0
            for step in range(2, 302):
                ck.save(_state(step, 1 << 12), step)
                most = max(most, arena.extra_slots)
            # S3's 30 copies of the stall hold a slot each: the arena grows past those, not
            # past the local disk's backlog (before: by every slot capture found taken)
            assert most <= 30 + 2, most
            proxy.set_faults([])
            ck.wait(timeout=120)
            for step in range(302, 312):  # nothing stalled now: the grown slots go back
                ck.save(_state(step, 1 << 12), step).wait("local", timeout=60)
            assert arena.extra_slots == 0 and arena.live_slots == base
        finally:
            proxy.set_faults([])
            ck.close(timeout=5)


@pytest.mark.s3
def test_a_blackholed_s3_holds_training_at_most_the_deadline(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    deadline = 2.0
    saved: dict[int, dict[str, Any]] = {}
    outcome: dict[int, str] = {}
    blocked: dict[int, float] = {}
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            codec="raw",
            connect_timeout=1,
            read_timeout=10,  # one call against the blackhole: 2 x 10 s, far past the deadline
            max_attempts=2,
        )
        # 16 MiB of state through a 4 MiB arena: every save needs S3 to take its chunks
        with Checkpointer(
            [LocalTier(tmp_path / "nvme", keep_last=2), s3],
            chunk_bytes=1 << 20,
            host_buffer_bytes=4 << 20,
            save_deadline=deadline,
            repopulate=False,
        ) as ck:

            def save(step: int) -> Any:
                saved[step] = _state(step, n=4 << 20)
                h = ck.save(saved[step], step)
                ck.wait_captured()  # what ck.guard(optimizer) does before optimizer.step()
                blocked[step] = h.blocked_seconds
                h.wait("local", timeout=120)
                return h

            h = save(1)
            h.wait(timeout=120)
            outcome[1] = "committed"
            proxy.set_faults(BLACKHOLE)
            for step in range(2, 6):
                h = save(step)
                assert blocked[step] <= deadline + SLACK_S, blocked
                with pytest.raises(CheckpointFailed) as ei:
                    h.wait("s3", timeout=120)
                err = ei.value.errors["s3"]
                assert isinstance(err, (SaveDeadlineExceeded, BackendError)), repr(err)
                outcome[step] = type(err).__name__
                time.sleep(0.5)
            late = [s for s, o in outcome.items() if o == "SaveDeadlineExceeded"]
            assert late, outcome
            proxy.set_faults([])
            recovered = None
            t0 = time.monotonic()
            step = 6
            while recovered is None and time.monotonic() - t0 < 120:
                h = save(step)
                assert blocked[step] <= deadline + SLACK_S, blocked
                if _committed_on(h, "s3"):
                    recovered = step
                    outcome[step] = "committed"
                else:
                    outcome[step] = type(h.errors["s3"]).__name__
                    time.sleep(1.0)
                step += 1
            assert recovered is not None, outcome
            counts = ck.tier_counts()
            assert counts["local"]["committed"] == len(outcome)  # every step, outage or not
            assert counts["s3"]["deadline"] >= len(late)
            assert counts["s3"]["committed"] == 2
            s3_steps = ck.steps("s3")
    # a given-up copy never committed, even though its thread later woke up with an arena
    # slot refilled by the next save; what did commit restores bit-exact
    assert s3_steps == [1, recovered], (s3_steps, outcome)
    with Checkpointer([S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)]) as c:
        for s in s3_steps:
            assert_same(saved[s], c.load(step=s))
    worst = max(blocked[s] for s in outcome if s > 1)
    print("blocked per save (s):", {s: round(b, 2) for s, b in blocked.items()})
    record(
        "outages",
        "S3 blackholed, fed from a 4 MiB arena, 16 MiB state, save_deadline=2 s",
        f"training blocked at most {worst:.2f} s per save; local committed all {len(outcome)} "
        f"steps; S3 copies of steps {late} given up (SaveDeadlineExceeded); S3 committed step "
        f"{recovered} after the blackhole, restored bit-exact",
        blocked_seconds={s: round(b, 2) for s, b in blocked.items()},
    )


class _Gate:
    """Makes every write of a backend's writers wait until ``gate`` opens (a hung disk)."""

    def __init__(self, backend: LocalBackend) -> None:
        real = backend.open_writer
        self.gate = threading.Event()
        self.blocked = threading.Event()

        def open_writer(name: str) -> Any:
            w = real(name)
            write = w.write

            def gated(offset: int, data: Any) -> None:
                if not self.gate.is_set():
                    self.blocked.set()
                    assert self.gate.wait(120), "the test never opened the gate"
                write(offset, data)

            w.write = gated  # type: ignore[method-assign]
            return w

        backend.open_writer = open_writer  # type: ignore[method-assign]


def test_a_given_up_copy_never_commits_the_bytes_its_blocked_thread_writes_late(
    tmp_path: Path, record: Recorder
) -> None:
    """A tier hangs inside a write holding a view of an arena slot; past the deadline its
    copy is given up and the slot reused by the next save. When the write returns, the copy
    aborts: the tier commits only a later save, bit-exact, and leaves no temporary file."""
    tiers = [LocalTier(tmp_path / "fast", name="fast"), LocalTier(tmp_path / "slow", name="slow")]
    with Checkpointer(
        tiers, chunk_bytes=1 << 20, host_buffer_bytes=2 << 20, save_deadline=1.0
    ) as ck:
        gate = _Gate(ck.backend("slow"))
        # 8 MiB in 16 chunks of 512 KiB through 4 arena slots
        states = {s: _state(s, n=2 << 20) for s in (1, 2, 3)}
        h1 = ck.save(states[1], 1)
        ck.wait_captured(timeout=30)  # the original code waits here until the gate opens
        assert gate.blocked.is_set() and h1.done("slow")
        assert isinstance(h1.errors["slow"], SaveDeadlineExceeded)
        assert "save_deadline=1 s" in str(h1.errors["slow"]), h1.errors["slow"]
        h1.wait("fast", timeout=60)
        h2 = ck.save(states[2], 2)  # reuses the slots the blocked write still reads
        ck.wait_captured(timeout=30)
        assert isinstance(h2.errors["slow"], SaveDeadlineExceeded)
        h2.wait("fast", timeout=60)
        gate.gate.set()
        ck.save(states[3], 3).wait(timeout=60)
        assert ck.steps("slow") == [3]
        assert ck.tier_counts()["slow"] == {
            "committed": 1,
            "failed": 0,
            "skipped": 0,
            "deadline": 2,
        }
        assert_same(states[3], ck.load(step=3, tier="slow"))
        assert_same(states[2], ck.load(step=2, tier="fast"))
    assert local_leftovers(tmp_path / "slow")["tmp_files"] == []
    record(
        "outages",
        "a tier hung inside a write (gate) while its arena slot was reused",
        "its copies of steps 1 and 2 given up at the deadline and never committed; step 3 "
        "committed there bit-exact once the write returned; no temporary file left",
    )


def test_wait_gives_up_a_stalled_tier_instead_of_hanging(tmp_path: Path) -> None:
    """The state fits the arena, so capture never waits; ``wait()`` does not hang on the
    hung tier's copy either: past the deadline it is given up."""
    tiers = [LocalTier(tmp_path / "fast", name="fast"), LocalTier(tmp_path / "slow", name="slow")]
    with Checkpointer(tiers, chunk_bytes=1 << 20, save_deadline=1.0) as ck:
        gate = _Gate(ck.backend("slow"))
        h = ck.save(_state(1), 1)
        ck.wait_captured(timeout=30)
        t0 = time.monotonic()
        try:
            ck.wait(timeout=1.0 + SLACK_S)  # the original code times out here
        finally:
            gate.gate.set()
        assert time.monotonic() - t0 <= 1.0 + SLACK_S
        assert h.committed("fast")
        err = h.errors["slow"]
        assert isinstance(err, SaveDeadlineExceeded) and "close()/wait()" in str(err), err
        assert ck.tier_steps() == {"fast": [1], "slow": []}


def test_save_deadline_knob_and_s3_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The documented defaults: 30 s, ``TIERCKPT_SAVE_DEADLINE`` overrides, ``inf`` turns it
    off; S3's defaults give up a silent call after at most 4 x 15 s."""
    tiers = [LocalTier(tmp_path / "a")]
    with Checkpointer(tiers) as ck:
        assert ck.save_deadline == 30.0
    monkeypatch.setenv("TIERCKPT_SAVE_DEADLINE", "2.5")
    with Checkpointer(tiers) as ck:
        assert ck.save_deadline == 2.5
    monkeypatch.setenv("TIERCKPT_SAVE_DEADLINE", "inf")
    with Checkpointer(tiers) as ck:
        ck.save(_state(1), 1).wait(timeout=60)  # no deadline: saves still work
        assert ck.save_deadline == float("inf")
    for bad in ("0", "-1"):
        monkeypatch.setenv("TIERCKPT_SAVE_DEADLINE", bad)
        with pytest.raises(ValueError, match="TIERCKPT_SAVE_DEADLINE"):
            Checkpointer(tiers)
    with pytest.raises(ValueError, match="save_deadline"):
        Checkpointer(tiers, save_deadline=0)
    with pytest.raises(ValueError, match="max_behind"):
        S3Tier("s3://b/p", source="local", max_behind=0)
    assert TierSpec("x").max_behind == 2
    b = S3Backend("s3://bucket/p", endpoint_url="http://127.0.0.1:9")
    try:
        cfg = b._client.meta.config
        attempts = cfg.retries["total_max_attempts"]
        assert attempts * cfg.read_timeout <= 60 and attempts * cfg.connect_timeout <= 20
    finally:
        b.close()


# -- (c) a local disk left full of old steps frees itself -----------------------------------

_QUOTA = """
import errno, json, os, sys
from pathlib import Path
import torch
from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend

root, capacity, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Quota(LocalBackend):
    # a disk of `capacity` bytes (0: the real filesystem's own limit)
    def _charge(self, n):
        used = sum(p.stat().st_size for p in Path(self.root).rglob("*") if p.is_file())
        if capacity and used + n > capacity:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    def open_writer(self, name):
        w = super().open_writer(name)
        real = w.write
        def write(offset, data):
            self._charge(len(memoryview(data).cast("B")))
            real(offset, data)
        w.write = write
        return w
    def put_atomic(self, name, data, *, overwrite=False):
        self._charge(len(memoryview(data).cast("B")))
        super().put_atomic(name, data, overwrite=overwrite)

class QuotaTier(LocalTier):
    def make_backend(self):
        return Quota(self.path)

def state(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300_000, generator=g), "step": step}

out = {"outcomes": {}}
if mode == "fill":  # what a follower that held every local step once left behind
    with Checkpointer([QuotaTier(root, keep_last=None)], chunk_bytes=256 << 10) as ck:
        for step in range(1, 200):
            try:
                ck.save(state(step), step).wait(timeout=120)
            except CheckpointFailed as exc:
                out["outcomes"][step] = str(exc.errors["local"])
                break
        out["local"] = ck.steps("local")
else:
    bucket, endpoint = sys.argv[4], sys.argv[5]
    tiers = [QuotaTier(root, keep_last=2),
             S3Tier(f"s3://{bucket}/run", endpoint_url=endpoint, source="local")]
    with Checkpointer(tiers, chunk_bytes=256 << 10) as ck:
        for step in range(1000, 1004):
            h = ck.save(state(step), step)
            try:
                h.wait(timeout=120)
                out["outcomes"][step] = "committed"
            except CheckpointFailed as exc:
                out["outcomes"][step] = {t: str(e)[:200] for t, e in exc.errors.items()}
        out["local"] = ck.steps("local")
        out["s3"] = ck.steps("s3")
print(json.dumps(out))
"""


@pytest.fixture(params=["quota", "tmpfs"])
def small_disk(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A 6 MiB disk: a byte quota in the backend, or a real tmpfs where mounting is allowed."""
    if request.param == "quota":
        yield tmp_path / "quota", 6 << 20
        return
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the quota case covers it")
    try:
        yield mnt, 0
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.s3
def test_a_full_local_disk_frees_itself_in_a_fresh_process(
    small_disk: tuple[Path, int], moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    root, capacity = small_disk
    bucket = s3_bucket(moto_server)
    filled = _run_child(_QUOTA, str(root), str(capacity), "fill")
    assert filled["outcomes"], "the disk never filled up"
    assert len(filled["local"]) > 2, filled
    # a fresh process, keep_last=2, S3 copying from the local disk: the first save fails
    # with the disk full (on both tiers: S3 copies the local file) and still runs retention
    out = _run_child(_QUOTA, str(root), str(capacity), "recover", bucket, moto_server.endpoint_url)
    outcomes = {int(k): v for k, v in out["outcomes"].items()}
    assert outcomes[1000] != "committed", outcomes  # the disk was full
    first_ok = min((s for s, o in outcomes.items() if o == "committed"), default=None)
    assert first_ok == 1001, outcomes
    assert all(o == "committed" for s, o in outcomes.items() if s >= first_ok), outcomes
    assert out["local"] == [1002, 1003] and out["s3"] == list(range(first_ok, 1004)), out
    assert local_leftovers(root)["tmp_files"] == []
    record(
        "outages",
        f"local disk left full of {len(filled['local'])} old steps ({'quota' if capacity else 'tmpfs'}), "
        "fresh process with keep_last=2 and S3 copying from local",
        f"save outcomes {outcomes}: retention ran after the failed save, every later save "
        "committed on both tiers",
    )
