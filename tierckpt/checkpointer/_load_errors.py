"""The error a failed :meth:`~tierckpt.Checkpointer.load` raises, told apart by what the tiers
hold once it failed.

``CheckpointNotFound`` means that nothing is committed: the ``except CheckpointNotFound: start
from scratch`` idiom acts on it, and the fresh run's saves (on a new timeline) then let
retention delete the run's checkpoints. So where the checkpoint asked for *is* committed but no
rank or tier could read it whole (a shard file missing or damaged on one rank) the load raises
:class:`~tierckpt.errors.CorruptCheckpoint` instead, naming the older committed steps and how
to load them; a ``CorruptCheckpoint`` (every copy damaged) gets the same advice.

A step this writer was still saving when the load began, and that committed while the load
ran, was never unreadable: the load keeps its ``CheckpointNotFound`` (which says to call
``ck.wait()`` first).
"""

from __future__ import annotations

from collections.abc import Callable, Set

from tierckpt.catalog import steps_of
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint, TierCkptError
from tierckpt.format import CheckpointId

__all__ = ["committed_yet_unread"]

_VERIFY = "`tierckpt verify <url> --step N` says what is damaged"


def committed_yet_unread(
    error: BaseException,
    listed: Callable[[], list[CheckpointId]],
    step: int | None,
    timeline: int | None,
    fallback: str,
    in_flight: Set[int] = frozenset(),
) -> BaseException:
    """The error to raise for ``error``; ``listed()`` lists the committed checkpoints now,
    ``in_flight``: the steps this writer was saving when the load began."""
    if isinstance(error, CorruptCheckpoint) and fallback != "previous":
        return _older_ones(error, listed, step, timeline)
    if not isinstance(error, CheckpointNotFound):
        return error
    try:
        ids = [c for c in listed() if timeline is None or c.timeline == timeline]
    except TierCkptError:
        return error
    held = [c for c in ids if (step is None or c.step == step) and c.step not in in_flight]
    if not held:
        return error
    older = steps_of([c for c in ids if c < held[-1]])[-10:]
    out = CorruptCheckpoint(
        f"checkpoint {held[-1]} is committed but could not be read (damaged, or deleted while "
        f"it was read): {error}. "
        + (
            f"Older committed steps: {older}; load(fallback='previous') loads the newest one "
            "every rank can read"
            if older
            else "No older checkpoint is committed"
        )
        + f"; {_VERIFY}"
    )
    out.__cause__ = error
    return out


def _older_ones(
    error: CorruptCheckpoint,
    listed: Callable[[], list[CheckpointId]],
    step: int | None,
    timeline: int | None,
) -> BaseException:
    """``error`` (a damaged checkpoint) naming the older committed steps and the fallback: its
    message extended in place (its type, cause and attributes are what callers look at)."""
    try:
        ids = [c for c in listed() if timeline is None or c.timeline == timeline]
    except TierCkptError:
        return error
    below = step if step is not None else max((c.step for c in ids), default=0)
    older = steps_of([c for c in ids if c.step < below])[-10:]
    if older and len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (
            f"{error.args[0]}. Older committed steps: {older}; load(fallback='previous') loads "
            f"the newest one that can be read; {_VERIFY}",
        )
    return error
