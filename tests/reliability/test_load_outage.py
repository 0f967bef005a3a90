"""A restart during an S3 outage loads from the local disk without waiting out S3's timeouts.

``load()`` of the newest checkpoint lists every tier. The tiers were listed one after another,
each with its store's timeouts and retries: while S3 held every request, a restarted job whose
local disk held the checkpoint waited about a minute per rank before its load began (DCP's
``TierReader``: two minutes, as it also read S3's manifest of the step). Now the tiers are
listed at once; a tier that has not answered after ``TIERCKPT_LEASE_WAIT_S`` is left out
(logged) where another tier listed a checkpoint, and waited for to the end where none did: it
is then the only place a checkpoint may be (a new node restoring from S3).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import BLACKHOLE, WAIT_S, Recorder, held_s3, ranks_through_an_outage

from tierckpt import Checkpointer, LocalTier, TiersUnreadable
from tierckpt.testing.faultproxy import Fault, FaultProxy

#: slack for a loaded 2-core machine (a held listing costs 2 x 10 s here)
SLACK_S = 8.0


def _w(step: int) -> torch.Tensor:
    return torch.randn(128, 64, generator=torch.Generator().manual_seed(step))


def _load(kind: str, tiers: list[Any]) -> tuple[int, torch.Tensor]:
    """The newest checkpoint of ``tiers``, loaded by a fresh reader: (step, weights)."""
    if kind == "native":
        with Checkpointer(tiers) as ck:
            got = ck.load()
            return int(got["step"]), got["w"]
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader

    reader = TierReader(tiers)
    got = {"w": torch.empty(128, 64)}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert reader.loaded_step is not None
    return reader.loaded_step, got["w"]


def _save(kind: str, tiers: list[Any], steps: list[int]) -> None:
    if kind == "native":
        with Checkpointer(tiers) as ck:
            for s in steps:
                ck.save({"w": _w(s), "step": s}, s).wait(timeout=60)
        return
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    with TierWriter(tiers) as w:
        for s in steps:
            w.reset(str(s))
            dcp.save({"w": _w(s)}, storage_writer=w, no_dist=True)


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["native", "dcp"])
def test_a_restart_during_an_s3_outage_loads_the_local_checkpoint_after_the_wait(
    kind: str,
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    caplog: pytest.LogCaptureFixture,
    record: Recorder,
) -> None:
    bucket = waited_bucket
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        tiers = [LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url)]
        _save(kind, tiers, [1, 2])
        proxy.set_faults(BLACKHOLE)  # the outage begins; the job restarts
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tierckpt"):
            step, w = _load(kind, tiers)
        took = time.monotonic() - t0
        assert step == 2
        assert torch.equal(w, _w(2))
        assert took <= WAIT_S + SLACK_S, took
        assert "tier s3 left out of this load" in caplog.text, caplog.text
        proxy.set_faults([])
    record(
        "outages",
        f"{'Checkpointer.load()' if kind == 'native' else 'DCP TierReader'}: a restart while "
        "S3 holds every request; the local disk holds step 2 (a held listing: 2 x 10 s)",
        f"loaded step 2 from the local disk after {took:.1f} s (the wait is {WAIT_S:.0f} s), "
        "bit-exact; S3 left out with a warning",
        took_s=round(took, 2),
    )


@pytest.mark.s3
def test_a_load_waits_for_a_slow_tier_that_is_the_only_one_with_a_checkpoint(
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    record: Recorder,
) -> None:
    """A new node: the local disk is empty, S3's listing takes longer than the wait."""
    bucket = waited_bucket
    _save("native", [held_s3(bucket, moto_server.endpoint_url)], [7])
    delay = 3 * WAIT_S
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(
            [Fault("delay", method="GET", path_contains="list-type", times=1, seconds=delay)]
        )
        t0 = time.monotonic()
        step, w = _load(
            "native", [LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url)]
        )
        took = time.monotonic() - t0
    assert step == 7 and torch.equal(w, _w(7))
    assert took >= delay, took
    record(
        "outages",
        f"a new node (empty local disk) whose S3 listing takes {delay:.0f} s, longer than the "
        f"{WAIT_S:.0f} s wait",
        f"the load waited for S3 ({took:.1f} s) and loaded step 7 from it, bit-exact",
        took_s=round(took, 2),
    )


@pytest.mark.s3
@pytest.mark.distributed
def test_two_ranks_restarted_during_an_s3_outage_load_their_local_checkpoint(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    """2 ranks (gloo), a private local folder each and S3 behind the fault proxy: steps 1 and
    2 committed on both; then S3 holds every request and each rank's new ``Checkpointer``
    loads step 2 from its local folder after the wait (the ranks agree on it)."""
    bucket = str(s3_bucket(moto_server))
    res = ranks_through_an_outage(
        "w_load_during_s3_outage",
        tmp_path,
        moto_server.endpoint_url,
        bucket,
        env={"TIERCKPT_PRIVATE_TIERS": "nvme"},
    )
    for rank, r in enumerate(res):
        assert r["diff"] == [], (rank, r)
        assert r["took"] <= WAIT_S + SLACK_S, (rank, r)
    took = [round(r["took"], 1) for r in res]
    record(
        "outages",
        "2 ranks (gloo) restarted while S3 holds every request; each rank's private local "
        "folder holds step 2 (a held listing: 2 x 10 s)",
        f"each rank loaded step 2 from its local folder after {took} s, bit-exact",
        took_s=took,
    )


#: the listing wait of the test below: long enough that a call that waits stands out
LISTING_WAIT_S = 3.0


@pytest.mark.s3
def test_listing_the_steps_during_an_s3_outage_answers_after_the_wait(
    tmp_path: Path,
    moto_server: Any,
    waited_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    record: Recorder,
) -> None:
    """``steps()``, ``checkpoints()``, ``latest_step()`` and ``tier_steps()`` list the tiers
    as ``load()`` does: a tier silent after the wait is left out (logged) where another
    answered, instead of each call waiting out S3's timeouts (2 x 10 s here, a minute with
    S3's defaults; ``tier_steps()`` then raised S3's error). While the first call's listing of
    S3 is still blocked, the next calls do not wait for S3 again (nor say so again)."""
    monkeypatch.setenv("TIERCKPT_LEASE_WAIT_S", str(LISTING_WAIT_S))
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        tiers = [LocalTier(tmp_path / "nvme"), held_s3(waited_bucket, proxy.endpoint_url)]
        _save("native", tiers, [1, 2])
        proxy.set_faults(BLACKHOLE)
        took: dict[str, float] = {}
        with Checkpointer(tiers) as ck, caplog.at_level(logging.WARNING, logger="tierckpt"):
            for name, call, want in [
                ("steps", ck.steps, [1, 2]),
                ("checkpoints", lambda: [c.step for c in ck.checkpoints()], [1, 2]),
                ("latest_step", ck.latest_step, 2),
                ("tier_steps", ck.tier_steps, {"local": [1, 2]}),
            ]:
                t0 = time.monotonic()
                assert call() == want, name
                took[name] = time.monotonic() - t0
            assert ck.steps("local") == [1, 2]  # a named tier is asked alone
        assert LISTING_WAIT_S - 0.5 <= took["steps"] <= LISTING_WAIT_S + SLACK_S, took
        # S3's first listing is still held (2 x 10 s): the later calls do not wait again
        assert (
            max(took[n] for n in ("checkpoints", "latest_step", "tier_steps"))
            < LISTING_WAIT_S - 0.5
        ), took
        assert caplog.text.count("tier s3 left out of this listing") == 1, caplog.text
        proxy.set_faults([])
        with Checkpointer(tiers) as ck:  # S3 answers again: listed with the others
            assert ck.tier_steps() == {"local": [1, 2], "s3": [1, 2]}
    record(
        "outages",
        "steps(), checkpoints(), latest_step(), tier_steps() while S3 holds every request "
        f"(a held listing: 2 x 10 s; the listing wait {LISTING_WAIT_S:.0f} s)",
        f"the first answered from the local tier after {took['steps']:.1f} s, S3 left out with "
        "a warning; the next three, while S3's listing was still held, in "
        f"{max(took['checkpoints'], took['latest_step'], took['tier_steps']):.2f} s at most; "
        "listed again once S3 answered",
        took_s=round(took["steps"], 2),
    )


@pytest.mark.s3
def test_a_new_node_whose_only_store_is_silent_waits_for_one_listing_not_two(
    tmp_path: Path, moto_server: Any, waited_bucket: str
) -> None:
    """An empty local disk and an S3 that holds every request: the load fails after its
    listing's timeouts (``TiersUnreadable``). Before, it then looked around the tier's prefix
    for the "is the location right?" hint, listing the bucket's root in the same silent
    store: a second wait as long (a minute, with S3's defaults: two in all)."""
    bucket = waited_bucket
    _save("native", [held_s3(bucket, moto_server.endpoint_url)], [3])
    with FaultProxy(moto_server.endpoint_url, timeout=30) as proxy:
        proxy.set_faults(BLACKHOLE)
        proxy.requests.clear()
        with pytest.raises(TiersUnreadable):
            _load(
                "native",
                [LocalTier(tmp_path / "nvme"), held_s3(bucket, proxy.endpoint_url, read_timeout=2)],
            )
        listed = [r.target for r in proxy.requests if "list-type" in r.target]
    assert listed, "the load listed nothing"
    # every LIST asked for the tier's own prefix: none went around it (the bucket's root)
    assert all("prefix=run%2F" in t or "prefix=run/" in t for t in listed), listed
