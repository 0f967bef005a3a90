"""This writer's leases (:mod:`tierckpt.lease`), one per (tier, rank), owned by one pipeline.

Taken on the tier's own thread (so a slow store delays only that tier), renewed there every
``ttl / 4``, checked before publishing and before retention, released at ``close()``."""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

from tierckpt.backends.base import Backend
from tierckpt.errors import WriterConflict
from tierckpt.lease import (
    LEASE_DIR,
    WriterLease,
    acquire_wait,
    lease_ttl,
    live_lock_name,
    new_owner_id,
)
from tierckpt.lease_refusal import tier_owner
from tierckpt.liveness import LiveLock
from tierckpt.pipeline._values import SaveJob, Tier
from tierckpt.reported import RETENTION, report_once

log = logging.getLogger("tierckpt")

#: how long close() waits to give a lease back (a healthy store answers in milliseconds)
RELEASE_WAIT_S = 10.0

#: hands a lease take to a tier's thread: (tier, rank, step, future set with the outcome:
#: None, taken; else why not — WriterConflict: another live writer holds it; anything else:
#: the store failed)
LeaseRequest = Callable[[Tier, int, int, "Future[BaseException | None]"], None]


def lock_backend(tiers: Sequence[Tier]) -> Backend | None:
    """Where this writer keeps its lock files (tierckpt.liveness): the first local folder among
    its tiers, node RAM only when it has no other (None: no local folder, leases are judged
    by their age alone)."""
    folders = [t.backend for t in tiers if t.backend.local_path(LEASE_DIR) is not None]
    folders.sort(key=lambda b: b.is_node_local)  # stable: policy order within each kind
    return folders[0] if folders else None


class Leases:
    """The lease table of one writer: (tier name, rank) -> :class:`WriterLease`."""

    def __init__(self, tiers: Sequence[Tier] = ()) -> None:
        #: one owner id per writer object (a pipeline lives as long as its owner's writing)
        self.owner = new_owner_id()
        #: the process that takes and gives back these leases: a copy inherited through fork
        #: never gives them back (they are the parent's, still writing)
        self._pid = os.getpid()
        self.ttl = lease_ttl()
        self._lock = threading.Lock()
        self._table: dict[tuple[str, int], WriterLease] = {}
        self._locks_on = lock_backend(tiers)
        #: rank -> this writer's lock file for it, shared by its leases on every tier
        self._live: dict[int, LiveLock] = {}
        #: (tier name, rank) -> a first take queued ahead of its save (:meth:`take_early`)
        self._early: dict[tuple[str, int], tuple[int, Future[BaseException | None], float]] = {}

    def get(self, tier: Tier, rank: int) -> WriterLease:
        """This writer's lease on ``tier`` for ``rank`` (made, not taken, on first use)."""
        with self._lock:
            lease = self._table.get((tier.name, rank))
            if lease is None:
                live = self._live.get(rank)
                path = None if live else self._local_path(live_lock_name(rank))
                if path is not None:
                    live = self._live[rank] = LiveLock(path)
                owner = tier_owner(self.owner, tier.name)
                lease = WriterLease(tier.backend, tier.name, rank, owner, self.ttl, live)
                self._table[(tier.name, rank)] = lease
            return lease

    def _local_path(self, name: str) -> str | None:
        return None if self._locks_on is None else self._locks_on.local_path(name)

    def holds(self, rank: int) -> bool:
        """Whether this writer holds a lease for ``rank`` on any tier."""
        with self._lock:
            return any(x.held for (_, r), x in self._table.items() if r == rank)

    def of_tier(self, tier: str) -> list[WriterLease]:
        with self._lock:
            return [lease for (name, _), lease in self._table.items() if name == tier]

    def take_early(
        self, tiers: Sequence[Tier], rank: int, step: int, request: LeaseRequest
    ) -> None:
        """Queue the first take of this writer's lease on each of ``tiers`` not attempted yet,
        ahead of the save of ``step`` (while it lists the tiers, say): :meth:`acquire` then
        waits for these takes instead of starting its own, so a store that does not answer
        costs the save one wait, not the listing's and then the lease's."""
        for t in tiers:
            lease = self.get(t, rank)
            with self._lock:
                if lease.attempted or lease.held or (t.name, rank) in self._early:
                    continue
                fut: Future[BaseException | None] = Future()
                self._early[(t.name, rank)] = (step, fut, time.monotonic())
            request(t, rank, step, fut)

    def claim(
        self, tiers: Sequence[Tier], rank: int, step: int, request: LeaseRequest
    ) -> WriterConflict | None:
        """Take this writer's lease for ``rank`` on each of ``tiers`` not held yet, ahead of
        the save of ``step``, and wait for the takes (at most the lease wait): the refusal
        of a writer known live when one answers so (what this call took is given back),
        else None. Takes that had not ended by then, or that failed otherwise, are left
        for :meth:`acquire`, which fails that tier's copy as it would have."""
        futs: dict[str, Future[BaseException | None]] = {}
        now = time.monotonic()
        for t in tiers:
            lease = self.get(t, rank)
            if lease.held or lease.lost is not None:
                continue
            with self._lock:
                early = self._early.get((t.name, rank))
                if early is not None and early[0] == step and not early[1].done():
                    futs[t.name] = early[1]  # a take of this save still going on
                    continue
                fut: Future[BaseException | None] = Future()
                self._early[(t.name, rank)] = (step, fut, now)
            futs[t.name] = fut
            request(t, rank, step, fut)
        if not futs:
            return None
        done, _ = wait_futures(futs.values(), timeout=acquire_wait())
        conflicts = [
            r for f in done if isinstance(r := f.result(), WriterConflict) and not r.presumed
        ]
        if not conflicts:
            return None
        with self._lock:
            for name in futs:
                self._early.pop((name, rank), None)
        self._give_back_taken(tiers, rank, {n: f for n, f in futs.items() if f in done})
        return conflicts[0]

    def _give_back_taken(
        self, tiers: Sequence[Tier], rank: int, takes: dict[str, Future[BaseException | None]]
    ) -> None:
        """Give back the leases ``takes`` took (a save refused: it writes nothing), and the
        rank's lock file once it holds no lease (taken again at the next attempt)."""
        for t in tiers:
            got = takes.get(t.name)
            if got is not None and got.done() and got.result() is None:
                self.get(t, rank).release()
        with self._lock:
            live = self._live.get(rank)
        if live is not None and not self.holds(rank):
            live.release()

    def acquire(self, job: SaveJob, request: LeaseRequest) -> set[str]:
        """See :meth:`Pipeline.acquire_leases`; ``request`` queues a take on a tier's thread.
        Returns the tiers whose first take did not end within the wait."""
        waits: dict[str, Future[BaseException | None]] = {}
        now = time.monotonic()
        end = now  # the waits end acquire_wait() after the latest take started
        for t in job.tiers:
            lease = self.get(t, job.rank)
            with self._lock:
                step, fut, since = self._early.pop((t.name, job.rank), (None, None, now))
            if step != job.step:  # none, or queued by a save() that raised before this one
                fut, since = None, now
            if fut is None:
                if lease.held or lease.lost is not None:
                    continue
                fut = Future()
                if not lease.attempted or isinstance(lease.last_error, WriterConflict):
                    waits[t.name] = fut
                    end = max(end, now + acquire_wait())
                request(t, job.rank, job.step, fut)
            elif not (fut.done() and fut.result() is None):
                waits[t.name] = fut  # a first take, queued early: still a first attempt
                end = max(end, since + acquire_wait())
            # a failed take fails this job's copy there (its start does not try again);
            # run by the tier thread as the take ends, before it starts this job's copy
            fut.add_done_callback(functools.partial(_take_failed, job, t.name))
        if not waits:
            return set()
        done, _ = wait_futures(waits.values(), timeout=max(0.0, end - time.monotonic()))
        refused = [r for f in done if isinstance(r := f.result(), WriterConflict)]
        # a writer known live (its process, its lock file, a renewal seen): nothing is saved.
        # One only presumed live (its lease's age): that tier's copy fails with it
        # (_take_failed), the other tiers save, and the next save asks again
        conflicts = [r for r in refused if not r.presumed]
        if not conflicts:
            return {name for name, fut in waits.items() if fut not in done}
        # give back what this call took: this save writes nothing
        self._give_back_taken(job.tiers, job.rank, {n: f for n, f in waits.items() if f in done})
        raise conflicts[0]  # type: ignore[misc]

    def take(self, tier: Tier, rank: int, step: int, fut: Future[BaseException | None]) -> bool:
        """Tier thread: take this writer's lease on ``tier`` (a no-op when held) for the save
        of ``step``; ``fut`` gets the outcome. False when the store failed (a live other
        writer's refusal is an answer: True)."""
        try:
            self.get(tier, rank).acquire()
        except WriterConflict as exc:
            fut.set_result(exc)
            return True
        except Exception as exc:
            report_once(
                tier.backend,
                exc,
                "step %d: cannot take this writer's lease on tier %s (its copy of this step "
                "fails; tried again at the next save): %s",
                step,
                tier.name,
                exc,
            )
            fut.set_result(exc)
            return False
        fut.set_result(None)
        return True

    def renew(self, tier: Tier) -> None:
        """Tier thread: renew this tier's leases that are due (cheap when none is)."""
        now = time.monotonic()
        for lease in self.of_tier(tier.name):
            if lease.next_renewal() <= now:
                lease.renew_if_due()

    def renewal_timeout(self, tier: Tier) -> float | None:
        """Seconds until this tier's next renewal is due (None: it holds no lease)."""
        due = min((lease.next_renewal() for lease in self.of_tier(tier.name)), default=math.inf)
        return None if due == math.inf else max(0.0, due - time.monotonic())

    def may_collect(self, tier: Tier, rank: int) -> bool:
        """See :meth:`Pipeline.may_collect`."""
        with self._lock:
            lease = self._table.get((tier.name, rank))
        if lease is None:
            return False
        try:
            lease.verify()
        except Exception as exc:  # at every commit while it lasts: reported once
            report_once(
                tier.backend,
                exc,
                "retention on tier %s skipped: %s",
                tier.name,
                exc,
                topic=RETENTION,
            )
            return False
        return True

    def release_all(
        self,
        wait: float | None = None,
        *,
        tiers: Collection[str] | None = None,
        locks: bool = True,
    ) -> None:
        """Delete this writer's leases that are still its own (close, exit), then let its
        lock files go: from then on it writes nothing, whatever a lease left behind says.

        ``wait``: each lease is given back on a thread of its own, waited for at most that
        long in all (a store that does not answer must not hold ``close()`` for its timeouts
        and retries); one not given back by then is left to expire after its ttl (logged).
        ``tiers``: only the leases on these tiers (None: all); ``locks=False`` keeps the lock
        files (a tier still in a call: its lease must not be judged dead meanwhile)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            leases = [x for (name, _), x in self._table.items() if tiers is None or name in tiers]
            held = list(self._live.values()) if locks else []
            # a take queued ahead of a save (take_early, claim) is no lease once given back
            for key in [k for k in self._early if tiers is None or k[0] in tiers]:
                del self._early[key]
        if wait is None:
            for lease in leases:
                lease.release()
        else:
            threads = [
                threading.Thread(target=lease.release, name="tierckpt-release", daemon=True)
                for lease in leases
            ]
            for th in threads:
                th.start()
            end = time.monotonic() + wait
            for th, lease in zip(threads, leases, strict=True):
                th.join(max(0.0, end - time.monotonic()))
                if th.is_alive():
                    log.warning(
                        "%s: this writer's lease was not given back within %.0f s (the store "
                        "does not answer); it expires after its ttl (%.0f s), which a new "
                        "writer there waits for",
                        lease.where,
                        wait,
                        lease.ttl,
                    )
        for live in held:
            live.release()


def _take_failed(job: SaveJob, tier: str, fut: Future[BaseException | None]) -> None:
    """Record on ``job`` why its lease on ``tier`` was not taken (nothing when it was)."""
    why = fut.result()
    if why is not None:
        job.lease_errors[tier] = why
