"""A tier that cannot be listed is never taken for a tier without checkpoints.

A job restarting on a new node resumes with ``ck.load()`` (or ``if ck.steps()``) and starts
over on ``CheckpointNotFound``. Where the store that holds the checkpoints is down, or its URL
names a bucket that does not exist, and no other tier holds one, the answer is
``TiersUnreadable`` (a ``BackendError``, not a ``CheckpointNotFound``): the job stops and says
which tier and why instead of training from step 0 over hours of lost work."""

from __future__ import annotations

import pickle
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.errors import BackendError, CheckpointNotFound, TiersUnreadable
from tierckpt.testing.s3servers import S3Server

BucketFactory = Callable[[S3Server], str]


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return f"http://127.0.0.1:{port}"


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((1000,), float(step)), "step": step}


def _all_ways(ck: Checkpointer) -> list[BaseException]:
    """What each way of asking "is there a checkpoint?" raises."""
    raised = []
    for ask in (ck.load, ck.steps, ck.latest_step, ck.checkpoints, lambda: ck.load(step=3)):
        with pytest.raises(TiersUnreadable) as err:
            ask()
        raised.append(err.value)
    return raised


@pytest.mark.s3
def test_a_missing_bucket_or_a_dead_endpoint_is_not_no_checkpoint(
    moto_server: S3Server, tmp_path: Path
) -> None:
    """An S3 tier naming a bucket that does not exist, or an endpoint where nothing listens,
    beside an empty local tier (a new node): every listing and load raises
    ``TiersUnreadable`` naming the tier and the store's reason; it is not caught by
    ``except CheckpointNotFound`` / ``except FileNotFoundError``."""
    cases = [
        (moto_server.endpoint_url, "s3://no-such-bucket-here/run", "create the bucket"),
        (_closed_port(), "s3://bkt/run", "endpoint is reachable"),
    ]
    for i, (endpoint, url, hint) in enumerate(cases):
        tiers = [
            LocalTier(tmp_path / f"local{i}"),
            S3Tier(url, endpoint_url=endpoint, max_attempts=1, connect_timeout=1),
        ]
        with Checkpointer(tiers) as ck:
            for err in _all_ways(ck):
                assert not isinstance(err, (CheckpointNotFound, FileNotFoundError))
                assert isinstance(err, BackendError) and isinstance(err, OSError)
                assert "'s3' could not be listed" in str(err) and hint in str(err)
                assert list(err.errors) == ["s3"]
                assert "not 'no checkpoint'" in str(err)
            back = pickle.loads(pickle.dumps(err))  # crosses process boundaries intact
            assert type(back) is TiersUnreadable and back.errors == err.errors


@pytest.mark.s3
def test_what_the_readable_tiers_hold_is_still_loaded(
    moto_server: S3Server, s3_bucket: BucketFactory, tmp_path: Path
) -> None:
    """Where a tier that can be listed holds checkpoints, an unreachable one does not stop the
    load (it is logged): the newest readable checkpoint loads, ``steps()`` lists it. Where every
    tier can be listed and none holds a checkpoint, it is ``CheckpointNotFound`` as before (a
    new run starts)."""
    with Checkpointer([LocalTier(tmp_path / "a")]) as ck:
        ck.save(_state(4), 4).wait()
    dead = S3Tier("s3://bkt/run", endpoint_url=_closed_port(), max_attempts=1, connect_timeout=1)
    with Checkpointer([LocalTier(tmp_path / "a"), dead]) as ck:
        assert ck.steps() == [4] and ck.latest_step() == 4
        assert ck.load()["step"] == 4
    bucket = s3_bucket(moto_server)
    fresh = [
        LocalTier(tmp_path / "b"),
        S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url),
    ]
    with Checkpointer(fresh) as ck:
        assert ck.steps() == [] and ck.latest_step() is None
        with pytest.raises(CheckpointNotFound):
            ck.load()


@pytest.mark.s3
def test_dcp_reader_says_the_same(tmp_path: Path) -> None:
    """DCP's ``TierReader`` over an empty local tier and an unreachable S3: reading the
    metadata of the newest checkpoint raises ``TiersUnreadable``, not ``CheckpointNotFound``
    (``dcp.load`` reports it inside its ``CheckpointException``)."""
    from tierckpt.dcp import TierReader

    dead = S3Tier("s3://bkt/run", endpoint_url=_closed_port(), max_attempts=1, connect_timeout=1)
    for step in (None, 3):
        with pytest.raises(TiersUnreadable, match="'s3' could not be listed"):
            TierReader([LocalTier(tmp_path), dead], step).read_metadata()
    with pytest.raises(CheckpointNotFound):  # every tier listed, none holds one
        TierReader([LocalTier(tmp_path)]).read_metadata()


@pytest.mark.s3
def test_a_listed_copy_that_cannot_be_read_beside_an_unlisted_tier(tmp_path: Path) -> None:
    """The local tier lists step 4 but its shard file is gone, and S3 cannot be listed: the
    load does not say "no checkpoint" (S3 may hold a good copy) but ``TiersUnreadable``,
    saying the copy it found could not be read."""
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save(_state(4), 4).wait()
    shards = list(tmp_path.rglob("*.tck"))
    assert len(shards) == 1
    for p in shards:
        p.unlink()
    dead = S3Tier("s3://bkt/run", endpoint_url=_closed_port(), max_attempts=1, connect_timeout=1)
    with Checkpointer([LocalTier(tmp_path), dead]) as ck:
        assert ck.steps() == [4]
        for ask in (ck.load, lambda: ck.load(step=4)):
            with pytest.raises(TiersUnreadable, match="could not be read"):
                ask()
