"""The pipeline's values: what a save job carries, a tier at run time, the stage events it
emits, the hooks an owner plugs in, and the deadline settings. No threads here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tierckpt import config
from tierckpt._types import BytesLike
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.backends.local import LocalBackend
from tierckpt.codecs import Codec
from tierckpt.format import CheckpointId, ShardRef, shard_name, step_prefix
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.layout import prefixes_for, shard_file
from tierckpt.plan import ChunkPlan, CollectedState, ShardLayout
from tierckpt.policy import LocalTier, TierSpec, resolve_codec
from tierckpt.snapshot import Watched

#: seconds in-flight saves get to finish at interpreter exit before they are abandoned
DEFAULT_EXIT_TIMEOUT_S = config.DEFAULT_EXIT_TIMEOUT_S
#: after abandoning, how long the exit handler lets the threads abort their writes and stop
_EXIT_ABORT_GRACE_S = 10.0
#: seconds a save may wait behind a tier that makes no progress (``TIERCKPT_SAVE_DEADLINE``)
DEFAULT_SAVE_DEADLINE_S = config.DEFAULT_SAVE_DEADLINE_S
#: what a save waits, at most, behind a tier whose last work failed without progress since
RETRY_GRACE_S = 5.0


def default_save_deadline() -> float:
    """``TIERCKPT_SAVE_DEADLINE`` (seconds; ``inf`` turns the deadline off), else 30 s."""
    return config.save_deadline_s()


def check_save_deadline(value: float) -> float:
    """``value`` as seconds, refused unless > 0 (``inf``: no deadline)."""
    return config.save_deadline_s(value)


#: the stages a save goes through, in order: ``plan`` (lay the chunks out), ``arena_wait``
#: (wait for a free arena slot: backpressure), ``capture`` (copy a chunk into the arena; for
#: a CUDA tensor, queueing the copy), ``encode`` (compress; not for raw), ``checksum``,
#: ``write`` (a chunk, or the index and footer, to one tier), ``sync`` (that tier's file made
#: durable: fsync + rename, or the multipart upload completed), ``commit`` (the manifest)
Stage = Literal["plan", "arena_wait", "capture", "encode", "checksum", "write", "sync", "commit"]


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage's work on one piece of one save, as the pipeline did it.

    ``tier`` is None for the work shared by every tier fed from the arena (plan, arena wait,
    capture, and encode/checksum, which run once per distinct codec); ``nbytes`` is what the
    stage handled (raw bytes in for capture and encode, stored bytes for checksum and write,
    the file's size for sync, the state's raw bytes for plan and commit).
    """

    stage: Stage
    step: int
    tier: str | None
    nbytes: int
    seconds: float


#: receives every StageEvent, on the pipeline's own threads (several at once): it must be
#: quick and thread-safe; an exception it raises is logged and otherwise ignored
StageListener = Callable[[StageEvent], None]
#: reports one stage (stage, nbytes, seconds) of one job, on one tier or none
_Emit = Callable[[Stage, int, float], None]


@dataclass
class Tier:
    """One tier at run time: its spec, the backend it writes to and the codec it encodes with."""

    spec: TierSpec
    backend: Backend
    codec: Codec

    @property
    def name(self) -> str:
        return self.spec.name

    def shard_file(self, cid: CheckpointId, rank: int) -> str:
        """Rank ``rank``'s shard file of ``cid`` on this tier: format v2 (hashed prefixes)
        unless its ``prefixes`` knob is 0 (see tierckpt.layout)."""
        prefixes = prefixes_for(self.spec.prefixes)
        return shard_file(step_prefix(cid.step, timeline=cid.timeline), rank, prefixes)


def open_tiers(specs: Iterable[TierSpec], *, create: bool = True) -> list[Tier]:
    """Each tier's backend opened and its codec resolved, in order (``Checkpointer`` and the
    DCP writer and reader build their tiers the same way; a reader passes ``create=False``, so
    a mistyped local folder is not made)."""
    out = []
    specs = list(specs)
    for spec in specs:
        if spec.is_replica:
            continue  # copies commits of other tiers (tierckpt.peer), takes no chunks
        spec = spec.for_run(specs)
        backend = spec.make_backend() if create else _reader_backend(spec)
        out.append(Tier(spec, backend, resolve_codec(spec.codec, backend)))
    return out


def _reader_backend(spec: TierSpec) -> Backend:
    """``spec``'s storage for a reader (it writes nothing): a local folder that does not exist
    is left so (it lists as empty); a user's subclass with its own ``make_backend`` as it is."""
    if isinstance(spec, LocalTier) and type(spec).make_backend is LocalTier.make_backend:
        return LocalBackend(spec.path, create=False)
    return spec.make_backend()


@dataclass(frozen=True, slots=True)
class Encoded:
    data: BytesLike
    checksum: str
    codec_config: dict[str, Any]


@dataclass(eq=False)
class _ChunkState:
    plan: ChunkPlan
    slot: int
    job: SaveJob
    #: names of the tiers that have not yet written (or given up) this chunk; the slot is
    #: released when the last one goes (changed under the pipeline's lock)
    holders: set[str]
    encoded: dict[Codec, Future[Encoded]] = field(default_factory=dict)


@dataclass
class _Follow:
    """A follower tier's wait for its source tier's durable file of one job."""

    source: Tier
    #: (file name, chunk records, codec table) of the source's file, or the source's error
    done: Future[tuple[str, list[list[Any]], list[dict[str, Any]]]] = field(default_factory=Future)


@dataclass
class SaveJob:
    step: int
    #: the layout; None until the capture thread lays ``collected`` out
    plan: ShardLayout | None
    tiers: list[Tier]
    handle: SaveHandle
    rank: int
    world_size: int
    ready_events: dict[torch.device, Any]
    metadata: dict[str, Any]
    capture_error: BaseException | None = None
    #: what save() collected (tree + tensor references), laid out by the capture thread
    collected: CollectedState | None = None
    chunk_bytes: int = 0
    #: a guarded save's tensors and their versions at save(), checked by the capture
    watched: Watched | None = None

    @property
    def laid_out(self) -> ShardLayout:
        assert self.plan is not None, "the capture thread lays the plan out first"
        return self.plan

    #: multi-rank saves: the id all ranks agreed on for this attempt (tierckpt.distributed)
    attempt: str = ""
    #: follower tier name -> its source; set by the capture thread
    follows: dict[str, _Follow] = field(default_factory=dict)
    #: the timeline this checkpoint is saved on (chosen by the owner, see CheckpointId)
    timeline: int = 0
    #: the tiers that could not be listed when the timeline was chosen, and the owner's check
    #: that none of them holds a newer checkpoint, called on a tier's thread before this
    #: job's shard is published there (it raises where one does)
    confirm_on: frozenset[str] = frozenset()
    confirm: Callable[[Tier, SaveJob], None] | None = None
    #: tier name -> why this writer could not take its lease there for this job
    lease_errors: dict[str, BaseException] = field(default_factory=dict)
    #: tier name -> why this job must not write there (``CheckpointExists``: an earlier save
    #: of the same checkpoint committed there, see ``CommitStrategy.begin_save``); that
    #: tier's copy fails before anything is written
    refused: dict[str, BaseException] = field(default_factory=dict)
    #: tier name -> why its copy was given up (deadline, follower behind); set under the
    #: pipeline's lock, only before the tier starts committing; such a copy never commits
    given_up: dict[str, BaseException] = field(default_factory=dict)
    #: tiers whose copy of this job can no longer be given up: committing, or failed on
    #: their own (changed under the pipeline's lock)
    settled: set[str] = field(default_factory=set)
    #: (device, copy events) once capture has queued every copy of a one-device state: the
    #: optimizer's step hook makes the training stream wait for them (no host wait)
    queued_events: tuple[torch.device, list[Any]] | None = None

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)

    @property
    def shard(self) -> str:
        """This rank's shard file name."""
        return shard_name(self.step, self.rank, timeline=self.timeline)

    def shard_on(self, tier: Tier) -> str:
        """This rank's shard file name on ``tier`` (:meth:`Tier.shard_file`)."""
        return tier.shard_file(self.id, self.rank)


@dataclass
class _TierWrite:
    """One tier's progress on one job."""

    writer: ObjectWriter | None = None
    offset: int = 0
    records: list[list[Any]] = field(default_factory=list)
    codecs: list[dict[str, Any]] = field(default_factory=list)
    stored: int = 0
    error: BaseException | None = None
    write_seconds: float = 0.0
    #: this tier's stage reporter for the job; None when nobody listens
    emit: _Emit | None = None


#: commits one tier's copy; returns None when done, or a Future (from ``Pipeline.defer``) that
#: completes once committed — multi-rank rank 0 waits for the other ranks that way, without
#: holding the tier's writer thread
CommitFn = Callable[[Tier, SaveJob, ShardRef, int, int], "Future[None] | None"]


@dataclass(frozen=True, slots=True)
class PipelineHooks:
    """What a :class:`PipelineOwner` plugs into its :class:`Pipeline` (see its arguments):
    ``commit`` once a shard file is durable on a tier; ``on_result`` once a save committed on a
    tier; ``on_failure`` when it failed there; ``retains`` whether this rank applies the tier's
    retention after a commit (None: rank 0 does)."""

    commit: CommitFn
    on_result: Callable[[TierResult, SaveHandle], None] | None = None
    on_failure: Callable[[Tier, SaveJob, BaseException], None] | None = None
    retains: Callable[[Tier, SaveJob], bool] | None = None
    #: outcomes counted per tier, shared with the owner (``Checkpointer.tier_counts()``)
    counts: dict[str, Counter[str]] | None = None


#: outcomes counted per tier (``Pipeline.counts``, ``Checkpointer.tier_counts()``)
OUTCOMES = ("committed", "failed", "skipped", "deadline")


def _rank_zero_retains(tier: Tier, job: SaveJob) -> bool:
    return job.rank == 0
