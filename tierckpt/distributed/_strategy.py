"""The multi-rank save: the attempt-id handshake in the training thread (:func:`begin_save`),
the commit of a tier's shard (:func:`commit_multi_rank`) and the report of a failure
(:func:`report_failure`)."""

from __future__ import annotations

import logging
import os
import secrets
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierckpt.distributed._collectives import _group_ok, _warn_once, collective_device
from tierckpt.distributed._private import (
    _commit_private,
    _publish_private,
    _store,
    _store_lock,
    is_private_tier,
)
from tierckpt.distributed._records import (
    _ATTEMPT,
    CommitTimeout,
    RankFailed,
    RankRecord,
    _describe,
    encode_failure,
)
from tierckpt.distributed._shared import _manifest, _put_manifest, _write_record, wait_for_records
from tierckpt.format import ShardRef, rank_failure_name

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer
    from tierckpt.pipeline import SaveJob, TierRuntime

__all__ = ["begin_save", "commit_multi_rank", "report_failure"]

log = logging.getLogger("tierckpt")


def report_failure(tier: TierRuntime, job: SaveJob, error: BaseException) -> None:
    """Tell the ranks waiting on ``tier`` that this rank's part of ``job`` failed.

    Called by the pipeline when a multi-rank save fails on a tier. On a shared tier a non-zero
    rank writes its failure record (rank 0 is the one that waits; nobody waits for rank 0's
    record); on a private tier any rank sets the attempt's failure key in the store. Best
    effort: storage that just failed may fail again, and then rank 0 falls back on its
    ``commit_timeout``.
    """
    if isinstance(error, (CommitTimeout, RankFailed)):
        return  # a verdict on other ranks, not a failure of this rank's own part
    try:
        if is_private_tier(tier):
            if job.attempt:
                st = _store()
                with _store_lock:
                    st.set(
                        f"tierckpt/{job.attempt}/{tier.name}/failed",
                        f"rank {job.rank}: {_describe(error)}".encode("utf-8", "replace"),
                    )
            return
        if job.rank == 0:
            return
        body = encode_failure(
            job.step, job.rank, job.attempt, tier.name, _describe(error), timeline=job.timeline
        )
        tier.backend.put_atomic(
            rank_failure_name(job.step, job.rank, timeline=job.timeline), body, overwrite=True
        )
    except Exception as exc:  # never mask the save's own error
        log.warning(
            "step %d tier %s: could not report rank %d's failure to the other ranks (%s); "
            "rank 0 will wait out its commit timeout",
            job.step,
            tier.name,
            job.rank,
            exc,
        )


@dataclass
class _Session:
    """Per-checkpointer state of the handshake: the id agreed at the first save, a counter."""

    session: int = 0
    saves: int = 0


_sessions: weakref.WeakKeyDictionary[Checkpointer, _Session] = weakref.WeakKeyDictionary()


def begin_save(
    ck: Checkpointer, step: int, busy: bool, *, timeline: int = 0, agree_timeline: bool = False
) -> tuple[str, bool, int]:
    """Agree on an attempt id (and, with ``on_busy="skip"``, on skipping; and on the
    timeline); training thread.

    Returns ``(attempt_id, skip_because_busy, timeline)``. The attempt id is ``<session>-<n>``: the
    session id is drawn by rank 0 and spread by one all-reduce at the checkpointer's first
    multi-rank save; ``n`` counts saves, which every rank makes in the same order. So
    with ``on_busy="block"`` (the default) later saves need no collective at all. With
    ``on_busy="skip"`` every save runs one small all-reduce so that all ranks skip together
    (and checks that they save the same step; a mismatch raises ``ValueError`` everywhere).
    Without an initialized process group (rank and world size given by hand) there is no
    collective: the session is ``TIERCKPT_ATTEMPT_ID`` (empty: any record is accepted).

    ``agree_timeline``: ``timeline`` is this rank's choice from its own view of the tiers
    (the first save, the first after a load, a step below the previous save's — the same
    saves on every rank); the ranks take the largest, in the same all-reduce, so that every
    rank writes the same checkpoint id. Otherwise ``timeline`` is returned as it is.
    """
    sess = _sessions.setdefault(ck, _Session())
    sess.saves += 1
    if not _group_ok(ck):
        _warn_once(
            "no-group",
            "multi-rank save without an initialized torch.distributed group: ranks cannot "
            "agree on an attempt id (set TIERCKPT_ATTEMPT_ID per job attempt) nor skip together",
        )
        attempt = os.environ.get("TIERCKPT_ATTEMPT_ID", "")
        if not _ATTEMPT.match(attempt) or len(attempt) > 100:
            raise ValueError("TIERCKPT_ATTEMPT_ID may hold only [0-9A-Za-z._-], 100 at most")
        return (f"{attempt}-{sess.saves}" if attempt else ""), busy, timeline
    skip_mode = ck.on_busy == "skip"
    if sess.session == 0 or skip_mode or agree_timeline:
        import torch.distributed as dist

        mine = secrets.randbits(62) + 1 if ck.rank == 0 and sess.session == 0 else 0
        t = torch.tensor(
            [mine, step, -step, int(busy), timeline],
            dtype=torch.int64,
            device=collective_device(),
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        drawn, hi, neg_lo, any_busy, timeline = (int(v) for v in t.tolist())
        if sess.session == 0:
            sess.session = drawn
        if hi != -neg_lo:
            raise ValueError(
                f"ranks are saving different steps (from {-neg_lo} to {hi}); every rank must "
                "call save() with the same step"
            )
        busy = bool(any_busy)
    return f"{sess.session:016x}-{sess.saves}", busy, timeline


def commit_multi_rank(
    ck: Checkpointer, tier: TierRuntime, job: SaveJob, ref: ShardRef, raw: int, stored: int
) -> Future[None] | None:
    """Runs on a tier's writer thread once this rank's shard is durable on ``tier``.

    Writes this rank's record and returns; on rank 0 (and on private tiers) the waiting part
    goes to the pipeline's commit threads (a Future), so the tier's writer thread moves on to
    the next checkpoint and training never waits for other ranks' flushes.
    """
    rec = RankRecord(
        step=job.step,
        rank=job.rank,
        world_size=job.world_size,
        attempt=job.attempt,
        tier=tier.name,
        file=ref.file,
        size=ref.size,
        index_checksum=ref.index_checksum,
        raw_bytes=raw,
        stored_bytes=stored,
        codec=tier.codec.codec_id,
        timeline=job.timeline,
    )
    if is_private_tier(tier):
        st = _publish_private(tier, job, rec)
        return _defer(ck, lambda: _commit_private(ck, tier, job, st))
    _write_record(tier.backend, rec)
    if job.rank != 0:
        return None

    def wait_and_commit() -> None:
        records = wait_for_records(
            tier.backend, tier.name, job.step, job.world_size, job.attempt, timeline=job.timeline
        )
        _put_manifest(tier.backend, _manifest(tier.name, job, records))

    return _defer(ck, wait_and_commit)


def _defer(ck: Checkpointer, fn: Callable[[], None]) -> Future[None] | None:
    pipeline = ck._pipeline
    if pipeline is None:
        fn()
        return None
    return pipeline.defer(fn)
