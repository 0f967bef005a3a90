"""Deadlines and follower bounds: a tier that makes no progress while a save waits for it is
*given up* for that save (its arena slots released, its copy failed with
:class:`SaveDeadlineExceeded`, never committed), and a follower tier holds at most
``max_behind`` of its source's steps (older waiting copies are skipped: :class:`CopySkipped`).

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import math
import time

from tierckpt.errors import CopySkipped, SaveDeadlineExceeded
from tierckpt.pipeline._base import _PipelineBase
from tierckpt.pipeline._values import RETRY_GRACE_S, SaveJob, Tier, _ChunkState


class _StallMixin(_PipelineBase):
    def _stall_timeout(self) -> float | None:
        """How long capture may wait for arena space before the next stalled-tier check."""
        d = self.save_deadline
        if math.isinf(d):
            return None
        now = time.monotonic()
        due = [since + d - now for since in self._holders_idle_since(now)]
        return max(0.01, min(due)) if due else min(d, 1.0)

    def _slots_held_stalled(self, seconds: float) -> int:
        """How many arena slots tiers without progress for ``seconds`` hold."""
        now = time.monotonic()
        with self._lock:
            late = {n for n, t in self._stalled_since.items() if now - t >= seconds}
            return sum(1 for st in self._held_chunks if late & st.holders) if late else 0

    def _holders_idle_since(self, now: float) -> list[float]:
        """Since when each tier holding arena slots has made no progress (``now``: it has)."""
        with self._lock:
            holding = {name for st in self._held_chunks for name in st.holders}
            return [self._stalled_since.get(name, now) for name in holding]

    def _give_up_stalled(self, *, drain: bool = False) -> None:
        """Give up the copies of the tiers that made no progress for ``save_deadline`` s.

        From capture (``drain=False``): the copies whose arena slots such a tier holds, which
        frees those slots. From :meth:`drain`: every copy of such a tier not yet committing.
        """
        d = self.save_deadline
        if math.isinf(d):
            return
        now = time.monotonic()
        verdicts: list[tuple[Tier, SaveJob, BaseException]] = []
        released: list[_ChunkState] = []
        with self._lock:
            stalled = {n: now - t for n, t in self._stalled_since.items() if now - t >= d}
            if not stalled:
                return
            if drain:
                pairs = [(t, j) for j in self._in_flight for t in j.tiers if t.name in stalled]
                what = "close()/wait() waited for it"
            else:
                pairs = [
                    (self._by_name[n], st.job)
                    for st in self._held_chunks
                    for n in st.holders
                    if n in stalled
                ]
                what = "the capture of a save waited for host arena slots this tier still holds"
            seen: set[tuple[str, int]] = set()
            for tier, job in pairs:
                if (tier.name, id(job)) in seen:
                    continue
                seen.add((tier.name, id(job)))
                err = SaveDeadlineExceeded(
                    f"{job.id}: tier {tier.name!r} ({tier.backend.url}) made no progress "
                    f"for {stalled[tier.name]:.1f} s, past save_deadline={d:g} s, while {what}; "
                    "its copy of this step is given up (it never commits there) so training "
                    "goes on, and the next save tries the tier again. If the tier is down, its "
                    "own errors are in the log; if it is only slow, raise save_deadline "
                    "(TIERCKPT_SAVE_DEADLINE) or let it copy from a local tier (source=...)"
                )
                if self._give_up_locked(tier, job, err, released):
                    verdicts.append((tier, job, err))
        self._release_slots(released)
        for t, j, why in verdicts:
            self._report_given_up(t, j, why)

    def give_up(self, copies: list[tuple[Tier, SaveJob, BaseException]]) -> None:
        """Give up each (tier, job, why) copy not yet committing or done: its arena slots are
        released and it is reported failed with ``why`` now (it never commits there)."""
        verdicts: list[tuple[Tier, SaveJob, BaseException]] = []
        released: list[_ChunkState] = []
        with self._lock:
            for tier, job, why in copies:
                if self._give_up_locked(tier, job, why, released):
                    verdicts.append((tier, job, why))
        self._release_slots(released)
        for t, j, why in verdicts:
            self._report_given_up(t, j, why)

    def _give_up_locked(
        self, tier: Tier, job: SaveJob, err: BaseException, released: list[_ChunkState]
    ) -> bool:
        """Record that ``tier`` gives ``job`` up and drop its holds on arena slots (the lock is
        held). False if it is too late: the copy started committing or is done already."""
        name = tier.name
        if name in job.given_up or name in job.settled or job.handle.done(name):
            return False
        job.given_up[name] = err
        if not isinstance(err, CopySkipped):  # a skip is a follower's bound, not a silence
            self._given_up_at[name] = time.monotonic()
        self._unfollow_locked(name, job)
        for st in list(self._held_chunks):
            if st.job is job and name in st.holders:
                st.holders.discard(name)
                if not st.holders:
                    self._held_chunks.remove(st)
                    released.append(st)
        return True

    def _release_slots(self, states: list[_ChunkState]) -> None:
        for st in states:
            st.encoded.clear()
            assert self.arena is not None
            self.arena.release(st.slot)

    def _report_given_up(self, tier: Tier, job: SaveJob, err: BaseException) -> None:
        """Report a given-up copy now (the tier's thread may stay blocked for a while)."""
        self._source_done(tier, job, None, err)
        outcome = "skipped" if isinstance(err, CopySkipped) else "deadline"
        self._finish(tier, job, None, err, outcome=outcome, defer_hooks=True)

    def _check_given_up(self, tier: Tier, job: SaveJob) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
        if err is not None:
            raise err

    def _enter_commit(self, tier: Tier, job: SaveJob) -> None:
        """From here on ``tier``'s copy of ``job`` can no longer be given up (or it was)."""
        with self._lock:
            err = job.given_up.get(tier.name)
            if err is None:
                job.settled.add(tier.name)
                self._unfollow_locked(tier.name, job)  # the source's file is read: let it go
        if err is not None:
            raise err

    def _register_follows(self, job: SaveJob) -> None:
        """A follower holds at most ``max_behind`` source steps: skip its oldest waiting ones."""
        skipped: list[tuple[Tier, SaveJob, BaseException]] = []
        released: list[_ChunkState] = []
        with self._lock:
            for name, follow in job.follows.items():
                tier = self._by_name[name]
                held = self._following.setdefault(name, [])
                held.append(job)
                active = self._follow_active.get(name)
                waiting = [j for j in held if j is not active]
                for old in waiting[: max(0, len(held) - tier.spec.max_behind)]:
                    src = follow.source.name
                    doing = f"still on {active.id}" if active is not None else "busy"
                    err = CopySkipped(
                        f"{old.id}: tier {name!r} skipped its copy from tier {src!r}: it "
                        f"would hold more than max_behind={tier.spec.max_behind} steps of tier "
                        f"{src!r} ({doing}); tier {src!r} keeps {old.id} only under its "
                        f"own retention and tier {name!r} copies a newer step next. Its own "
                        "errors, if any, are in the log"
                    )
                    if self._give_up_locked(tier, old, err, released):
                        skipped.append((tier, old, err))
        self._release_slots(released)
        for t, j, why in skipped:
            self._report_given_up(t, j, why)

    def _unfollow_locked(self, name: str, job: SaveJob) -> None:
        held = self._following.get(name)
        if held is not None and job in held:
            held.remove(job)
        if self._follow_active.get(name) is job:
            del self._follow_active[name]

    def _tier_busy(self, tier: Tier, *, progressed: bool, idle: bool) -> None:
        """Track the tier thread's progress for the deadline. A clock runs from when it is
        handed work while it makes none: each chunk written or item finished resets it, failures and
        skips do not. Idle after progress the clock stops; idle after a failure (presumed
        down) it keeps running, and the next save gives the tier a short grace instead of a
        whole deadline (:meth:`_grace`)."""
        now = time.monotonic()
        with self._lock:
            if idle:
                self._busy.discard(tier.name)
                if progressed:
                    self._stalled_since.pop(tier.name, None)
            else:
                self._busy.add(tier.name)
                if progressed or tier.name not in self._stalled_since:
                    self._stalled_since[tier.name] = now

    def _grace(self, job: SaveJob) -> None:
        """A new save for an idle tier presumed down (its last work failed, no progress
        since): it has ``min(save_deadline, 5 s)`` to show progress before capture gives it
        up, so an outage costs each save that long, not a whole deadline; while its thread
        is still blocked in a call, the old clock runs on and later saves give it up at once."""
        d = self.save_deadline
        floor = time.monotonic() - d + min(d, RETRY_GRACE_S)
        with self._lock:
            for t in job.tiers:
                since = self._stalled_since.get(t.name)
                if since is not None and t.name not in self._busy:
                    self._stalled_since[t.name] = max(since, floor)
