"""The save half of :class:`~tierckpt.Checkpointer`: what a ``save()`` does before it returns
(check the step, choose its timeline, agree with the job's other ranks, copy what the next
forward pass may write, take the writer leases, hand the job to the pipeline), what the
pipeline calls back (commit, failure, deferred commit work) and the optimizer step's wait.

:class:`SavePath` is a base class of ``Checkpointer`` holding only private methods: the
public API and its documentation stay on the facade in ``_checkpointer``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Literal, cast

from tierckpt import config, devices
from tierckpt.capture import record_ready_events
from tierckpt.catalog import (
    CHOOSES_AGAIN,
    newer_than,
    newest_committed_within,
    stale_timeline,
    timeline_for,
)
from tierckpt.checkpointer._guarded import GuardedSources, watch_unguarded
from tierckpt.checkpointer._stateful import expand_stateful
from tierckpt.commit import CommitStrategy, EarlierSave, SingleRankCommit
from tierckpt.distributed import MultiRankCommit
from tierckpt.errors import CheckpointExists, CheckpointFailed, WriterConflict
from tierckpt.format import CheckpointId, manifest_name
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.pipeline import Pipeline, PipelineHooks, PipelineOwner, SaveJob, Tier, weakly
from tierckpt.plan import collect_state
from tierckpt.snapshot import watch
from tierckpt.stats import StatsRecorder, outcome_of
from tierckpt.tree import encode_metadata

__all__ = ["SavePath"]

log = logging.getLogger("tierckpt")


class SavePath(PipelineOwner):
    """The save machinery of a checkpointer; ``Checkpointer.__init__`` sets the fields."""

    on_busy: Literal["block", "skip"]
    rank: int
    world_size: int
    #: when a load reads from a remote tier, also write the checkpoint to the local tiers
    repopulate: bool
    #: who commits and who agrees: this process alone, or with the job's other ranks
    _strategy: CommitStrategy
    _stats: StatsRecorder
    _counts: dict[str, Counter[str]]
    _lock: threading.Lock
    _save_count: int
    _last: SaveHandle | None
    #: the timeline saves go to; None: chosen from the tiers at the next save (the first one,
    #: and the first after a load()), see _propose_timeline
    _timeline: int | None
    #: the tiers that could not be listed when the timeline was chosen: a save is checked
    #: against each before it is published there (_confirm_timeline), until one passes
    _unconfirmed: frozenset[str]
    #: the newest checkpoint this object started saving
    _last_saved: CheckpointId | None
    #: whether a load() ran through this object (a save that goes back without one warns)
    _has_loaded: bool
    _again: bool
    #: whether a save of every rank has started: until then, each save's start is agreed
    _writers_agreed: bool
    #: what guard() named: its tensors are captured lazily, the rest copied at save()
    _guarded: GuardedSources
    #: the step pre-hooks guard() registered (removed at close)
    _guard_hooks: list[Any]

    def _init_save_path(self, stats_history: int) -> None:
        """Set this part's fields; ``Checkpointer.__init__`` calls it once the tiers are open
        and ``rank``, ``world_size``, ``on_busy`` and ``repopulate`` are set."""
        # the strategy's calls back into this object are weak, as the pipeline's (weakly);
        # it asks for the earlier save at a save's start only, when this object lives
        earlier = cast(Callable[[int, int], EarlierSave], weakly(self._earlier_save))
        self._strategy = (
            SingleRankCommit(repopulate=self.repopulate, earlier=earlier)
            if self.world_size == 1
            else MultiRankCommit(
                self._tiers,
                rank=self.rank,
                world_size=self.world_size,
                on_busy=self.on_busy,
                repopulate=self.repopulate,
                defer=weakly(self._defer),
                earlier=earlier,
            )
        )
        self._save_count = 0
        self._lock = threading.Lock()
        self._last = None
        self._stats = StatsRecorder(stats_history)
        self._counts = {t.name: Counter() for t in self._tiers}
        self._timeline = None
        self._unconfirmed = frozenset()
        self._has_loaded = False
        self._again = False
        # one process agrees with nobody; ranks agree at their first save (_agree_to_write)
        self._writers_agreed = self.world_size == 1
        self._last_saved = None
        self._guarded = GuardedSources()
        self._guard_hooks = []

    # -- what the pipeline calls back --------------------------------------------------
    def _pipeline_hooks(self) -> PipelineHooks:
        return PipelineHooks(
            commit=self._strategy.commit,
            # through this object (weakly): the stats hold the user's callbacks, which may
            # refer to it
            on_result=weakly(self._on_result),
            on_failure=weakly(self._on_failure),
            retains=self._strategy.retains,
            counts=self._counts,
        )

    def _on_result(self, result: TierResult, handle: SaveHandle) -> None:
        self._stats.record(result, handle)

    def _on_failure(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        """A tier's copy failed, was skipped or given up: to the strategy (other ranks),
        then to stats and the event callbacks."""
        try:
            self._strategy.report_failure(tier, job, error)
        finally:
            self._stats.record_failure(
                outcome_of(error),
                job.step,
                tier.name,
                error,
                timeline=job.timeline,
                blocked_seconds=job.handle.blocked_seconds,
            )

    def _defer(self, fn: Callable[[], None]) -> Future[None] | None:
        """Run a commit's waiting part on the pipeline's commit threads (the strategy's
        ``defer``)."""
        pipeline = self._pipeline
        if pipeline is None:
            fn()
            return None
        return pipeline.defer(fn)

    def _forget_timeline(self) -> None:
        """After a load: the next save chooses its timeline from the tiers again."""
        self._timeline = None
        self._has_loaded = True

    def _new_run(self) -> None:
        """A new training run of this object begins (an integration's train() start): its
        first save chooses its timeline from the tiers, as the first save after a load does
        (a step not after the newest goes on a new timeline)."""
        with self._lock:
            self._timeline = None

    def _save_again(self) -> None:
        """The next save, of the step just saved but with other content, is a checkpoint of
        its own on a new timeline, not a retry of that one (an integration saving several
        states at one step: :mod:`tierckpt.integrations._same_step`)."""
        self._timeline = None
        self._again = True

    # -- starting a save ---------------------------------------------------------------
    def _save(self, state: Any, step: int, metadata: Mapping[str, Any] | None) -> SaveHandle:
        manifest_name(step)  # validates the range (the type: save() took it through as_step)
        # checked (and copied) now, with the limits a reader applies: not after the data
        try:
            metadata = encode_metadata(metadata)
        except BaseException as exc:
            self._save_not_started(step, exc)
            raise
        pipeline = self._get_pipeline()
        with self._lock:
            self._save_count += 1
        tiers = [t for t in self._tiers if t.spec.receives(step)]
        busy = bool(pipeline.in_flight())
        timeline, choose = self._propose_timeline(step, pipeline, tiers)
        # with several ranks: an attempt id for the completion records (one all-reduce at the
        # first save; at every save with on_busy="skip", so that all ranks skip together; and
        # wherever the timeline is chosen from the tiers, so that all ranks take the same one).
        # A save of the checkpoint saved before (same step and timeline) is refused while that
        # save is in flight (ValueError), and kept off the tiers where it committed: on every
        # rank alike (see _earlier_save)
        start = self._strategy.begin_save(step, busy, timeline=timeline, agree_timeline=choose)
        attempt, busy, timeline = start.attempt, start.busy, start.timeline
        self._timeline = timeline
        if self.on_busy == "skip" and busy:
            log.warning("step %d skipped: the previous checkpoint is still flushing", step)
            handle = SaveHandle(step, tuple(t.name for t in tiers), skipped=True, timeline=timeline)
            self._stats.record_failure(
                "save_skipped",
                step,
                "",
                "on_busy='skip': the previous save was still flushing",
                timeline=timeline,
            )
            return handle
        handle = SaveHandle(step, tuple(t.name for t in tiers), timeline=timeline)
        agreed = False  # this save took part in _agree_to_write
        try:
            # only the walk (validation + tensor references) runs here; the layout is computed
            # by the capture thread, so training pays microseconds per tensor, not the whole
            # plan; top-level Stateful objects (a module, an optimizer) give their
            # state_dict(), as in DCP
            expanded = expand_stateful(state)
            collected = collect_state(expanded)
            if not tiers:
                return handle
            # before the ready events: on CUDA the copies are queued ahead of the capture's
            # wait
            collected.tensors = self._guarded.snapshot(
                collected.tensors, handle, collected.copies, expanded
            )
            if not self._guarded.guarded:
                watch_unguarded(self)  # any optimizer's step waits for this lazy capture
            # guarded: what changes the lazy tensors before their copy is seen (StateChanged)
            watched = watch(collected.tensors, collected.paths) if self._guarded.guarded else None
            job = SaveJob(
                step=step,
                plan=None,
                collected=collected,
                watched=watched,
                chunk_bytes=self.chunk_bytes,
                tiers=tiers,
                handle=handle,
                rank=self.rank,
                world_size=self.world_size,
                ready_events=record_ready_events(collected.devices),
                metadata=metadata,
                attempt=attempt,
                timeline=timeline,
                confirm_on=self._unconfirmed.intersection(t.name for t in tiers),
                confirm=self._confirm_timeline,
                refused={
                    t.name: _exists(step, timeline, t, start.refused[t.name])
                    for t in tiers
                    if t.name in start.refused
                },
            )
            # one writer per location: refused here, before anything is written, when another
            # live writer holds a tier (tierckpt.lease)
            refused: Exception | None = None
            try:
                pipeline.acquire_leases(job)
            except Exception as exc:
                refused = exc
            if not self._writers_agreed:
                agreed = True
                refused = self._agree_to_write(refused)
                if refused is not None:
                    attempt = ""  # every rank knows: no failure record for any to wait on
            if refused is not None:
                raise refused
            self._last = handle
            self._last_saved = job.id
            pipeline.submit(job)
        except BaseException as exc:
            if tiers and not agreed and not self._writers_agreed and isinstance(exc, Exception):
                # the other ranks wait in the agreement: they are told, and write nothing
                try:
                    self._agree_to_write(exc)
                    attempt = ""
                except Exception as also:  # pragma: no cover - a broken process group
                    log.warning("step %d: could not tell the other ranks: %s", step, also)
            self._save_not_started(step, exc, attempt=attempt, timeline=timeline)
            raise
        return handle

    def _agree_to_write(self, error: Exception | None) -> Exception | None:
        """A multi-rank job's saves until one that every rank may write (its first, usually):
        one all-reduce of whether each rank's save could start (``error``: why not, a
        :class:`WriterConflict` from its leases most often). Without it, a second job with
        more ranks than a live one's on its folder wrote stray shard files there: its extra
        ranks found their leases free. Returns the error this rank's save raises (None: it
        goes on); one that another rank's failure refused gives back its leases first."""
        code = 0 if error is None else 1 if isinstance(error, WriterConflict) else 2
        worst = self._strategy.agree_on_outcome(code)
        if worst == 0:
            self._writers_agreed = True
            return None
        if error is not None:
            return error
        if self._pipeline is not None:
            self._pipeline.give_back_leases()
        if worst == 1:
            return WriterConflict(
                "another rank of this job found another live writer holding a tier location "
                "of this save (see that rank's error); no rank of this job writes it"
            )
        return CheckpointFailed(
            "another rank of this job could not start this save (see that rank's error); no "
            "rank of this job writes it"
        )

    def _save_not_started(
        self, step: int, error: BaseException, *, attempt: str = "", timeline: int | None = None
    ) -> None:
        """A ``save()`` that raised before its job reached the pipeline (a bad state, bad
        metadata or metrics, a writer conflict), on this rank alone perhaps: each tier the
        step was meant for records a failed copy, as a failure in the pipeline would — event
        callbacks and stats see it, and a ``PeerTier`` runs the round of that node-RAM save,
        so that every rank's replication rounds stay paired. With the attempt the ranks
        agreed on, the other ranks are told at once (``report_failure``) instead of waiting
        out their commit timeout. Never raises: the save's own error is the one to see."""
        if type(step) is not int or step < 0:
            return  # no save of that step can exist on any rank
        pipeline = self._pipeline
        if (
            not attempt
            and pipeline is not None
            and any(j.step == step for j in pipeline.in_flight())
        ):
            return  # the save of this step in flight reports its own outcome
        try:
            tl = timeline if timeline is not None else (self._timeline or 0)
            tiers = [t for t in self._tiers if t.spec.receives(step)]
            stub = SaveJob(
                step=step,
                plan=None,
                tiers=tiers,
                handle=SaveHandle(step, tuple(t.name for t in tiers), timeline=tl),
                rank=self.rank,
                world_size=self.world_size,
                ready_events={},
                metadata={},
                attempt=attempt,
                timeline=tl,
            )
            for t in tiers:
                if attempt:
                    self._on_failure(t, stub, error)
                else:
                    self._stats.record_failure(outcome_of(error), step, t.name, error, timeline=tl)
        except Exception as exc:  # pragma: no cover - reporting must not mask the error
            log.warning("step %d: could not report the failed save (%s)", step, exc)

    def _earlier_save(self, step: int, timeline: int) -> EarlierSave:
        """This object's own earlier save of checkpoint ``(step, timeline)`` (the strategy's
        ``earlier``): whether it is still in flight, and the tiers where its copy finished
        without error. Only the latest save can be of the same checkpoint as a new one (a save
        below the previous one's step, or after a load, chooses its timeline anew)."""
        cid = CheckpointId(step, timeline)
        pipeline = self._pipeline
        if pipeline is not None and any(j.id == cid for j in pipeline.in_flight()):
            return EarlierSave(in_flight=True)
        last = self._last  # done once out of the pipeline: its tiers' outcomes are final
        if last is None or (last.step, last.timeline) != (step, timeline):
            return EarlierSave()
        return EarlierSave(done=frozenset(t for t in last.tiers if last.committed(t)))

    def _propose_timeline(
        self, step: int, pipeline: Pipeline, tiers: list[Tier]
    ) -> tuple[int, bool]:
        """The timeline for a save of ``step``, and whether it was chosen from the tiers now
        (False: the previous save's timeline goes on).

        The timeline is chosen from the tiers at the first save, at the first save after a
        ``load()``, and when ``step`` is below the previous save's (the run went back without
        loading through this object), by :func:`~tierckpt.catalog.timeline_for` from the
        newest committed checkpoint on any tier — or the one this object last started saving,
        if newer (it may still be in flight). A save of the same step as the previous one
        stays on its timeline: a retry, refused where that checkpoint is committed already (a
        manifest is never overwritten).
        """
        last = self._last_saved
        if self._timeline is not None and (last is None or step >= last.step):
            return self._timeline, False
        # the leases of ``tiers`` not taken yet are taken meanwhile (a first save): a store
        # that does not answer then costs the save one TIERCKPT_LEASE_WAIT_S, not two
        pipeline.take_leases_early(tiers, self.rank, step)
        # a tier that does not answer in time (a hung store) is left out here and checked
        # before each save is published on it, until one passes (_confirm_timeline)
        newest, unknown = newest_committed_within(
            ((t.name, t.backend) for t in self._tiers), config.lease_wait_s()
        )
        with self._lock:
            self._unconfirmed = unknown
        if last is not None and (newest is None or last > newest):
            newest = last
        timeline = timeline_for(step, newest)
        again, self._again = self._again, False
        if newest is not None and timeline > newest.timeline and not (self._has_loaded or again):
            self._warn_going_back(step, newest, timeline)
        return timeline, True

    def _confirm_timeline(self, tier: Tier, job: SaveJob) -> None:
        """Tier thread, before ``job``'s shard is published on ``tier``, a tier that could not
        be listed when the timeline was chosen: where it holds a checkpoint newer than
        ``job``'s (a run that went further, on a new node whose other tiers are empty),
        this copy is refused (``StaleTimeline``) and, in a single-rank job, the next save
        chooses its timeline again with the tier in view (a multi-rank job chooses again at its
        next ``load()``: the choice is a collective); otherwise the tier is no longer checked.
        A listing that fails fails this copy, as its upload would have."""
        newer = newer_than(tier.backend, job.id)
        if newer is None:
            with self._lock:
                self._unconfirmed = self._unconfirmed - {tier.name}
            return
        if self.world_size == 1:
            again = CHOOSES_AGAIN
            with self._lock:
                if self._timeline == job.timeline:
                    self._timeline = None  # chosen again at the next save, seeing this tier
        else:
            # the ranks choose a timeline together, in one collective at the same save on
            # every rank; a rank whose copy failed before this check would not take part
            again = (
                "its later saves are refused there too until the job chooses its timeline "
                "again: load() the checkpoint to resume from (on every rank), or restart it"
            )
        raise stale_timeline(job.id, tier.name, newer, again)

    def _warn_going_back(self, step: int, newest: CheckpointId, timeline: int) -> None:
        """A save below the newest stored checkpoint, by an object that loaded none: a run
        resumed some other way, or a new run pointed at another run's folder or prefix, whose
        checkpoints retention then removes as older (rank 0 says it, once per such save)."""
        if self.rank != 0:
            return
        if self._last_saved is not None and self._last_saved.step >= step:
            log.warning(  # its own saves went back: a batch index given as the step, say
                "step %d is not after step %d, which this Checkpointer saved itself: save() "
                "takes a step that only grows (a global step, not an epoch's batch index). It "
                "saves on timeline %d, as a run resumed from an older step does, and retention "
                "removes timeline %d's checkpoints as this one commits",
                step,
                self._last_saved.step,
                timeline,
                newest.timeline,
            )
            return
        log.warning(
            "step %d is not after the newest checkpoint on these tiers (step %d, timeline %d) "
            "and this Checkpointer loaded none: it saves on timeline %d, as a run resumed from "
            "an older step does, and each tier's retention removes timeline %d's checkpoints "
            "as this run's commit. If they are another run's, stop this job and give it its "
            "own folder or prefix, or keep that run's newest with ck.pin(%d, timeline=%d); if "
            "this run went back on purpose, ignore this",
            step,
            newest.step,
            newest.timeline,
            timeline,
            newest.timeline,
            newest.step,
            newest.timeline,
        )

    # -- waiting for captures ----------------------------------------------------------
    def _wait_unguarded(self) -> None:
        """Any optimizer's step, while no ``guard()`` names this writer's (watch_unguarded)."""
        if not self._guarded.guarded:
            self._wait_captures(None, on_device=True)

    def _wait_captures(self, timeout: float | None, *, on_device: bool) -> None:
        """Wait until every pending save's bytes are in host memory (a failed capture stays on
        its handle). ``on_device`` (the optimizer step's wait): a save whose copies are all
        queued on one GPU makes the training stream wait for them there instead (the host
        goes on queueing the step's kernels, which run once the copies are done)."""
        if self._pipeline is None or self._inherited():
            return  # a copy inherited through fork: the saves in flight are the parent's
        for job in self._pipeline.in_flight():
            queued = job.queued_events
            if on_device and queued is not None and not job.handle.captured:
                device, events = queued
                for ev in events:
                    devices.current_stream_wait(device, ev)
                continue
            t0 = time.perf_counter()
            try:
                job.handle.wait_captured(timeout)
            except CheckpointFailed:
                pass
            finally:
                job.handle.blocked_seconds += time.perf_counter() - t0


def _exists(step: int, timeline: int, tier: Tier, why: str) -> CheckpointExists:
    """A save's refusal on ``tier``, where an earlier save of the same checkpoint committed."""
    return CheckpointExists(
        f"{CheckpointId(step, timeline)} {why} on tier {tier.name!r} ({tier.backend.url}) by "
        "an earlier save of this step; refusing to overwrite it — save under another step, or "
        "delete the old one first (tierckpt gc)"
    )
