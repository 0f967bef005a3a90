"""Background stages: capture → encode → write per tier → commit. All threads live here.

One capture thread copies chunks into the host arena (waiting for free slots: backpressure).
As soon as a chunk is in the arena it is encoded on a small pool (once per distinct codec
among the tiers; the raw codec costs only a checksum) and handed to every tier's writer
thread, in tier order. A tier thread writes its chunks in sequence, so S3 multipart parts go
out in order while the local tier pwrites at its own pace; a chunk's arena slot is released
once every tier has written it. After the last chunk each tier writes the index and footer,
makes the file durable and commits (manifest last), then applies retention. A failure on one
tier fails that tier's copy of that checkpoint only; it is reported on the handle and in the
log, and the next save starts clean.

A tier with a ``source`` (e.g. S3 behind the local disk) takes no chunks from the arena: once
the source tier's file is durable, the follower's thread reads it back chunk by chunk, checks
each chunk's checksum, re-encodes it for its own codec when that differs, and writes it. So a
slow tier never holds arena slots, and capture goes at the pace of the tiers fed directly.

Whoever wants to know where a save's time goes (``tierckpt bench``'s per-stage breakdown)
subscribes to :class:`StageEvent` s with :meth:`Pipeline.subscribe`; with no subscriber no
stage is timed for it.

At interpreter exit (the main thread has returned or raised), saves still in flight are drained
by :func:`_drain_at_exit`: each live pipeline gets ``exit_timeout_s`` (default 60 s,
``TIERCKPT_EXIT_TIMEOUT_S``) to finish; what is still unfinished then is abandoned — never
committed, its partial files removed by the writers' ``abort()`` — and the threads are stopped
before the interpreter tears down, so a daemon thread is never frozen inside a tensor copy
(which aborted the process with SIGABRT, exit status 134). Before that, exit waits (within the
same bound) for the threads owners name with :func:`wait_at_exit_for` — DCP's ``async_save``
threads, whose saves reach a pipeline only when they write.

One writer per location (:mod:`tierckpt.lease`): before a job is submitted, ``acquire_leases``
has each tier's thread take this writer's lease there (the first time: a live other writer
refuses the save at once). The tier threads renew their leases every ``ttl / 4`` (waking from
their queue for it, and between chunks), check the lease before publishing a shard file and
before retention, and release it at ``close()``. A tier whose lease was lost fails every later
save there and is never garbage-collected by this writer again.

Every wait has a bound. A tier fed from the arena that makes no progress (no chunk written, no
item finished) for ``save_deadline`` seconds while capture waits for arena space it holds is
*given up* for the saves whose chunks it holds: their slots are released at once (capture and
training go on), the copy is reported failed (:class:`SaveDeadlineExceeded`), and that copy can
never commit: the tier's thread, blocked in a call with a view of a slot that may since hold
other bytes, checks the verdict before every write and before its commit, and aborts. The next
save hands its chunks to the tier again. ``drain()`` (``Checkpointer.wait()``, ``close()``)
gives up the queued copies of a tier stalled for as long the same way. A follower holds at most
``max_behind`` of its source's steps (the one it copies and the newest waiting ones); an older
waiting copy is skipped (:class:`CopySkipped`), so the source's retention is never held back
for more than that, and retention runs after a failed save too, so a disk that filled up frees
itself.

The package is cut along those concerns: ``_values`` (what a job carries, tiers, stage events,
hooks, deadline settings), ``_leases`` (this writer's lease table), ``_base`` (the state the
parts share, declared once), ``_stall`` (deadlines, follower bounds), ``_capture`` (arena,
capture, encode), ``_tiers`` (tier threads, follower copy, commit, retention), ``_close``
(``close()``, which leaves a thread blocked in a dead store behind), ``_exit`` (interpreter
exit) and ``_pipeline`` (:class:`Pipeline` assembled from them, and
:class:`PipelineOwner`).
"""

from __future__ import annotations

from tierckpt.pipeline._exit import exit_timeout_s, wait_at_exit_for
from tierckpt.pipeline._pipeline import Pipeline, PipelineOwner, in_owner_process, weakly
from tierckpt.pipeline._values import (
    DEFAULT_EXIT_TIMEOUT_S,
    DEFAULT_SAVE_DEADLINE_S,
    OUTCOMES,
    CommitFn,
    PipelineHooks,
    SaveJob,
    Stage,
    StageEvent,
    StageListener,
    Tier,
    check_save_deadline,
    default_save_deadline,
    open_tiers,
)

__all__ = [
    "DEFAULT_EXIT_TIMEOUT_S",
    "DEFAULT_SAVE_DEADLINE_S",
    "Pipeline",
    "PipelineHooks",
    "SaveJob",
    "StageEvent",
    "Tier",
    "open_tiers",
    "exit_timeout_s",
    "wait_at_exit_for",
    "default_save_deadline",
    # what the owners (Checkpointer, dcp.TierWriter) and the benchmark use too
    "OUTCOMES",
    "CommitFn",
    "PipelineOwner",
    "Stage",
    "StageListener",
    "check_save_deadline",
    "in_owner_process",
    "weakly",
]
