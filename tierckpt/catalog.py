"""What is committed on a tier: listing checkpoints, their order and their lineage.

A checkpoint exists on a tier iff its manifest exists there. Checkpoints are identified by
:class:`~tierckpt.format.CheckpointId` (a step on a timeline) and ordered by
``(timeline, step)``: a run resumed from an older step saves on a newer timeline, so its
checkpoints are newer than those of the run it abandoned, whatever their step numbers.
Retention and garbage collection (:mod:`tierckpt.retention`) act on what this module lists.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

from tierckpt.backends.base import Backend
from tierckpt.errors import StaleTimeline, TierCkptError, TiersUnreadable
from tierckpt.format import (
    MANIFEST_DIR,
    MAX_TIMELINE,
    CheckpointId,
    manifest_name,
    parse_data_folder,
    parse_manifest_id,
)
from tierckpt.reported import report_once

__all__ = [
    "committed_ids",
    "manifest_ids",
    "listed_once",
    "committed_steps",
    "data_ids",
    "data_steps",
    "lineage",
    "ask_within",
    "committed_within",
    "newest_committed_within",
    "newer_than",
    "stale_timeline",
    "newest_per_step",
    "steps_of",
    "list_tiers",
    "timeline_for",
    "unreadable",
]

log = logging.getLogger("tierckpt")

T = TypeVar("T")


#: backends (by id) whose listing is kept while a :func:`listed_once` block runs (None: not
#: listed yet), on this thread
_LISTED: ContextVar[dict[int, list[CheckpointId] | None] | None] = ContextVar(
    "tierckpt_listed", default=None
)


@contextmanager
def listed_once(backends: Iterable[Backend]) -> Iterator[None]:
    """Within this block (on this thread), :func:`committed_ids` lists each of ``backends``
    once and answers again from that listing: one load lists a tier once, also where a peer
    replicator's ``prepare_load`` listed it first. Only for backends nothing in the block
    commits to (a listing kept too long may miss a checkpoint, never invent one; a chosen
    checkpoint that vanished meanwhile fails its read, as one removed just after a listing)."""
    token = _LISTED.set({id(b): None for b in backends})
    try:
        yield
    finally:
        _LISTED.reset(token)


def manifest_ids(names: Iterable[str]) -> list[CheckpointId]:
    """The committed checkpoints a listing's ``names`` show (their manifests), oldest first."""
    ids = (parse_manifest_id(n) for n in names if n.startswith(f"{MANIFEST_DIR}/"))
    return sorted(cid for cid in ids if cid is not None)


def committed_ids(backend: Backend) -> list[CheckpointId]:
    """Every committed checkpoint on ``backend``, oldest first (the last one is the newest)."""
    kept = _LISTED.get()
    if kept is not None and kept.get(id(backend)) is not None:
        return list(kept[id(backend)] or ())
    ids = manifest_ids(backend.list(f"{MANIFEST_DIR}/"))
    if kept is not None and id(backend) in kept:
        kept[id(backend)] = list(ids)
    return ids


def newest_per_step(ids: Iterable[CheckpointId]) -> list[CheckpointId]:
    """One id per step, the one of the newest timeline holding it; oldest id first."""
    best: dict[int, CheckpointId] = {}
    for cid in ids:
        if cid.step not in best or cid > best[cid.step]:
            best[cid.step] = cid
    return sorted(best.values())


def steps_of(ids: Iterable[CheckpointId]) -> list[int]:
    """The steps of :func:`newest_per_step`, in that order (the last is the newest id's)."""
    return [cid.step for cid in newest_per_step(ids)]


def committed_steps(backend: Backend) -> list[int]:
    """Committed steps, one per step, in checkpoint order (oldest first, the last is the
    newest checkpoint's step). With one timeline this is ascending step order; after a
    rollback a step held by several timelines counts as the newest timeline's."""
    return steps_of(committed_ids(backend))


def data_ids(backend: Backend) -> list[CheckpointId]:
    """Checkpoints that have a data folder (committed or not)."""
    out = set()
    # v1 folders are under steps/, v2 ones also under hashed prefixes (tierckpt.layout)
    for name in [*backend.list(""), *backend.incomplete("")]:
        cid = parse_data_folder(name)
        if cid is not None:
            out.add(cid)
    return sorted(out)


def data_steps(backend: Backend) -> list[int]:
    """Steps that have a data folder (committed or not) on any timeline, ascending."""
    return sorted({cid.step for cid in data_ids(backend)})


def lineage(ids: Sequence[CheckpointId], start: CheckpointId | None = None) -> list[CheckpointId]:
    """``start`` (default: the newest of ``ids``) and the checkpoints it descends from,
    newest first: the older steps of its own timeline, then, on each older timeline, only the
    steps below the first step of the timeline that branched off it (the steps a resumed run
    went back past belong to the abandoned run, not to this one's history).

    This is the order in which ``load(fallback="previous")`` tries checkpoints.
    """
    if not ids:
        return []
    top = start if start is not None else max(ids)
    by_timeline: dict[int, list[CheckpointId]] = {}
    for cid in ids:
        if cid <= top:
            by_timeline.setdefault(cid.timeline, []).append(cid)
    out: list[CheckpointId] = []
    bound: int | None = None  # steps of older timelines must lie below this
    for timeline in sorted(by_timeline, reverse=True):
        mine = sorted(by_timeline[timeline], reverse=True)
        out.extend(c for c in mine if bound is None or c.step < bound)
        first = mine[-1].step
        bound = first if bound is None else min(bound, first)
    return out


#: per backend, the asks still running on a thread an earlier call left behind (its store
#: did not answer in time): (ask, the _Asking that started it, the tier's name there, thread)
_STILL_ASKING: weakref.WeakKeyDictionary[Backend, list[tuple[Callable[..., Any], Any, str, Any]]]
_STILL_ASKING = weakref.WeakKeyDictionary()
_STILL_LOCK = threading.Lock()


class _Asking(Generic[T]):
    """``ask(backend)`` of each ``(name, backend)``, each on a thread of its own (daemon, in a
    copy of the caller's context: :func:`listed_once` applies there too), started at once;
    ``inline``: one after another on the caller's thread instead.

    ``reuse`` (a listing for the caller to see, not a load or a timeline's choice): where the
    same ``ask`` of a backend is still running on the thread of an earlier call (its store
    did not answer within that call's wait, and the call has not returned), no second thread
    is started: a bounded wait does not wait for it again (``ck.steps()`` called in a loop
    during an outage costs one wait per blocked call, not one per call), and an unbounded one
    waits for that thread and takes its answer. A load or a timeline's choice asks again: a
    store that held one request may answer the next."""

    def __init__(
        self,
        tiers: Iterable[tuple[str, Backend]],
        ask: Callable[[Backend], T],
        *,
        inline: bool,
        reuse: bool = False,
    ):
        self.pairs = list(tiers)
        self._got: dict[str, tuple[bool, Any]] = {}
        self._threads: list[threading.Thread] = []
        #: name -> (the earlier _Asking, its name for the tier, its thread) for asks still
        #: running from before
        self._borrowed: dict[str, tuple[_Asking[T], str, threading.Thread]] = {}
        if inline:  # asked on this thread, to the end
            for name, backend in self.pairs:
                self._one(ask, name, backend)
            return
        for name, backend in self.pairs:
            with _STILL_LOCK:
                running = [
                    x for x in _STILL_ASKING.get(backend, []) if x[0] is ask and x[3].is_alive()
                ]
                if running and reuse:
                    self._borrowed[name] = running[0][1:]
                    continue
                th = threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self._one, ask, name, backend),
                    name=f"tierckpt-ask-{name}",
                    daemon=True,
                )
                _STILL_ASKING.setdefault(backend, []).append((ask, self, name, th))
            th.start()
            self._threads.append(th)

    def _one(self, ask: Callable[[Backend], T], name: str, backend: Backend) -> None:
        try:
            self._got[name] = (True, ask(backend))
        except BaseException as exc:
            self._got[name] = (False, exc)
        finally:
            with _STILL_LOCK:
                mine = _STILL_ASKING.get(backend, [])
                mine[:] = [x for x in mine if x[3] is not threading.current_thread()]

    def wait(self, seconds: float | None) -> None:
        """Until every tier answered, or ``seconds`` passed (None: no limit; then the asks
        still running from an earlier call are waited for too)."""
        end = None if seconds is None else time.monotonic() + seconds
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        if end is None:
            for _asking, _name, th in self._borrowed.values():
                th.join()

    def borrowed(self, name: str) -> bool:
        """Whether ``name``'s ask is one an earlier call left running (not started here)."""
        return name in self._borrowed

    def results(self) -> tuple[dict[str, T], dict[str, BaseException | None]]:
        """The answers by tier name, and the tiers that did not tell, with their error
        (None: no answer yet; a call that goes on in the background is not used)."""
        answers: dict[str, T] = {}
        silent: dict[str, BaseException | None] = {}
        for name, _backend in self.pairs:
            borrowed = self._borrowed.get(name)
            got = self._got if borrowed is None else borrowed[0]._got
            result = got.get(name if borrowed is None else borrowed[1])  # read once
            if result is not None and result[0]:
                answers[name] = result[1]
            else:
                silent[name] = None if result is None else result[1]
        return answers, silent


def ask_within(
    tiers: Iterable[tuple[str, Backend]], ask: Callable[[Backend], T], wait: float
) -> tuple[dict[str, T], dict[str, BaseException | None]]:
    """``ask(backend)`` of each ``(name, backend)``, each on a thread of its own, waited for at
    most ``wait`` seconds in all: the answers by tier name, and the tiers that did not tell,
    with their error (None: no answer in time; a store that hangs, whose call goes on in the
    background and is not used)."""
    asking = _Asking(tiers, ask, inline=False)
    asking.wait(wait)
    return asking.results()


def _left_out(
    backends: dict[str, Backend], silent: dict[str, BaseException | None], wait: float, what: str
) -> frozenset[str]:
    """Log each tier of ``silent`` (see :func:`ask_within`) that could not tell ``what``
    (one line per tier and error); their names. Errors other than a tier's
    (:class:`TierCkptError`, ``OSError``) are raised."""
    for name, exc in silent.items():
        if exc is None:
            log.warning(
                "tier %s did not answer %s within %.0f s (TIERCKPT_LEASE_WAIT_S): the next "
                "checkpoint goes on without it, and is checked against it before it is "
                "committed there",
                name,
                what,
                wait,
            )
        elif isinstance(exc, (TierCkptError, OSError)):
            report_once(
                backends[name],
                exc,
                "cannot ask tier %s %s (the next checkpoint goes on without it, and is checked "
                "against it before it is committed there): %s",
                name,
                what,
                exc,
            )
        else:
            raise exc
    return frozenset(silent)


def newest_committed_within(
    tiers: Iterable[tuple[str, Backend]], wait: float
) -> tuple[CheckpointId | None, frozenset[str]]:
    """The newest checkpoint committed on any of ``(name, backend)``, each tier listed on a
    thread of its own and waited for at most ``wait`` seconds in all (:func:`ask_within`),
    and the names of the tiers that did not tell: they could not be listed, or did not answer
    in time. Their newest is unknown, so a save on a timeline chosen without them must be
    checked against each of them before it is published there
    (``SavePath._confirm_timeline``): a store that hangs would otherwise hold ``save()`` for
    its listing's timeouts and retries (about a minute). Errors other than a tier's
    (:class:`TierCkptError`, ``OSError``) are raised."""
    pairs = list(tiers)
    listed, silent = ask_within(pairs, committed_ids, wait)
    unknown = _left_out(dict(pairs), silent, wait, "its listing of checkpoints")
    newest = max((ids[-1] for ids in listed.values() if ids), default=None)
    return newest, unknown


def committed_within(
    tiers: Iterable[tuple[str, Backend]], cid: CheckpointId, wait: float
) -> tuple[list[str], frozenset[str]]:
    """The tiers of ``(name, backend)`` where ``cid`` is committed (in the given order), each
    asked on a thread of its own for at most ``wait`` seconds in all, and those that did not
    tell (logged; as for :func:`newest_committed_within`)."""
    pairs = list(tiers)
    found, silent = ask_within(
        pairs, lambda b: b.exists(manifest_name(cid.step, timeline=cid.timeline)), wait
    )
    unknown = _left_out(dict(pairs), silent, wait, f"whether {cid} is committed there")
    return [name for name, _b in pairs if found.get(name)], unknown


def newer_than(backend: Backend, cid: CheckpointId) -> CheckpointId | None:
    """The newest checkpoint committed on ``backend`` if it is newer than ``cid``, else None:
    the check of a tier that could not be listed when ``cid``'s timeline was chosen, before
    ``cid`` is published there (its listing's errors are raised)."""
    ids = committed_ids(backend)
    return ids[-1] if ids and ids[-1] > cid else None


#: when a single writer chooses its timeline again after a ``StaleTimeline``
CHOOSES_AGAIN = "the next save chooses its timeline again with this tier in view"


def stale_timeline(
    cid: CheckpointId, tier: str, newer: CheckpointId, again: str = CHOOSES_AGAIN
) -> StaleTimeline:
    """The refusal to publish ``cid`` on ``tier``, which holds ``newer`` (:func:`newer_than`);
    ``again``: when the writer chooses its timeline again."""
    return StaleTimeline(
        f"step {cid.step} (timeline {cid.timeline}) is not published on tier {tier!r}: its "
        f"timeline was chosen while that tier could not be listed, and it holds a newer "
        f"checkpoint (step {newer.step}, timeline {newer.timeline}), which would make this copy "
        f"the older one there (its retention would remove it, a load would give the other). "
        f"The other tiers keep it; {again}"
    )


def timeline_for(step: int, newest: CheckpointId | None) -> int:
    """The timeline a save of ``step`` starts on, given the newest checkpoint there is.

    None: timeline 0. ``step`` after the newest's step: the newest's timeline (the run goes
    on). Otherwise the run went back (a rollback, or a new run in the same place): a new
    timeline, one above the newest's, logged; the checkpoints of the old timeline stay, older
    than every new one, until retention removes them.
    """
    if newest is None:
        return 0
    if step > newest.step:
        return newest.timeline
    if newest.timeline >= MAX_TIMELINE:
        raise ValueError(
            f"step {step} is not after the newest checkpoint ({newest}) and timeline "
            f"{MAX_TIMELINE} is the last one; delete the old timelines first"
        )
    log.info(
        "step %d is not after the newest checkpoint (step %d, timeline %d): starting timeline "
        "%d; the checkpoints of timeline %d are kept until retention removes them as older",
        step,
        newest.step,
        newest.timeline,
        newest.timeline + 1,
        newest.timeline,
    )
    return newest.timeline + 1


def list_tiers(
    tiers: Iterable[tuple[str, Backend]], wait: float | None = None, *, for_listing: bool = False
) -> tuple[dict[str, list[CheckpointId]], dict[str, str]]:
    """Each tier's committed checkpoints (:func:`committed_ids`) by name, each tier listed on
    a thread of its own, and the tiers that could not be listed with why (logged; their list
    is empty). A reader that finds nothing while the second is not empty raises
    :func:`unreadable`, not ``CheckpointNotFound``.

    ``wait`` (a load's): a tier that has not answered after ``wait`` seconds is left out
    where another tier listed a checkpoint (a store that hangs must not hold a restart for
    its timeouts and retries while the local disk holds the checkpoint); where none did, it
    is waited for to the end, as it is the only place one may be. ``for_listing``: for a listing
    (``ck.steps()``), not a load (what the warning says)."""
    pairs = list(tiers)
    # one tier: nothing to go on without, so no thread to start (a load's first step)
    asking = _Asking(pairs, committed_ids, inline=len(pairs) == 1, reuse=for_listing)
    asking.wait(wait)
    listed, silent = asking.results()
    if wait is not None and None in silent.values() and not any(listed.values()):
        asking.wait(None)
        listed, silent = asking.results()
    listing: dict[str, list[CheckpointId]] = {}
    unlisted: dict[str, str] = {}
    for name, _backend in asking.pairs:
        if name in listed:
            listing[name] = listed[name]
            continue
        exc = silent[name]
        if exc is None:
            why = f"it did not answer its listing within {wait:g} s (TIERCKPT_LEASE_WAIT_S)"
            # said once per blocked listing: later calls while it still runs say it quietly
            log.log(
                logging.DEBUG if asking.borrowed(name) else logging.WARNING,
                "tier %s left out of this %s: %s; %s (that tier may hold a newer one)",
                name,
                "listing" if for_listing else "load",
                why,
                "the other tiers' checkpoints are listed"
                if for_listing
                else "the newest checkpoint of the other tiers is loaded",
            )
        elif isinstance(exc, TierCkptError):
            why = str(exc)
            log.warning("cannot list tier %s: %s", name, exc)
        else:
            raise exc
        listing[name], unlisted[name] = [], why
    return listing, unlisted


def unreadable(
    unlisted: dict[str, str],
    names: Iterable[str],
    what: str,
    *,
    remedy: str = "name a tier you can read with tier=",
) -> TiersUnreadable:
    """The error of a listing or load that found nothing where tiers could not be listed
    (``unlisted``: name -> why; ``names``: every tier asked; ``what``: what the others lack):
    whether a checkpoint exists is unknown, so it is not a ``CheckpointNotFound``.
    ``remedy``: the other way out the message offers (the caller's own argument)."""
    listed = [n for n in names if n not in unlisted]
    why = "; ".join(f"{n}: {e}" for n, e in unlisted.items())
    others = f"on the other tiers ({', '.join(listed)}) {what}" if listed else "no other tier"
    return TiersUnreadable(
        f"cannot tell whether a checkpoint exists: tier {', '.join(map(repr, unlisted))} could "
        f"not be listed ({why}); {others}. This is not 'no checkpoint': restore access to the "
        f"store (endpoint, bucket, credentials) and load again, or {remedy}",
        unlisted,
    )
