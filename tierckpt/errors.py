"""One error family.

Every error tierckpt raises derives from :class:`TierCkptError` and also from the
built-in exception a caller would naturally catch (``FileNotFoundError``,
``ValueError``, ``TypeError``, ``OSError``, ``RuntimeError``, ``TimeoutError``), so
``except FileNotFoundError`` keeps working for code that does not know about tierckpt.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = [
    "BackendError",
    "CheckpointExists",
    "CheckpointFailed",
    "CheckpointNotFound",
    "CheckpointSkipped",
    "CloseTimeout",
    "CommitTimeout",
    "CopySkipped",
    "CorruptCheckpoint",
    "CorruptChunk",
    "FormatError",
    "InheritedThroughFork",
    "LeaseLost",
    "NewerFormat",
    "RankFailed",
    "SaveDeadlineExceeded",
    "StaleTimeline",
    "StateChanged",
    "StateMismatch",
    "TierCkptError",
    "TiersUnreadable",
    "UnknownCodec",
    "UnsupportedObject",
    "WriterConflict",
]


class TierCkptError(Exception):
    """Root of every tierckpt error."""


class CheckpointNotFound(TierCkptError, FileNotFoundError):
    """No committed checkpoint matches the request (step, tier or URL)."""


class WorldSizeMismatch(TierCkptError, RuntimeError):
    """The newest checkpoint was saved by another number of ranks than this job has: the
    native format is one file per rank, so this job cannot load it. Not a
    :class:`CheckpointNotFound` on purpose: a resume written as ``except CheckpointNotFound:
    start from scratch`` would train from step 0 and its retention would delete the run's
    checkpoints. Restart with the world size it names, or save with ``tierckpt.dcp`` to
    reshard."""

    @classmethod
    def of(cls, checkpoint: Any, saved_by: int | None, world_size: int) -> WorldSizeMismatch:
        """The error for ``checkpoint`` (saved by ``saved_by`` ranks; None: unknown here):
        the cause, then what to do."""
        by = f"{saved_by} ranks" if saved_by is not None else "another number of ranks"
        return cls(
            f"checkpoint {checkpoint} was saved by {by}, and this job has {world_size}: "
            f"restart with {saved_by if saved_by is not None else 'that many'} ranks to resume "
            "it (the native format is one file per rank; tierckpt.dcp checkpoints reshard). "
            "Nothing was loaded. Do not start this job from scratch on these tiers: its saves "
            "would abandon that run's checkpoints, and retention would delete them. To resume "
            "from an older checkpoint this world size saved, load(step=...) it explicitly"
        )


class FormatError(TierCkptError, ValueError):
    """A shard file, index or manifest does not follow the format, or is hostile."""


class NewerFormat(FormatError):
    """A manifest of a format version newer than this tierckpt reads: written by a newer
    release. Never damage: nothing deletes or replaces it (upgrade to read it)."""


class CorruptCheckpoint(FormatError):
    """A stored object failed its integrity check (checksum, size, footer)."""


class CorruptChunk(CorruptCheckpoint):
    """One chunk's stored bytes do not match their checksum or fail to decode."""

    def __init__(self, message: str, *, tier: str = "", file: str = "", chunk: int = -1):
        super().__init__(message)
        self.tier = tier
        self.file = file
        self.chunk = chunk


class UnknownCodec(TierCkptError, ValueError):
    """A codec id that is not in the registry (or whose package is not installed)."""


class UnsupportedObject(TierCkptError, TypeError):
    """The state holds an object the format cannot store without pickle."""


class StateMismatch(TierCkptError, ValueError):
    """``load(into=...)`` found a key, shape or dtype that differs from the checkpoint."""


class BackendError(TierCkptError, OSError):
    """A storage backend failed (disk full, permission, S3 error after retries)."""


class TiersUnreadable(BackendError):
    """What was asked for is on no tier that could be listed, and one or more tiers could not
    be listed: whether it exists is unknown. ``errors`` maps each such tier's name to why.

    Deliberately not a :class:`CheckpointNotFound`: code that starts a run over when there is
    no checkpoint (``except CheckpointNotFound``, ``if not ck.steps()``) must not start over
    while the store that holds the checkpoints is unreachable or misnamed."""

    def __init__(self, message: str, errors: dict[str, str] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.errors))


class CheckpointExists(TierCkptError, FileExistsError, RuntimeError):
    """A save names a checkpoint that is already committed: refused, nothing is overwritten.

    Also a ``RuntimeError``, which ``torch.distributed.checkpoint.FileSystemWriter(overwrite=
    False)`` raises in the same case ("Checkpoint already exists"), so code and tests written
    for DCP recognise it."""


class CheckpointFailed(TierCkptError, RuntimeError):
    """A save did not commit on one or more tiers; ``errors`` maps tier name to cause."""

    def __init__(self, message: str, errors: dict[str, BaseException] | None = None):
        super().__init__(message)
        self.errors = dict(errors or {})


class CheckpointSkipped(CheckpointFailed):
    """A save was skipped (``on_busy="skip"`` while an earlier one was still flushing): nothing
    of it was written. ``h.wait()`` / ``h.result()`` raise it; ``h.skipped`` says so too."""


class WriterConflict(TierCkptError, RuntimeError):
    """Another live writer holds this tier location (its lease): this one writes nothing there.

    ``tier`` and ``url`` name the location; ``holder`` is the other writer's lease record
    (host, pid, start and last renewal) when it could be read. ``presumed``: the holder counts
    as live only because its lease is younger than its ttl (another machine, or a container
    that names no lock file here, dead or not): ``save()`` does not raise it, that tier's copy
    fails with it until the lease expires (then it is taken over) or is seen renewed (then the
    holder is known live, and ``save()`` raises).
    """

    def __init__(
        self,
        message: str,
        *,
        tier: str = "",
        url: str = "",
        holder: Any = None,
        presumed: bool = False,
    ):
        super().__init__(message)
        self.tier = tier
        self.url = url
        self.holder = holder
        self.presumed = presumed


class LeaseLost(WriterConflict):
    """This writer's lease on a tier was taken over (or removed): it no longer writes there."""


class CommitTimeout(TierCkptError, TimeoutError):
    """Rank 0 gave up waiting for other ranks' completion records: nothing was committed."""


class RankFailed(TierCkptError, RuntimeError):
    """Another rank reported that its shard failed on this tier: nothing was committed."""


class SaveDeadlineExceeded(TierCkptError, TimeoutError):
    """A tier made no progress for ``save_deadline`` seconds while training waited for it:
    that tier's copy of the step was given up (never committed there) so training goes on."""


class CloseTimeout(TierCkptError, TimeoutError):
    """A copy was still unfinished when ``close(timeout=)`` ran out: given up on that tier
    (never committed there); the checkpoints committed before are untouched."""


class InheritedThroughFork(TierCkptError, RuntimeError):
    """A ``Checkpointer`` (or ``dcp.TierWriter``) used in a process forked from the one that
    made it (a DataLoader worker, ``multiprocessing`` with the fork start method): its
    threads, leases and store connections are the parent's, so the child's copy refuses to
    save, load or list. Make a new one in the child, or use it in the parent."""

    def __init__(self, kind: str, parent: int, child: int) -> None:
        super().__init__(
            f"this {kind} was made in process {parent} and reached process {child} through "
            f"fork (a DataLoader worker, multiprocessing with the fork start method): its "
            f"threads, writer leases and store connections belong to process {parent}, so "
            f"it is not used here. Make a new {kind} in this process to load or list "
            "checkpoints (it must not save where the parent saves), or call it in the parent"
        )
        self.parent, self.child = parent, child


class CopySkipped(TierCkptError, RuntimeError):
    """A tier that copies from another (``source=``) fell more than ``max_behind`` steps
    behind it: its copy of an older step was skipped so the source's retention can go on."""


class StaleTimeline(TierCkptError, RuntimeError):
    """A save's timeline was chosen while a tier could not be listed (down, or not answering
    in time), and that tier holds a newer checkpoint than the save: its copy is not published
    there (that tier's retention would remove it as the older one, and a load from there
    would give the other checkpoint). The save commits on the other tiers; the next save
    chooses its timeline again, with that tier in view."""


class StateChanged(TierCkptError, RuntimeError):
    """Tensors that a guarded save captures lazily (parameters, optimizer state) were changed
    in place after ``save()`` and before they were captured (an EMA or averaged-weights swap
    for evaluation, ``load_state_dict()``, ``clamp_()``, an unguarded optimizer's step): the
    checkpoint would mix values from before and after, so that save is not committed anywhere.
    Call ``ck.wait_captured()`` before such a change. Seen through the tensors' version
    counters: a change made through ``.data`` is not seen."""


def chained(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception chained to it (causes and contexts), each once. Not in
    ``__all__``, which lists the error classes only."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
