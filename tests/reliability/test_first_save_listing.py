"""The first save of a job chooses its timeline from the tiers' listings; a tier that does not
answer must neither hold training for its timeouts nor let the save land on it as the older
checkpoint.

A fresh ``Checkpointer`` (a restarted job) chooses the timeline of its first save from the
newest checkpoint committed on any tier. Each tier is listed on a thread of its own and waited
for at most ``TIERCKPT_LEASE_WAIT_S``; a tier that does not answer in time (or fails) is left
out of the choice and checked before each save is published on it, until one passes:

- S3 hangs (every request held) behind the local disk: ``save()`` returns after about the
  wait, not after the listing's timeouts and retries (20 s and more here; about a minute with
  the S3 defaults), and the local copy commits at once; once S3 answers, the next save
  commits there too and loads back.
- S3 holds a newer checkpoint than the one saved (another run went further; this job's local
  disk is empty, a new node) and its listing at the first save hangs or fails (HTTP 500 on
  each attempt; before, such a save went to S3 on the lower timeline and S3's retention
  deleted it right after its commit): that save's S3 copy
  is refused with ``StaleTimeline`` (published, it would be the older checkpoint there, and
  S3's retention would delete it at once), the local copy commits, and the next save chooses
  its timeline again, with S3 in view: it commits on both tiers and a load from S3 gives it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import torch
from helpers import assert_same
from rel_util import BLACKHOLE, WAIT_S, Recorder, committed, held_s3

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, StaleTimeline
from tierckpt.testing.faultproxy import Fault, FaultProxy

#: how the first listing of committed checkpoints (GET ?list-type=2&prefix=...) fails: held
#: (once: the attempt after it answers) or answered with errors (each attempt of one listing)
FIRST_LISTING = {
    "hung": [Fault("stall", method="GET", path_contains="list-type", times=1, seconds=600)],
    "failing": [Fault("error500", method="GET", path_contains="list-type", times=2)],
}
#: slack for a loaded 2-core machine
SLACK_S = 8.0


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 64, generator=g), "step": step}


@pytest.mark.s3
def test_a_hung_s3_holds_the_first_save_for_the_wait_not_its_timeouts(
    tmp_path: Path, moto_server: Any, waited_bucket: str, record: Recorder
) -> None:
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(BLACKHOLE)
        with Checkpointer(
            [LocalTier(tmp_path / "nvme", keep_last=2), held_s3(waited_bucket, proxy.endpoint_url)]
        ) as ck:
            t0 = time.monotonic()
            h1 = ck.save(_state(1), 1)
            returned = time.monotonic() - t0
            h1.wait("local", timeout=60)
            committed_local = time.monotonic() - t0
            # the listing wait and the lease wait, not 2 x 10 s of a listing's timeouts
            assert returned <= 2 * WAIT_S + SLACK_S, returned
            assert_same(ck.load(1, tier="local"), _state(1))
            proxy.set_faults([])
            h2 = ck.save(_state(2), 2)
            h2.wait(timeout=120)  # both tiers: S3 answers again
            with pytest.raises(CheckpointFailed):
                h1.wait("s3", timeout=120)  # its requests were held: that copy failed
            assert 2 in ck.steps("s3")
    with Checkpointer([held_s3(waited_bucket, moto_server.endpoint_url)]) as fresh:
        assert_same(fresh.load(), _state(2))
    record(
        "outages",
        "S3 hung (every request held) at a restarted job's first save, local + S3",
        f"save() returned after {returned:.1f} s (listing and lease waits of {WAIT_S:.0f} s; "
        f"a listing's timeouts are 2 x 10 s), the local copy committed at "
        f"{committed_local:.1f} s; once S3 answered the next save committed on both and a "
        "fresh process loaded it from S3",
        returned_s=round(returned, 2),
    )


#: the listing and lease wait of the test below: long enough that one wait and two differ
#: beyond a loaded machine's slack
LONG_WAIT_S = 6.0


@pytest.mark.s3
def test_a_hung_s3_costs_the_first_save_one_wait_not_the_listings_and_the_leases(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    monkeypatch: pytest.MonkeyPatch,
    record: Recorder,
) -> None:
    """The first save takes its leases while it lists the tiers: with S3 holding every
    request, ``save()`` returns after one ``TIERCKPT_LEASE_WAIT_S`` (two before: the
    listing's, then the lease's)."""
    monkeypatch.setenv("TIERCKPT_LEASE_WAIT_S", str(LONG_WAIT_S))
    bucket = str(s3_bucket(moto_server))
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(BLACKHOLE)
        with Checkpointer(
            [LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url)],
            save_deadline=2,
        ) as ck:
            t0 = time.monotonic()
            h1 = ck.save(_state(1), 1)
            returned = time.monotonic() - t0
            h1.wait("local", timeout=60)
            assert LONG_WAIT_S - 0.5 <= returned <= LONG_WAIT_S + 4.0, returned
            assert_same(ck.load(1, tier="local"), _state(1))
            proxy.set_faults([])
    record(
        "outages",
        f"S3 hung at a restarted job's first save (listing and lease waits of {LONG_WAIT_S:.0f} s)",
        f"save() returned after {returned:.1f} s: one wait, the leases taken while the tiers "
        f"were listed (two waits, {2 * LONG_WAIT_S:.0f} s, before); the local copy committed",
        returned_s=round(returned, 2),
    )


@pytest.mark.s3
@pytest.mark.parametrize("listing", sorted(FIRST_LISTING))
def test_a_save_whose_timeline_missed_a_newer_s3_checkpoint_is_not_published_there(
    listing: str, tmp_path: Path, moto_server: Any, waited_bucket: str, record: Recorder
) -> None:
    # another run (or this one, on another node) went as far as step 60 on S3
    with Checkpointer([held_s3(waited_bucket, moto_server.endpoint_url, keep_last=1)]) as other:
        other.save(_state(60), 60).wait(timeout=60)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(FIRST_LISTING[listing])  # the first save's listing of S3 fails
        with Checkpointer(
            [
                LocalTier(tmp_path / "nvme", keep_last=2),
                held_s3(waited_bucket, proxy.endpoint_url, keep_last=1),
            ]
        ) as ck:
            t0 = time.monotonic()
            h10 = ck.save(_state(10), 10)  # chosen without S3: timeline 0, below step 60
            returned = time.monotonic() - t0
            assert returned <= 2 * WAIT_S + SLACK_S, returned
            h10.wait("local", timeout=60)
            with pytest.raises(CheckpointFailed) as ei:
                h10.wait("s3", timeout=120)
            err = ei.value.errors["s3"]
            assert isinstance(err, StaleTimeline), repr(err)
            assert "step 60, timeline 0" in str(err), str(err)
            assert h10.timeline == 0
            # S3 kept the newer checkpoint; nothing of step 10 was published there
            assert ck.steps("s3") == [60]
            h11 = ck.save(_state(11), 11)  # chosen again, with S3 in view
            h11.wait(timeout=120)
            assert h11.timeline == 1
            assert_same(ck.load(11, tier="local"), _state(11))
            assert_same(ck.load(10, tier="local"), _state(10))
    with Checkpointer([held_s3(waited_bucket, moto_server.endpoint_url)]) as fresh:
        newest = fresh.checkpoints()[-1]
        assert (newest.step, newest.timeline) == (11, 1)
        assert_same(fresh.load(), _state(11))
    record(
        "timelines",
        "S3 holds step 60 of another run; a new node's first save (step 10, empty local disk) "
        f"could not list S3 ({listing}: "
        + ("held once" if listing == "hung" else "HTTP 500 on each attempt")
        + ")",
        "step 10's S3 copy refused (StaleTimeline: S3 holds step 60), its local copy "
        "committed; step 11 chose timeline 1 with S3 in view and committed on both; a fresh "
        "process loads step 11 from S3",
    )


@pytest.mark.distributed
def test_two_ranks_refuse_the_stale_copy_until_the_job_loads(
    tmp_path: Path, record: Recorder
) -> None:
    """Two ranks (gloo) whose first listing of the shared folder fails, while it holds step 60
    of an earlier run and their private folders are empty: both refuse steps 10 and 11 there
    (a multi-rank job chooses its timeline in a collective, at its next load), the private
    folders keep them; after load() (step 60) step 61 commits on both tiers."""
    env = {"TIERCKPT_PRIVATE_TIERS": "nvme"}
    dist_workers.run("w_stale_timeline", 2, root=str(tmp_path), phase="other", env=env)
    for rank in range(2):  # new nodes: their private folders are empty
        shutil.rmtree(tmp_path / f"nvme-{rank}")
    res = dist_workers.run(
        "w_stale_timeline", 2, root=str(tmp_path), phase="new", env=env, timeout=180
    )
    for rank, r in enumerate(res):
        assert sorted(r["errors"]) == ["10", "11"], (rank, r["errors"])
        assert all(e.startswith("StaleTimeline") for e in r["errors"].values()), r["errors"]
        assert "step 60, timeline 0" in r["errors"]["10"], r["errors"]
        assert r["timeline_10"] == r["timeline_11"] == 0
        assert r["shared_before_load"] == [[60, 0]], (rank, r)
        assert r["loaded_diff"] == [], (rank, r["loaded_diff"])
        assert r["timeline_61"] == 0
        assert r["shared"] == [[60, 0], [61, 0]], (rank, r["shared"])
        assert r["nvme"] == [[10, 0], [11, 0], [61, 0]], (rank, r["nvme"])
    record(
        "timelines",
        "2 ranks (gloo): the first listing of the shared folder fails while it holds a newer "
        "run's step 60; private folders empty",
        "steps 10 and 11 refused on the shared folder on both ranks (StaleTimeline), kept on "
        "the private ones; after load() (step 60) step 61 committed on both tiers",
    )


@pytest.mark.s3
@pytest.mark.parametrize("listing", sorted(FIRST_LISTING))
def test_a_dcp_save_whose_timeline_missed_a_newer_s3_checkpoint_is_not_committed_there(
    listing: str,
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    record: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``tierckpt.dcp`` chooses its timeline at the coordinator's global plan, from the same
    listings: a tier that does not tell is left out there and checked at the commit, where a
    newer checkpoint keeps this one from being committed on it; the next save chooses again."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter

    with Checkpointer([held_s3(waited_bucket, moto_server.endpoint_url, keep_last=1)]) as other:
        other.save(_state(60), 60).wait(timeout=60)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(FIRST_LISTING[listing])
        tiers = [
            LocalTier(tmp_path / "nvme", keep_last=2),
            held_s3(waited_bucket, proxy.endpoint_url, keep_last=1),
        ]
        with TierWriter(tiers, 10) as w:
            t0 = time.monotonic()
            with caplog.at_level("ERROR", logger="tierckpt"):
                dcp.save({"w": _state(10)["w"]}, storage_writer=w, no_dist=True)
            returned = time.monotonic() - t0
            assert returned <= 2 * WAIT_S + SLACK_S, returned
            stale = [r.getMessage() for r in caplog.records if "StaleTimeline" in r.getMessage()]
            assert stale and "step 60, timeline 0" in stale[0], caplog.text
            assert committed(held_s3(waited_bucket, moto_server.endpoint_url)) == [(60, 0)]
            assert (10, 0) in committed(LocalTier(tmp_path / "nvme"))
            w.reset("11")
            dcp.save({"w": _state(11)["w"]}, storage_writer=w, no_dist=True)
            assert committed(held_s3(waited_bucket, moto_server.endpoint_url))[-1] == (11, 1)
    got = {"w": torch.empty(256, 64)}
    dcp.load(
        got,
        storage_reader=TierReader([held_s3(waited_bucket, moto_server.endpoint_url)]),
        no_dist=True,
    )
    assert torch.equal(got["w"], _state(11)["w"])
    record(
        "timelines",
        "tierckpt.dcp: S3 holds step 60 of another run; a new node's first DCP save (step 10) "
        f"could not list S3 ({listing})",
        "step 10 not committed on S3 (StaleTimeline: S3 holds step 60), committed locally; "
        "step 11 chose timeline 1 and committed on both; DCP loads step 11 from S3",
    )
