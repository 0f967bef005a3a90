"""Retention after a commit: which checkpoints a tier's pass must keep besides its rules, and
when the pass runs.

A copy is reported done (``h.wait()``, ``Checkpointer.wait()``) as soon as it is durable and
committed; the pass that deletes the older checkpoints its rules no longer keep runs right
after, on the same thread (the tier's writer, or the commit thread of a deferred multi-rank
commit), before that thread takes its next job. So a save is never slower to become durable
because old checkpoints are being listed and deleted, and the deletions still happen in
commit order, one pass at a time per tier. :meth:`wait_retention` waits for the passes that
have started (``Checkpointer.wait(retention=True)``); ``close()`` always does, as it joins
those threads.

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter
from collections.abc import Collection

from tierckpt.backends.base import Backend
from tierckpt.errors import BackendError
from tierckpt.format import CheckpointId
from tierckpt.handle import TierResult
from tierckpt.pipeline._base import _PipelineBase
from tierckpt.pipeline._values import SaveJob, Tier
from tierckpt.reported import RETENTION, forget_causes, report_once
from tierckpt.retention import gc_tier

log = logging.getLogger("tierckpt")

#: per thread, pipeline id -> the passes this thread has counted and not yet run: a callback
#: inside the report (``on_commit``) or the pass (``protect_steps``) that lists the
#: checkpoints must not wait for the pass its own thread runs next (or is running)
_own = threading.local()


#: a tier whose retention keeps failing is warned about at its first failed pass (once per
#: cause: :func:`report_once`) and again at every this many failed passes in a row, each of
#: which left behind what it should have deleted: the storage grows, and one WARNING at the
#: start of dozens of saves is easy to miss
RETENTION_WARN_EVERY = 10
#: per backend, the retention passes that failed in a row (forgotten when one completes)
_failed_passes: weakref.WeakKeyDictionary[Backend, int] = weakref.WeakKeyDictionary()
_failed_lock = threading.Lock()


def _count_failed_pass(backend: Backend, failed: bool) -> int:
    """Count a retention pass on ``backend`` that ``failed`` (else reset the count); the
    failed passes in a row, this one included (0: it worked, or ``backend`` cannot be
    remembered: a test double without hash or weak reference)."""
    with _failed_lock:
        try:
            n = _failed_passes.get(backend, 0) + 1 if failed else 0
            if n:
                _failed_passes[backend] = n
            else:
                _failed_passes.pop(backend, None)
        except TypeError:
            return 0
    return n


def _own_passes() -> Counter[int]:
    mine: Counter[int] | None = getattr(_own, "passes", None)
    if mine is None:
        mine = _own.passes = Counter()
    return mine


class _RetainMixin(_PipelineBase):
    def _protected(self, tier: Tier, job: SaveJob) -> set[CheckpointId]:
        """Checkpoints retention on ``tier`` must keep besides its newest: those still being
        saved there, and (for a source) those its followers hold, at most ``max_behind`` each."""
        with self._lock:
            ids = {
                j.id
                for j in self._in_flight
                if j is not job
                and tier.name in j.handle.tiers
                and tier.name not in j.given_up
                and not j.handle.done(tier.name)
            }
            for name, held in self._following.items():
                if self._by_name[name].spec.source == tier.name:
                    ids.update(j.id for j in held)
        return ids

    def _retain(self, tier: Tier, job: SaveJob) -> None:
        if not self._leases.may_collect(tier, job.rank):
            return
        try:
            protect = self._protected(tier, job)
            gc_tier(
                tier.backend,
                tier.spec.retention,
                protect=protect,
                protect_steps=self.protect_steps(),
                deleting=self.deleting,
                sweep=None,  # leftovers: at this writer's first pass and after a failed save
            )
        except (BackendError, OSError) as exc:  # at every commit while it lasts: once
            report_once(
                tier.backend,
                exc,
                "retention on tier %s failed (will retry next save): %s",
                tier.name,
                exc,
                topic=RETENTION,
            )
            failed = _count_failed_pass(tier.backend, True)
            if failed % RETENTION_WARN_EVERY == 0:  # and, while it lasts, now and then
                log.warning(
                    "retention on tier %s has failed %d passes in a row: what each of them "
                    "should have deleted is still there (the storage grows past the tier's "
                    "rules); last error: %s",
                    tier.name,
                    failed,
                    exc,
                )
        else:
            forget_causes(tier.backend, topic=RETENTION)  # a failure coming back is news
            _count_failed_pass(tier.backend, False)

    def _finish_then_retain(
        self,
        tier: Tier,
        job: SaveJob,
        result: TierResult | None,
        error: BaseException | None,
        *,
        retain: bool,
    ) -> None:
        """Report ``tier``'s copy of ``job`` done (:meth:`_finish`), then, if ``retain``, apply
        the tier's retention on this thread. The pass is counted from before the report, so
        that a :meth:`wait_retention` called once the copy is reported done waits for it."""
        if retain:
            with self._lock:
                self._retaining[tier.name] += 1
            _own_passes()[id(self)] += 1  # a callback inside the report must not wait for it
        try:
            self._finish(tier, job, result, error)
        finally:
            if retain:
                _own_passes()[id(self)] -= 1
                self._run_counted_pass(tier, job)

    def _run_counted_pass(self, tier: Tier, job: SaveJob) -> None:
        """Run a pass counted beforehand (in ``_retaining``) on this thread, then uncount it.
        Its error is only logged: the copy is reported, and the thread lives on to write the
        next saves."""
        _own_passes()[id(self)] += 1  # the pass's own callbacks (protect_steps) may list
        try:
            self._retain(tier, job)
        except Exception as exc:
            msg = "retention on tier %s failed: %s"
            report_once(tier.backend, exc, msg, tier.name, exc, topic=RETENTION)
        finally:
            _own_passes()[id(self)] -= 1
            with self._lock:
                self._retaining[tier.name] -= 1
                self._retained.notify_all()

    def wait_retention(
        self, timeout: float | None = None, *, tiers: Collection[str] | None = None
    ) -> bool:
        """Wait until no retention pass started after a commit (or a failed local copy) is
        running or about to run; False if ``timeout`` seconds passed first. A pass started
        by a later commit is waited for too. Called on a thread that runs a pass (a callback
        inside a commit's report or pass), that pass is not waited for. ``tiers``: only the
        passes on these tiers (None: all)."""
        end = None if timeout is None else time.monotonic() + timeout
        own = _own_passes()[id(self)]
        with self._lock:
            while (
                sum(n for name, n in self._retaining.items() if tiers is None or name in tiers)
                > own
            ):
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._retained.wait(left)
        return True
