"""Writer leases: one live writer per tier location and rank.

Two jobs pointed at the same run folder or S3 prefix would overwrite each other's shard files
and delete each other's saves in progress, so a writer (a ``Checkpointer`` or a
``tierckpt.dcp.TierWriter``) takes a *lease* on every tier before it writes anything there:
the object ``leases/rank-<r>.json`` (one per rank), created create-only. A second writer finds
it, sees that its owner is alive and is refused with :class:`WriterConflict`, before writing
a byte. Readers never take a lease.

Whether the owner is alive
    On the same machine (same host name, boot id and PID namespace): iff its process still
    runs — ``/proc/<pid>`` exists with the same start time. So a job killed with SIGKILL and
    restarted on the same node takes over at once. On the same kernel in another PID
    namespace (a restarted container), when the lease names the holder's lock file and it is
    the same file here: iff a process holds its ``flock`` (:mod:`tierckpt.liveness`).
    Elsewhere: iff the lease was renewed less than its ``ttl`` ago; the holder renews it every
    ``ttl / 4``. Such a holder is only *presumed* live (a job restarted on a new node finds
    its own dead predecessor's lease so), and a save does not raise for it: that tier's copy
    fails with a ``WriterConflict`` marked ``presumed`` (nothing written there; the other
    tiers save), the next save asks again, and the lease is taken over once past its ttl.
    A holder seen to renew its lease meanwhile is known live: ``save()`` raises then.
    The lease's age is the holder's clock against this machine's, so before a lease is
    taken over for its age, the store's clock is asked too (:func:`store_age`: the lease's
    modification time against an empty probe object's, both the store's): where the store
    wrote it within the ttl, its holder lives, and the refusal says by how much the two
    machines' clocks disagree. A clock ahead of the holder's never takes a live writer's
    location; one behind it only delays a takeover (the lease looks younger than it is).

Takeover
    A dead owner's lease is overwritten after re-reading that it is unchanged, then read back
    to check that this writer won (two writers taking over at once: one wins, the other is
    refused). It is logged as a warning.

Losing a lease
    Each renewal, and a check before every shard is published and before every retention pass,
    reads the lease back. Once it names another owner (taken over after this writer stalled
    for longer than the ttl, or removed by ``tierckpt unlock``), this writer has *lost* the
    tier for good: every later save there fails with :class:`LeaseLost` and it never deletes
    anything there again.

Without conditional PUT the create is a check-then-put; the read-back still catches two
writers unless they interleave exactly. A closed writer's lease its release could not delete
(the store hung) is taken over by the next writer of this process at once (liveness._closed).
No threads here: :mod:`tierckpt.pipeline` calls the thread-safe :class:`WriterLease` (one
lock; its backend calls block) from its tier threads. Knobs: ``TIERCKPT_LEASE_TTL`` (seconds,
default 60), ``TIERCKPT_LEASE_WAIT_S`` (a save's wait for the first acquisition, default 10).
"""

from __future__ import annotations

import gc
import logging
import math
import re
import threading
import time
import uuid

from tierckpt import config
from tierckpt.backends.base import Backend
from tierckpt.errors import (
    BackendError,
    CheckpointNotFound,
    FormatError,
    LeaseLost,
    WriterConflict,
)
from tierckpt.lease_refusal import (
    held_lease,
    lost_lease,
    other_tier,
    unlock_hint,
    unreadable_lease,
)
from tierckpt.liveness import (
    HostIdentity,
    LeaseRecord,
    LiveLock,
    in_this_process,
    owner_status,
    owner_verdict,
    process_start,
    releasing,
    reopened,
)
from tierckpt.reported import Outage

__all__ = [
    "LEASE_DIR",
    "HostIdentity",
    "LeaseRecord",
    "LiveLock",
    "WriterLease",
    "acquire_wait",
    "clock_probe_name",
    "judge_holder",
    "lease_name",
    "lease_ttl",
    "list_leases",
    "new_owner_id",
    "owner_status",
    "live_lock_name",
    "parse_lease_name",
    "process_start",
    "store_age",
]

log = logging.getLogger("tierckpt")

LEASE_DIR = "leases"
DEFAULT_TTL = config.DEFAULT_LEASE_TTL_S
DEFAULT_ACQUIRE_WAIT = config.DEFAULT_LEASE_WAIT_S
_LEASE_RE = re.compile(r"^leases/rank-(\d{6})\.json$")


def lease_name(rank: int) -> str:
    if type(rank) is not int or not 0 <= rank < 10**6:
        raise FormatError(f"rank must be an int in [0, 999999], got {rank!r}")
    return f"{LEASE_DIR}/rank-{rank:06d}.json"


def live_lock_name(rank: int) -> str:
    """The lock file beside rank ``rank``'s lease (:class:`tierckpt.liveness.LiveLock`)."""
    return lease_name(rank).removesuffix(".json") + ".live"


def parse_lease_name(name: str) -> int | None:
    m = _LEASE_RE.match(name)
    return int(m.group(1)) if m else None


def lease_ttl() -> float:
    """Seconds a lease of a writer on another machine stays valid without renewal."""
    return config.lease_ttl_s()


def acquire_wait() -> float:
    """Seconds a save waits for a first acquisition (a slow store) before going on."""
    return config.lease_wait_s()


def new_owner_id() -> str:
    """A fresh owner id: one per writer object (``Checkpointer``, ``TierWriter``)."""
    return uuid.uuid4().hex


def read_lease(backend: Backend, rank: int) -> tuple[bytes, LeaseRecord] | None:
    """The lease of ``rank`` (raw bytes and record), or None when there is none.
    An object there that is not a lease raises ``FormatError``."""
    name = lease_name(rank)
    try:
        raw = bytes(backend.get(name))
    except CheckpointNotFound:
        return None
    return raw, LeaseRecord.decode(raw, where=f"{backend.url}/{name}")


def clock_probe_name(owner: str) -> str:
    """The empty object a writer puts for a moment to read the store's clock (store_age)."""
    return f"{LEASE_DIR}/clock-{owner}.probe"


def store_age(backend: Backend, name: str, probe: str) -> float | None:
    """Seconds since the store last wrote ``name``, by the store's own clock: ``name``'s
    modification time against that of ``probe``, an empty object written now and deleted
    again. None where the store keeps no modification times (:meth:`Backend.modified`)."""
    then = backend.modified(name)
    if then is None:
        return None
    backend.put_atomic(probe, b"", overwrite=True)
    try:
        now = backend.modified(probe)
    finally:
        backend.delete(probe)
    return None if now is None else now - then


def judge_holder(
    backend: Backend, name: str, rec: LeaseRecord, owner: str | None = None
) -> tuple[bool, str, bool]:
    """(alive, why, presumed) for the holder of lease ``name`` (``rec``), as a writer about to
    take it over and ``tierckpt ls`` / ``gc`` / ``unlock`` judge it: by its process or lock
    file where this machine can ask (:func:`~tierckpt.liveness.owner_verdict`), else by its
    age; ``presumed``: a live verdict resting on the age alone (live until its ttl has passed).

    The age is the holder's clock against this machine's: one ahead by more than the ttl makes
    a live writer look dead. So a lease its age says is dead is judged again by the store's
    clock (:func:`store_age`): written within its ttl, its holder lives. Where the store keeps
    no times or the probe fails (read-only credentials), the age stands. ``owner``: names the
    probe object (a fresh id where None)."""
    alive, why, by_age = owner_verdict(rec, where=f"{backend.url}/{name}")
    if alive or not by_age:
        return alive, why, alive and by_age
    probe = clock_probe_name(owner or new_owner_id())
    try:
        age = store_age(backend, name, probe)
    except Exception as exc:
        log.debug("%s/%s: the store's clock could not be read (%s)", backend.url, name, exc)
        return False, why, False
    if age is None or age >= rec.ttl:
        return False, why, False
    wall = time.time() - rec.renewed
    return (
        True,
        (
            f"the store wrote it {max(age, 0.0):.0f} s ago, within its ttl of {rec.ttl:.0f} s, "
            f"though the renewal time it holds is {wall:.0f} s old by this machine's clock: "
            f"this machine's clock and the writer's disagree by about {wall - age:.0f} s, so "
            "its age says nothing (set both clocks right: NTP), or the folder was copied here "
            "with new file times (cp -r, scp, rsync without -t: then wait out the ttl, or run "
            "`tierckpt unlock`)"
        ),
        True,
    )


def list_leases(backend: Backend) -> list[tuple[int, LeaseRecord | None, str]]:
    """Every lease on ``backend``: (rank, record, "") or (rank, None, why unreadable)."""
    out: list[tuple[int, LeaseRecord | None, str]] = []
    for name in backend.list(f"{LEASE_DIR}/"):
        rank = parse_lease_name(name)
        if rank is None:
            continue
        try:
            got = read_lease(backend, rank)
        except (FormatError, OSError) as exc:
            out.append((rank, None, str(exc)))
            continue
        if got is not None:
            out.append((rank, got[1], ""))
    return out


class WriterLease:
    """This writer's lease on one tier location for one rank (see the module docstring).

    ``acquire()`` at the first save, ``renew_if_due()`` from the tier's writer thread,
    ``verify()`` before publishing a shard and before retention, ``release()`` at close.
    """

    def __init__(
        self,
        backend: Backend,
        tier: str,
        rank: int,
        owner: str,
        ttl: float,
        live: LiveLock | None = None,
    ) -> None:
        self.backend = backend
        #: this writer's lock file for ``rank``, named in the lease (tierckpt.liveness)
        self.live = live
        self.tier = tier
        self.rank = rank
        self.owner = owner
        self.ttl = ttl
        self.name = lease_name(rank)
        self.held = False
        #: set once another owner took the lease over: this writer never writes here again
        self.lost: LeaseLost | None = None
        #: whether acquire() ran at least once, and how its last attempt failed
        self.attempted = False
        self.last_error: BaseException | None = None
        self._started = 0.0
        #: (owner, renewal time) of the other writer's lease when it was first found and
        #: only presumed live: a later renewal time of the same owner proves it runs
        self._watching: tuple[str, float] | None = None
        #: the bytes of an unreadable object at the lease's name when last seen
        self._unreadable: bytes | None = None
        self._next_renewal = math.inf  # time.monotonic() of the next renewal
        #: renewals failing while the store is down: said once, and when one works again
        self._renewals = Outage()
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"tier {self.tier!r} ({self.backend.url})"

    def next_renewal(self) -> float:
        """``time.monotonic()`` at which :meth:`renew_if_due` has work (inf: none)."""
        return self._next_renewal if self.held and self.lost is None else math.inf

    # -- acquire -----------------------------------------------------------------------
    def acquire(self) -> None:
        """Take the lease; no-op when held. Raises :class:`WriterConflict` when a live
        owner holds it, :class:`LeaseLost` when this writer lost it earlier, and the
        backend's error when the store cannot be reached (try again at the next save)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.held:
                return
            self.attempted = True
            try:
                self._acquire()
            except BaseException as exc:
                self.last_error = exc
                raise
            self.last_error = None
            self.held = True
            reopened(self.owner, f"{self.backend.url}/{self.name}")
            self._next_renewal = time.monotonic() + self.ttl / 4

    def _acquire(self) -> None:
        b, name = self.backend, self.name
        live = self.live.take() if self.live is not None else None
        collected = False
        for _ in range(5):
            mine = LeaseRecord.mine(self.owner, self.ttl, live=live)
            self._started = mine.started
            try:
                b.put_atomic(name, mine.encode())
            except FileExistsError:
                pass
            else:
                if self._owner_now() == self.owner:  # a server without conditional PUT
                    return
                continue
            try:
                got = read_lease(b, self.rank)
            except FormatError as exc:
                if self._unreadable_expired(exc):
                    b.put_atomic(name, mine.encode(), overwrite=True)
                    if self._owner_now() == self.owner:
                        return
                continue
            if got is None:
                continue  # released meanwhile: create again
            raw, rec = got
            if rec.owner == self.owner:
                return
            if (refused := other_tier(self, rec)) is not None:  # another tier of this writer
                raise refused
            alive, why, presumed = judge_holder(b, name, rec, self.owner)
            if alive and not collected and in_this_process(rec):
                # a writer of this process dropped unclosed in a cycle: collected, it closes
                collected = True
                gc.collect()
                continue
            if alive:
                raise self._conflict(rec, why, presumed)
            again = read_lease(b, self.rank)
            if again is None or again[0] != raw:
                continue  # changed under us: judge the new content
            log.warning(
                "%s: taking over rank %d's lease from a dead writer (%s; %s)",
                self.where,
                self.rank,
                rec.describe(),
                why,
            )
            b.put_atomic(name, mine.encode(), overwrite=True)
            if self._owner_now() == self.owner:
                return
        raise WriterConflict(
            f"{self.where}: rank {self.rank}'s lease {name} kept changing while this writer "
            f"tried to take it: another writer is starting here. {unlock_hint(b)}",
            tier=self.tier,
            url=b.url,
        )

    def _unreadable_expired(self, exc: FormatError) -> bool:
        """An object at this lease's name that is no lease tierckpt can read (damaged, or a
        newer tierckpt's): True once the store has not written it for the ttl (taken over,
        logged); else a :class:`WriterConflict` is raised, presumed where nothing shows a
        writer behind it, known live where its bytes changed while this writer watched."""
        b, name = self.backend, self.name
        try:
            raw = bytes(b.get(name))
        except CheckpointNotFound:
            return False  # gone meanwhile: create again
        age = store_age(b, name, clock_probe_name(self.owner))
        changed = self._unreadable is not None and self._unreadable != raw
        self._unreadable = raw
        if age is not None and age >= self.ttl and not changed:
            log.warning(
                "%s: taking over rank %d's lease: %s is no lease tierckpt can read (%s) and "
                "the store has not written it for %.0f s (ttl %.0f s)",
                self.where,
                self.rank,
                name,
                exc,
                age,
                self.ttl,
            )
            return True
        raise unreadable_lease(
            self.where, name, exc, age, self.ttl, changed, self.tier, b.url, unlock_hint(b)
        )

    def _conflict(self, rec: LeaseRecord, why: str, presumed: bool) -> WriterConflict:
        """The refusal of a lease held by ``rec``'s writer. Where that writer is only
        presumed live (its lease's age, no process or lock file to ask), its renewal time is
        watched: seen to move on, the writer is known live."""
        if presumed:
            seen = self._watching
            if seen is not None and seen[0] == rec.owner and seen[1] != rec.renewed:
                presumed = False
                why += "; it renewed its lease since this writer first found it, so that job runs"
            elif seen is None or seen[0] != rec.owner:
                self._watching = (rec.owner, rec.renewed)
        b = self.backend
        hint = unlock_hint(b, same_process="in this process" in why)
        return held_lease(
            self.where, self.rank, self.name, rec, why, presumed, self.tier, b.url, hint
        )

    def _owner_now(self) -> str | None:
        """The owner named by the stored lease now (None: no lease; '?': unreadable)."""
        try:
            got = read_lease(self.backend, self.rank)
        except FormatError:
            return "?"
        return None if got is None else got[1].owner

    # -- hold --------------------------------------------------------------------------
    def _lose(
        self, why: str, removed: bool = False, holder: LeaseRecord | None = None
    ) -> LeaseLost:
        self.held = False
        self._next_renewal = math.inf
        self.lost = lost_lease(self, why, removed, holder)
        log.error("%s", self.lost)
        return self.lost

    def _check_ours(self) -> None:
        """Raise (and mark the lease lost) when the stored lease is not ours."""
        try:
            got = read_lease(self.backend, self.rank)
        except FormatError as exc:  # not lost for one bad answer (a proxy, a portal): this
            # writer writes nothing there until the lease reads as its own again
            raise BackendError(
                f"{self.where}: rank {self.rank}'s lease {self.name} could not be read "
                f"({exc}); nothing is written there until it reads as this writer's again (an "
                "answer not from the store: a proxy or portal in the way? or another "
                "release's lease: `tierckpt ls` the location)"
            ) from None
        if got is None:
            raise self._lose("it was removed (tierckpt unlock?)", removed=True)
        if got[1].owner != self.owner:
            raise self._lose(f"another writer took it over: {got[1].describe()}", holder=got[1])

    def verify(self) -> None:
        """Check that the stored lease is still ours; raise :class:`LeaseLost` if not (and
        :class:`WriterConflict` when it was never acquired)."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if not self.held:
                raise WriterConflict(
                    f"{self.where}: this writer holds no lease there (its acquisition failed)",
                    tier=self.tier,
                    url=self.backend.url,
                )
            self._check_ours()

    def renew_if_due(self) -> None:
        """Renew when ``ttl / 4`` has passed: check it is still ours, then overwrite it with
        a fresh renewal time. A store that cannot be reached is retried every ``ttl / 16``:
        logged at the first failure of each outage (then at DEBUG), and when it works again."""
        with self._lock:
            if not self.held or self.lost is not None:
                return
            now = time.monotonic()
            if now < self._next_renewal:
                return
            try:
                self._check_ours()
                live = self.live.take() if self.live is not None else None
                rec = LeaseRecord.mine(self.owner, self.ttl, started=self._started, live=live)
                self.backend.put_atomic(self.name, rec.encode(), overwrite=True)
            except LeaseLost:
                return
            except Exception as exc:
                self._next_renewal = now + self.ttl / 16
                self._renewals.failed(
                    "%s: could not renew this writer's lease (retried every %.2g s; said again "
                    "when it works): %s",
                    self.where,
                    self.ttl / 16,
                    exc,
                )
                return
            self._renewals.worked("%s: renewed this writer's lease again", self.where)
            self._next_renewal = now + self.ttl / 4

    def release(self) -> None:
        """Delete the lease if it is still ours (at close). Never raises."""
        with self._lock:
            if not self.held or self.lost is not None:
                return
            self.held = False
            self.attempted = False  # a later save waits for its acquisition again
            self._next_renewal = math.inf
            try:
                with releasing(self.owner, f"{self.backend.url}/{self.name}"):
                    if self._owner_now() == self.owner:
                        self.backend.delete(self.name)
            except Exception as exc:
                log.warning("%s: could not release this writer's lease: %s", self.where, exc)
