"""How a checkpoint commits and how a load picks its checkpoint: the :class:`CommitStrategy`
protocol, and :class:`SingleRankCommit`, the strategy of a job of one process.

A :class:`~tierckpt.Checkpointer` hands every step where ranks might have to agree to the
strategy it picked in ``__init__``: :class:`SingleRankCommit` for a world of one,
:class:`tierckpt.distributed.MultiRankCommit` otherwise. The checkpointer itself has no branch
on the world size, and the one-rank strategy has none of its own: where ranks agree, one rank
agrees with itself (the idea of DCP's ``_DistWrapper``, whose collectives are no-ops when
there is nothing to be collective with).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tierckpt._version import __version__
from tierckpt.errors import TierCkptError
from tierckpt.format import CheckpointId, Manifest, ShardRef, encode_manifest, manifest_name
from tierckpt.restore import read_manifest

if TYPE_CHECKING:
    from tierckpt.pipeline import SaveJob, Tier
    from tierckpt.restore import LoadedShard

#: a rank's committed checkpoints by tier name (a load's listing)
Listed = Mapping[str, Sequence[CheckpointId]]

__all__ = [
    "CommitStrategy",
    "Defer",
    "Earlier",
    "EarlierSave",
    "Listed",
    "SaveStart",
    "SingleRankCommit",
    "being_saved",
]

log = logging.getLogger("tierckpt")

#: runs a commit's waiting part on the pipeline's commit threads and returns its Future
#: (None: it ran inline, there being no pipeline)
Defer = Callable[[Callable[[], None]], "Future[None] | None"]


@dataclass(frozen=True, slots=True)
class EarlierSave:
    """What this rank knows of its own earlier save of the checkpoint a save names (the same
    step on the same timeline: a retry, or the step saved twice)."""

    #: that save is still in flight on this rank
    in_flight: bool = False
    #: the tiers where this rank's part of it finished without error: committed there (one
    #: rank; rank 0; any rank on a private tier), or, for another rank on a tier all ranks
    #: share, its shard file durable there, which rank 0 may have committed
    done: frozenset[str] = frozenset()


#: the owner's answer for ``(step, timeline)``: its own earlier save of that checkpoint
Earlier = Callable[[int, int], EarlierSave]


def being_saved(step: int, where: str = "") -> str:
    """The message of a save refused because the same checkpoint is still being saved."""
    return (
        f"step {step} is already being saved{where}: wait for that save (its handle's wait(), "
        "or ck.wait()) instead of saving the step again, or save other state under another "
        "step (a loop that saves at a preemption checks stop.check() before its periodic "
        "save, so that one step is saved once)"
    )


@dataclass(frozen=True, slots=True)
class SaveStart:
    """What :meth:`CommitStrategy.begin_save` decided for one save."""

    #: carried by the save's completion records, so that an earlier, killed attempt's records
    #: are not taken for this one's ("" with one rank: there are no records)
    attempt: str
    #: some rank is still flushing an earlier save (with ``on_busy="skip"``: all skip this one)
    busy: bool
    #: the checkpoint's timeline, the same on every rank
    timeline: int
    #: tier name -> why this save must not write there (e.g. "is already committed"): an
    #: earlier save of the same checkpoint committed there. The save's copy on such a tier
    #: fails with ``CheckpointExists`` before anything is written; the same tiers on every
    #: rank wherever the ranks could agree
    refused: Mapping[str, str] = field(default_factory=dict)


class CommitStrategy(Protocol):
    """What a :class:`~tierckpt.Checkpointer` asks of whoever commits its checkpoints.

    The calls, in the order they come. The training-thread ones come on every rank in the
    same order (every rank calls ``save()`` and ``load()`` together), so an implementation may
    run a collective there — and only there: the pipeline's threads must never wait on another
    rank's collective.

    Each ``save()``:

    1. :meth:`begin_save` — training thread, every rank, before anything is captured: the
       save's attempt id, whether some rank is still busy flushing, and its timeline (this
       rank's proposal, agreed with the others where ``agree_timeline``). May run a collective.
       A save of a checkpoint saved before by this owner (the same step on the same timeline:
       the owner's :data:`Earlier` says what became of it) is refused with ``ValueError``
       while that save is still in flight, and may not write on the tiers where it committed
       (:attr:`SaveStart.refused`) — on every rank alike: no rank may replace a shard file a
       manifest names, or that rank 0 may still name in one. A retry after a failure writes
       again.
    2. :meth:`commit` — a tier's writer thread, once per tier the save reaches, once this
       rank's shard file is durable there: make the checkpoint committed on the tier (its
       manifest, create-only and last). Returns None once done, or the Future of a waiting part
       handed to the pipeline's commit threads (``defer``), so that the writer thread moves on
       to the next checkpoint. No collective.
    3. :meth:`retains` — the thread that finished a successful commit (writer or commit
       thread), once per tier: whether this rank now applies the tier's retention
       (``keep_last``). The pipeline applies it, in one place, where this says so.
    4. :meth:`report_failure` — the pipeline thread where this rank's part failed on a tier
       (capture, write or commit), once per failed tier: tell whoever waits for this rank.
       Best effort: never raises. No collective.

    Each ``load()``:

    5. :attr:`repopulates` — training thread: whether a load that reads from a remote tier
       also copies the shard onto the local durable tiers.
    6. :meth:`agree_on_step` — training thread, every rank, once, before reading: the
       checkpoints to try, newest first, the same on every rank. May run a collective.
    7. :meth:`publish_repopulated` — training thread, every rank, exactly once per load after
       reading, whether the read worked or not (``loaded`` is None where it failed): commit
       the copies the load made on faster tiers. May run a collective; best effort: never
       raises.
    """

    def begin_save(
        self, step: int, busy: bool, *, timeline: int, agree_timeline: bool
    ) -> SaveStart:
        """Start a save of ``step``. ``busy``: this rank still flushes an earlier save.
        ``timeline``: this rank's choice; ``agree_timeline``: it was chosen from the tiers now
        (the ranks take the largest), else the previous save's goes on unchanged."""
        ...

    def commit(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> Future[None] | None:
        """Commit ``job`` on ``tier``, where this rank's shard file ``ref`` (``raw`` bytes of
        state, ``stored`` bytes after encoding) is durable."""
        ...

    def retains(self, tier: Tier, job: SaveJob) -> bool:
        """Whether this rank applies ``tier``'s retention now that ``job`` committed there."""
        ...

    def report_failure(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        """This rank's part of ``job`` failed on ``tier`` with ``error``."""
        ...

    @property
    def repopulates(self) -> bool:
        """Whether loads from a remote tier copy the shard onto the local durable tiers."""
        ...

    def agree_on_step(
        self, candidates: Sequence[CheckpointId], *, listed: Listed | None = None
    ) -> list[CheckpointId]:
        """The checkpoints to load, newest first, from this rank's ``candidates`` (newest
        first; an id this rank does not hold may be among them: it tells the other ranks).
        ``listed`` (a load of the newest without a fallback): ``candidates`` is this rank's
        listing, ``listed`` the same by tier, and only the newest that every rank lists is
        loaded (no fallback to an older one)."""
        ...

    def publish_repopulated(self, loaded: LoadedShard | None) -> None:
        """Commit the copies of ``loaded`` (``loaded.repopulated``) on faster tiers."""
        ...

    def settle(self) -> None:
        """At ``close()``, after the pipeline: what the job's other ranks still need of this
        rank (rank 0 of a multi-rank job: its store, for its latest private commits)."""
        ...

    def agree_on_outcome(self, code: int) -> int:
        """The worst of every rank's outcome code, so that every rank ends alike (may run a
        collective): of a load (0: loaded; 1: the checkpoint was not found, e.g. retention
        deleted it while it was read; 2: another error), and of a first save's start
        (0: it may write; 1: another live writer; 2: another error)."""
        ...

    def read_manifest(self, tier: Tier, cid: CheckpointId) -> Manifest:
        """The manifest of ``cid`` on ``tier`` for the load in progress (after
        :meth:`agree_on_step`; multi-rank: read once per node). Training thread."""
        ...


class SingleRankCommit:
    """The :class:`CommitStrategy` of a job of one process: nobody to wait for or agree with.

    A save commits as soon as its one shard file is durable: the manifest, written last and
    create-only. ``repopulate``: loads from a remote tier copy the checkpoint onto the local
    durable tiers (``Checkpointer(repopulate=...)``). ``earlier``: the owner's own earlier
    save of a checkpoint (a save of it still in flight is refused; on a tier where it
    committed, the copy finds the manifest there and refuses to overwrite it).
    """

    def __init__(self, *, repopulate: bool, earlier: Earlier | None = None) -> None:
        self._repopulate = repopulate
        self._earlier = earlier

    def begin_save(
        self, step: int, busy: bool, *, timeline: int, agree_timeline: bool
    ) -> SaveStart:
        if self._earlier is not None and self._earlier(step, timeline).in_flight:
            raise ValueError(being_saved(step))
        # where it committed, the tier's copy finds the manifest and refuses (pipeline): one
        # process needs no list of its own
        return SaveStart("", busy, timeline)

    def commit(
        self, tier: Tier, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> Future[None] | None:
        m = Manifest(
            step=job.step,
            world_size=1,
            shards=(ref,),
            created=time.time(),
            library_version=__version__,
            tier=tier.name,
            raw_bytes=raw,
            stored_bytes=stored,
            codecs=(tier.codec.codec_id,),
            metadata=job.metadata,
            timeline=job.timeline,
        )
        tier.backend.put_atomic(manifest_name(job.step, timeline=job.timeline), encode_manifest(m))
        return None

    def retains(self, tier: Tier, job: SaveJob) -> bool:
        return True

    def report_failure(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        pass  # nobody waits for this rank

    @property
    def repopulates(self) -> bool:
        return self._repopulate

    def agree_on_step(
        self, candidates: Sequence[CheckpointId], *, listed: Listed | None = None
    ) -> list[CheckpointId]:
        return list(candidates if listed is None else candidates[:1])

    def agree_on_outcome(self, code: int) -> int:
        return code

    def settle(self) -> None:
        pass

    def read_manifest(self, tier: Tier, cid: CheckpointId) -> Manifest:
        return read_manifest(tier.backend, cid.step, tier.name, timeline=cid.timeline)

    def publish_repopulated(self, loaded: LoadedShard | None) -> None:
        if loaded is None:
            return
        cid = loaded.manifest.id
        body = encode_manifest(loaded.manifest)
        for backend in loaded.repopulated:
            try:
                backend.put_atomic(manifest_name(cid.step, timeline=cid.timeline), body)
            except FileExistsError:
                pass  # committed there meanwhile (by another process restoring the same)
            except (OSError, TierCkptError) as exc:
                log.warning("repopulating %s: could not commit %s: %s", backend.url, cid, exc)
