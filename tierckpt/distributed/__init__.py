"""Multi-rank commit and load agreement on ``torch.distributed``.

:class:`MultiRankCommit` is the :class:`~tierckpt.commit.CommitStrategy` a
:class:`~tierckpt.Checkpointer` uses when the job has several ranks (it picks one in
``__init__`` and hands it what it needs; this package never imports the checkpointer). The
protocol says which call comes when, on which thread; this says what the calls do across ranks.

Save
    Every rank streams its own shard file (``steps/<step>/rank-<r>.tck``; on a timeline t >= 1
    ``steps/<step>.t<t>/...``, see :class:`~tierckpt.format.CheckpointId`) to every tier in its
    own background threads. Once a rank's file is durable on a tier it writes a small
    *completion record* next to it (``rank-<r>.done.json``: the shard's size and index
    checksum, raw and stored bytes, and the *attempt id* of this save). Rank 0, once its own
    file is durable, polls the tier for the other ranks' records — storage requests only, never
    a collective in a background thread, on the pipeline's commit threads so that the tier's
    writer moves on to the next checkpoint — and writes the tier's manifest, listing every
    rank's file, create-only. A non-zero rank returns as soon as its record is written: on
    those ranks ``handle.done(tier)`` means "my shard is durable there", not "the checkpoint
    is committed"; :func:`wait_committed` waits for the manifest.

    A rank whose save fails on a tier (disk full, storage errors, a failed capture) writes a
    *failure record* there instead (``rank-<r>.failed.json``: attempt id and error message):
    rank 0 sees it at its next poll and fails that tier's save at once with
    :class:`RankFailed`, naming the rank and its error. A rank that dies writes nothing, so
    rank 0 writes no manifest: after ``commit_timeout`` it fails that tier's save with
    :class:`CommitTimeout`, naming the missing ranks. Either way nothing is committed and the
    previous checkpoint stays the newest committed one.

Format v2 (the default: tiers write their files under hashed prefixes, :mod:`tierckpt.layout`)
    A rank's completion record carries its fields in its name, under the rank's own prefix
    (``<hh>/steps/<step>/records/rank-<r>.done.<size>.<crc>.<raw>.<stored>.<codec>.<attempt>``),
    and rank 0 commits from LIST pages alone, GETting no record: it lists only the
    ``records/`` folders of prefixes that still miss a record, each from past the last rank
    seen there with all before it (``StartAfter``). On a tier with ``prefixes=0`` (format v1
    names) the records are v1 JSON objects that rank 0 GETs, as described above.

Attempt ids
    Records of an earlier, killed attempt at the same step must not be mistaken for this
    one's, so every record carries an attempt id ``<session>-<step>.<timeline>.<k>``: the
    session id is drawn by rank 0 and spread by one small all-reduce in the training thread at
    the checkpointer's first multi-rank save (:meth:`MultiRankCommit.begin_save`); ``k`` counts
    this rank's tries of that step and timeline (a rank that skipped a save costs that step
    only). Later
    saves need no collective — except with ``on_busy="skip"``, where every save runs that
    all-reduce so that all ranks skip together, and a save of the step saved just before
    (``k`` > 1), where one all-reduce decides alike on every rank: refused while the earlier
    save is in flight on any rank, kept off the tiers where it committed (no rank replaces a
    shard a manifest names, or that rank 0 may still name), written again after a failure.

Private tiers
    A tier whose storage other ranks cannot see (a RAM tier: each process has its own; node
    RAM; or a node-local disk named in ``TIERCKPT_PRIVATE_TIERS``) cannot be polled by rank 0.
    There the records travel through key-value stores in two levels (:mod:`._private`): each
    rank puts its record into its node's store (a ``TCPStore`` the node's leader, its lowest
    rank, starts at the first save; nodes from ``TIERCKPT_NODE`` or the host name), and the
    node's last rank forwards the node's records as one item to the process group's store
    on rank 0's host. Rank 0 waits for one item per node, composes the manifest once and
    publishes it; each node's leader fetches it once for its node's ranks, and every rank
    writes that same manifest onto its own copy of the tier. Each rank applies retention to
    its own copy. A rank that fails there sets a failure key in rank 0's store and its
    node's, which every waiting rank checks (leaders pass on what they hear).

Load
    :func:`agree_on_step` — one ``all_gather`` of a fixed-size vector in the calling thread —
    makes every rank load the same checkpoint: the newest (step and timeline) whose manifest
    and own shard index every rank can read. Before it, the lowest rank of each node
    (``TIERCKPT_NODE``, else the host name) reads the candidates' manifests on the shared tiers
    and shares the bytes with its node's ranks (one broadcast in a node group made at the
    first load), so a load reads each manifest once per node, not twice per rank.

Timelines
    Every rank must write the same checkpoint id. Where a save chooses its timeline from the
    tiers (the first save, the first after a load, a step below the previous save's: the same
    saves on every rank) each rank proposes one from its own view of the tiers and the
    all-reduce of :meth:`~MultiRankCommit.begin_save` takes the largest; other saves keep the
    previous save's timeline on every rank without a collective.

Knobs (environment overrides, :func:`knobs` context manager for tests)
    ``TIERCKPT_COMMIT_TIMEOUT_S`` (600), ``TIERCKPT_COMMIT_POLL_MAX_S`` (2.0).
"""

from __future__ import annotations

from tierckpt.distributed._agree import agree_on_step, checkpoint_key, checkpoint_of_key
from tierckpt.distributed._collectives import collective_device
from tierckpt.distributed._knobs import DistKnobs, get_knobs, knobs
from tierckpt.distributed._private import is_private_tier
from tierckpt.distributed._records import (
    RankRecord,
    decode_failure,
    decode_record,
    encode_failure,
    encode_record,
)
from tierckpt.distributed._repopulate import publish_repopulated
from tierckpt.distributed._shared import wait_committed, wait_for_records
from tierckpt.distributed._strategy import MultiRankCommit, report_failure
from tierckpt.errors import CommitTimeout, RankFailed

__all__ = [
    "CommitTimeout",
    "DistKnobs",
    "MultiRankCommit",
    "RankFailed",
    "RankRecord",
    "agree_on_step",
    "checkpoint_key",
    "checkpoint_of_key",
    "collective_device",
    "decode_failure",
    "decode_record",
    "encode_failure",
    "encode_record",
    "get_knobs",
    "is_private_tier",
    "knobs",
    "publish_repopulated",
    "report_failure",
    "wait_committed",
    "wait_for_records",
]
