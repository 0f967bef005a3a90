"""An S3 outage behind the local disk must not cost a ``tierckpt.dcp`` save its local copy.

``dcp.save`` through a ``TierWriter`` of a local folder and S3 is synchronous: it returns once
the shards are written and each tier's manifest is committed. While S3 holds every request
(an outage that hangs instead of failing), before this was fixed, every such save checked S3
for an existing copy of its step at DCP's global plan, waited out that request's timeouts and
retries (60 s with S3's defaults), and then raised ``CheckpointException``: nothing of the
save was committed, not even on the local disk that worked all along (training that catches
the error goes on with no new checkpoint; training that does not, stops).

Now the check waits for each tier at most ``TIERCKPT_LEASE_WAIT_S`` (a tier that does not tell
is checked again before its own commit, and its copy's start refuses a committed step), and
``dcp.save`` gives up a tier's copy that makes no progress for the writer's ``save_deadline``
(a tier presumed down gets a short grace), as ``Checkpointer.wait()`` does: the local copy
commits, the save returns, and once S3 answers a later save commits there again.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import BLACKHOLE, WAIT_S, Recorder, committed, held_s3, ranks_through_an_outage

from tierckpt import LocalTier
from tierckpt.testing.faultproxy import Fault, FaultProxy

#: the writer's save_deadline: a stalled tier's copy is given up after this (or the grace)
DEADLINE_S = 3.0
#: slack for a loaded 2-core machine
SLACK_S = 8.0


def _w(step: int) -> torch.Tensor:
    return torch.randn(256, 64, generator=torch.Generator().manual_seed(step))


def _load(tier: Any, step: int | None = None) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader

    got = {"w": torch.empty(256, 64)}
    dcp.load(got, storage_reader=TierReader([tier], step), no_dist=True)
    return got["w"]


def _save_until_s3_takes_one(w: Any, s3: Any, first: int) -> int:
    """``dcp.save`` steps ``first``, ``first + 1``, ... through ``w`` (2 s apart) until one
    is committed on ``s3`` (the held requests of an outage end with their timeouts first);
    that step."""
    import torch.distributed.checkpoint as dcp

    step, end = first, time.monotonic() + 120
    while (step - 1, 0) not in committed(s3):
        assert time.monotonic() < end, "S3 never took a save again"
        if step > first:
            time.sleep(2)
        w.reset(str(step))
        dcp.save({"w": _w(step)}, storage_writer=w, no_dist=True)
        step += 1
    return step - 1


@pytest.mark.s3
def test_a_dcp_save_during_an_s3_outage_commits_locally_and_returns(
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    record: Recorder,
) -> None:
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    bucket = waited_bucket
    local = LocalTier(tmp_path / "nvme", keep_last=50)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        w = TierWriter([local, held_s3(bucket, proxy.endpoint_url)], 1)
        w.save_deadline = DEADLINE_S
        with w:
            dcp.save({"w": _w(1)}, storage_writer=w, no_dist=True)
            assert committed(held_s3(bucket, moto_server.endpoint_url)) == [(1, 0)]
            proxy.set_faults(BLACKHOLE)  # S3 now holds every request
            took: list[float] = []
            for step in (2, 3):
                w.reset(str(step))
                t0 = time.monotonic()
                dcp.save({"w": _w(step)}, storage_writer=w, no_dist=True)  # must not raise
                took.append(time.monotonic() - t0)
                assert took[-1] <= WAIT_S + DEADLINE_S + SLACK_S, took
                assert (step, 0) in committed(LocalTier(tmp_path / "nvme")), step
            proxy.set_faults([])  # S3 answers again
            # the held requests of the outage end with their timeouts; a save after that
            # commits on S3 again (the ones before it are given up at once)
            last = _save_until_s3_takes_one(w, held_s3(bucket, moto_server.endpoint_url), 4)
    on_s3 = committed(held_s3(bucket, moto_server.endpoint_url))
    assert (2, 0) not in on_s3 and (3, 0) not in on_s3, on_s3  # given up: never committed
    assert torch.equal(_load(held_s3(bucket, moto_server.endpoint_url)), _w(last))
    assert torch.equal(_load(LocalTier(tmp_path / "nvme"), 3), _w(3))
    record(
        "outages",
        "tierckpt.dcp: S3 holds every request (local + S3 writer, save_deadline "
        f"{DEADLINE_S:.0f} s) after a first save committed on both",
        f"dcp.save of steps 2 and 3 returned after {took[0]:.1f} and {took[1]:.1f} s, each "
        f"committed locally (loads bit-exact), never on S3; once S3 answered, step {last} "
        "committed there and DCP loads it from S3",
        took_s=[round(t, 2) for t in took],
    )


@pytest.mark.s3
@pytest.mark.distributed
def test_two_dcp_ranks_commit_locally_during_an_s3_outage(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    """2 ranks (gloo), a shared local folder and S3 behind the fault proxy: step 1 commits on
    both; then S3 holds every request: steps 2 and 3 commit on the local folder (each rank's
    S3 copy given up at the deadline), and each rank loads its step 3 back from it."""
    bucket = str(s3_bucket(moto_server))
    res = ranks_through_an_outage("w_dcp_s3_outage", tmp_path, moto_server.endpoint_url, bucket)
    for rank, r in enumerate(res):
        assert r["local"] == [[1, 0], [2, 0], [3, 0]], (rank, r)
        assert r["loaded_ok"], (rank, r)
        assert all(t <= WAIT_S + 2.0 + SLACK_S for t in r["took"][1:]), (rank, r["took"])
    assert committed(held_s3(bucket, moto_server.endpoint_url)) == [(1, 0)]
    took = [round(t, 1) for r in res for t in r["took"][1:]]
    record(
        "outages",
        "tierckpt.dcp, 2 ranks (gloo): S3 holds every request after step 1 committed on both "
        "(shared local folder + S3, save_deadline 2 s)",
        f"dcp.save of steps 2 and 3 returned after {took} s (rank 0, then rank 1), both "
        "committed on the local folder and loaded back by each rank; S3 keeps step 1",
        took_s=took,
    )


@pytest.mark.s3
def test_a_restarted_dcp_job_s_first_save_during_an_s3_outage_waits_the_lease_once(
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    record: Recorder,
) -> None:
    """A fresh ``TierWriter`` (a restarted job) while S3 holds every request: its first
    ``dcp.save`` waits the listing and the lease take ``TIERCKPT_LEASE_WAIT_S`` each, then
    gives S3's copy up (no waiting behind a lease take the store never answers: that was the
    take's timeouts, or the whole ``save_deadline``), commits locally and returns; once S3
    answers, a later save commits there."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    bucket = waited_bucket
    local = LocalTier(tmp_path / "nvme", keep_last=50)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(BLACKHOLE)
        w = TierWriter([local, held_s3(bucket, proxy.endpoint_url)], 1)
        w.save_deadline = 30.0  # the default: the lease take's 2 x 10 s fall inside it
        with w:
            t0 = time.monotonic()
            dcp.save({"w": _w(1)}, storage_writer=w, no_dist=True)
            took = time.monotonic() - t0
            assert took <= 2 * WAIT_S + SLACK_S, took
            assert committed(LocalTier(tmp_path / "nvme")) == [(1, 0)]
            proxy.set_faults([])
            deadline = time.monotonic() + 90  # the held requests end with their timeouts
            step = 1
            while (step, 0) not in committed(held_s3(bucket, moto_server.endpoint_url)):
                assert time.monotonic() < deadline, "S3 never committed again"
                step += 1
                w.reset(str(step))
                dcp.save({"w": _w(step)}, storage_writer=w, no_dist=True)
    assert torch.equal(_load(held_s3(bucket, moto_server.endpoint_url), step), _w(step))
    record(
        "outages",
        "a restarted job's first dcp.save through a fresh TierWriter while S3 holds every "
        "request (listing and lease waits of 1 s; the lease take's timeouts 2 x 10 s)",
        f"dcp.save returned after {took:.1f} s, committed locally, S3's copy given up; step "
        f"{step} committed on S3 once it answered and loads back",
        took_s=round(took, 2),
    )


@pytest.mark.s3
@pytest.mark.parametrize("stalled", ["manifests/", "dcp-metadata"])
def test_a_dcp_save_whose_s3_commit_stalls_returns_at_the_deadline(
    tmp_path: Path, moto_server: Any, waited_bucket: str, record: Recorder, stalled: str
) -> None:
    """The shards reach S3, then S3 holds the commit's write (DCP's metadata or the manifest):
    before, the coordinator committed its tiers one after another without a deadline, so
    ``dcp.save`` (and every rank waiting for it) was held for that request's timeouts and
    retries (60 s with S3's defaults). Now each tier commits on a thread of its own and the
    save waits for them at most ``save_deadline``: the local copy commits, the save returns,
    and a commit given up before its manifest never writes it."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    bucket = waited_bucket
    s3 = held_s3(bucket, moto_server.endpoint_url)
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        w = TierWriter(
            [LocalTier(tmp_path / "nvme", keep_last=50), held_s3(bucket, proxy.endpoint_url)], 1
        )
        w.save_deadline = DEADLINE_S
        with w:
            dcp.save({"w": _w(1)}, storage_writer=w, no_dist=True)
            assert committed(s3) == [(1, 0)]
            proxy.set_faults([Fault("stall", method="PUT", path_contains=stalled, seconds=600)])
            w.reset("2")
            t0 = time.monotonic()
            dcp.save({"w": _w(2)}, storage_writer=w, no_dist=True)  # must not raise
            took = time.monotonic() - t0
            assert took <= DEADLINE_S + SLACK_S, took
            assert (2, 0) in committed(LocalTier(tmp_path / "nvme"))
            assert (2, 0) not in committed(s3)
            assert proxy.fired["stall"] >= 1
            proxy.set_faults([])  # S3 answers again; the held request ends with its timeouts
            last = _save_until_s3_takes_one(w, s3, 3)
        # the given-up commit's thread is done once its held request timed out (2 x 10 s)
        for th in threading.enumerate():
            if th.name.startswith("tierckpt-dcp-commit"):
                th.join(60)
    on_s3 = committed(s3)
    if stalled == "dcp-metadata":  # given up before its manifest: never committed there
        assert (2, 0) not in on_s3, on_s3
    assert torch.equal(_load(s3, last), _w(last))
    assert torch.equal(_load(LocalTier(tmp_path / "nvme"), 2), _w(2))
    record(
        "outages",
        f"tierckpt.dcp: S3 holds the commit's PUT of {stalled!r} after the shards reached it "
        f"(local + S3 writer, save_deadline {DEADLINE_S:.0f} s)",
        f"dcp.save returned after {took:.1f} s with step 2 committed locally; S3 committed "
        f"step {last} once it answered, and it loads back",
        took_s=round(took, 2),
    )
