"""Checkpointer: save / load / wait / close — what users touch."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from tierckpt import config
from tierckpt.capture import record_ready_events
from tierckpt.catalog import (
    committed_ids,
    committed_steps,
    lineage,
    newest_committed,
    steps_of,
    timeline_for,
)
from tierckpt.commit import CommitStrategy, SingleRankCommit
from tierckpt.config import resolve_writer_config
from tierckpt.distributed import MultiRankCommit
from tierckpt.errors import CheckpointFailed, CheckpointNotFound, CorruptCheckpoint, TierCkptError
from tierckpt.format import CheckpointId, manifest_name
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.pipeline import (
    OUTCOMES,
    Pipeline,
    PipelineHooks,
    PipelineOwner,
    SaveJob,
    Tier,
    check_save_deadline,
    default_save_deadline,
    open_tiers,
)
from tierckpt.plan import collect_state
from tierckpt.policy import TierPolicy, TierSpec
from tierckpt.restore import (
    LoadedShard,
    is_recoverable,
    read_shard,
    restore_into,
)
from tierckpt.snapshot import EAGER_WARN_BYTES, LazySources, Snapshot, snapshot_eager
from tierckpt.stats import CommitStats, StatsRecorder
from tierckpt.tree import encode_metadata

__all__ = ["Checkpointer"]

log = logging.getLogger("tierckpt")

DEFAULT_CHUNK_BYTES = config.DEFAULT_CHUNK_BYTES
#: loads of the newest step: how often load() lists again when the step it chose vanishes
LOAD_ATTEMPTS = 5


class Checkpointer(PipelineOwner):
    """Saves training state through a list of tiers without stopping training.

    ``save(state, step)`` returns a :class:`SaveHandle` at once; the state is captured into
    the host arena in the background. Call ``guard(optimizer, model)`` once: the optimizer
    step then waits for an unfinished capture, and the tensors a forward pass can write (module
    buffers, loose tensors) are copied at ``save()`` while parameters and optimizer state are
    captured lazily. ``load()`` restores the newest committed checkpoint from the fastest tier
    that has it.

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`.
        host_buffer_bytes: the host arena budget (default: 1/8 of RAM, at most 32 GiB;
            ``TIERCKPT_HOST_BUFFER_BYTES``). Peak extra host memory of a save is this, not
            the size of the state.
        chunk_bytes: target chunk size (default 64 MiB; ``TIERCKPT_CHUNK_BYTES``).
        io_threads: encoder / reader threads (default 2; ``TIERCKPT_IO_THREADS``).
        on_busy: ``"block"`` (default): a save requested while earlier ones are still
            flushing waits for arena space in the background; ``"skip"``: it is skipped
            (the handle says ``skipped``; ``h.wait()`` raises ``CheckpointSkipped``) so training
            never waits on slow storage.
        rank, world_size: default from ``torch.distributed`` when initialized, else 0 / 1.
        repopulate: when a load reads from a remote tier, also write the checkpoint to the
            local durable tiers so the next restart reads locally (default True).
        on_commit: called with a :class:`TierResult` each time a checkpoint commits on a
            tier (on a background thread; see :mod:`tierckpt.stats`). More with
            :meth:`add_callback`.
        stats_history: how many commits :meth:`stats` remembers (default 1000).
        exit_timeout_s: when the interpreter exits with saves still in flight, how long they
            get to finish before the unfinished ones are abandoned, never committed (default
            60 s; ``TIERCKPT_EXIT_TIMEOUT_S``; 0 abandons at once). ``close()`` waits fully.
        save_deadline: seconds a save may hold training behind a tier fed from the host
            arena that makes no progress (default 30; ``TIERCKPT_SAVE_DEADLINE``;
            ``float("inf")``: wait for it). Past it that tier's copy of the save is given up
            (``SaveDeadlineExceeded`` on the handle, never committed there), its arena slots
            are freed and training goes on; the next save tries the tier again. ``wait()``
            and ``close()`` give up a tier stalled for as long the same way.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec] | TierPolicy,
        *,
        host_buffer_bytes: int | None = None,
        chunk_bytes: int | None = None,
        io_threads: int | None = None,
        on_busy: Literal["block", "skip"] = "block",
        rank: int | None = None,
        world_size: int | None = None,
        repopulate: bool = True,
        on_commit: Callable[[TierResult], Any] | None = None,
        stats_history: int = 1000,
        exit_timeout_s: float | None = None,
        save_deadline: float | None = None,
    ) -> None:
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
        if on_busy not in ("block", "skip"):
            raise ValueError(f"on_busy must be 'block' or 'skip', got {on_busy!r}")
        self.on_busy = on_busy
        sizes = resolve_writer_config(host_buffer_bytes, chunk_bytes, io_threads)
        self.host_buffer_bytes = sizes.host_buffer_bytes
        self.chunk_bytes = sizes.chunk_bytes
        self.io_threads = sizes.io_threads
        self.save_deadline = (
            default_save_deadline() if save_deadline is None else check_save_deadline(save_deadline)
        )
        self.repopulate = repopulate
        if exit_timeout_s is not None and not exit_timeout_s >= 0:
            raise ValueError(f"exit_timeout_s must be >= 0 seconds, got {exit_timeout_s!r}")
        self.exit_timeout_s = exit_timeout_s
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self._tiers = open_tiers(self.policy)
        self._pipeline: Pipeline | None = None
        #: who commits and who agrees: this process alone, or with the job's other ranks
        self._strategy: CommitStrategy = (
            SingleRankCommit(repopulate=repopulate)
            if self.world_size == 1
            else MultiRankCommit(
                self._tiers,
                rank=self.rank,
                world_size=self.world_size,
                on_busy=on_busy,
                repopulate=repopulate,
                defer=self._defer,
            )
        )
        self._save_count = 0
        self._lock = threading.Lock()
        self._last: SaveHandle | None = None
        self._stats = StatsRecorder(stats_history)
        self._counts: dict[str, Counter[str]] = {t.name: Counter() for t in self._tiers}
        if on_commit is not None:
            self._stats.add_callback(on_commit)
        self._closed = False
        self._read_pool: ThreadPoolExecutor | None = None
        #: the timeline saves go to; None: chosen from the tiers at the next save (the first
        #: one, and the first after a load()), see _propose_timeline
        self._timeline: int | None = None
        #: the newest checkpoint this object started saving
        self._last_saved: CheckpointId | None = None
        #: what guard() named: its tensors are captured lazily, the rest copied at save()
        self._lazy = LazySources()
        self._warned: set[str] = set()

    # -- properties ------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def backend(self, tier: str) -> Any:
        return self._tier(tier).backend

    def _tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {self.tier_names}")

    def _pipeline_hooks(self) -> PipelineHooks:
        return PipelineHooks(
            commit=self._strategy.commit,
            on_result=self._stats.record,
            on_failure=self._strategy.report_failure,
            retains=self._strategy.retains,
            counts=self._counts,
        )

    def _defer(self, fn: Callable[[], None]) -> Future[None] | None:
        """Run a commit's waiting part on the pipeline's commit threads (the strategy's
        ``defer``)."""
        pipeline = self._pipeline
        if pipeline is None:
            fn()
            return None
        return pipeline.defer(fn)

    # -- save ------------------------------------------------------------------------
    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`.

        The checkpoint is the state at this call. Module buffers and loose tensors (which the
        next forward pass may write) are copied here (``h.eager_bytes``); parameters and
        optimizer state are captured lazily and must not change until ``wait_captured()``
        returns: ``guard(optimizer, model)`` enforces it and tells which tensors are which.
        Unsupported objects (and ``metadata`` that is not plain JSON) raise
        ``UnsupportedObject`` here, before anything is written.
        At the first save to a tier this checkpointer takes its writer lease there: if another
        live writer (another job, or another ``Checkpointer`` of this process) holds it,
        ``WriterConflict`` is raised here and nothing is written.
        """
        t0 = time.perf_counter()
        handle = self._save(state, step, metadata)
        handle.blocked_seconds += time.perf_counter() - t0
        return handle

    def _save(self, state: Any, step: int, metadata: dict[str, Any] | None) -> SaveHandle:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        manifest_name(step)  # validates the range
        # checked (and copied) now, with the limits a reader applies: not after the data
        metadata = encode_metadata(metadata)
        pipeline = self._get_pipeline()
        with self._lock:
            for job in pipeline.in_flight():
                if job.step == step:
                    raise ValueError(f"step {step} is already being saved")
            index = self._save_count
            self._save_count += 1
        tiers = [t for t in self._tiers if t.spec.receives(index)]
        busy = bool(pipeline.in_flight())
        timeline, choose = self._propose_timeline(step)
        # with several ranks: an attempt id for the completion records (one all-reduce at the
        # first save; at every save with on_busy="skip", so that all ranks skip together; and
        # wherever the timeline is chosen from the tiers, so that all ranks take the same one)
        start = self._strategy.begin_save(step, busy, timeline=timeline, agree_timeline=choose)
        attempt, busy, timeline = start.attempt, start.busy, start.timeline
        self._timeline = timeline
        if self.on_busy == "skip" and busy:
            log.warning("step %d skipped: the previous checkpoint is still flushing", step)
            handle = SaveHandle(step, tuple(t.name for t in tiers), skipped=True, timeline=timeline)
            return handle
        # only the walk (validation + tensor references) runs here; the layout is computed by
        # the capture thread, so training pays microseconds per tensor, not the whole plan
        collected = collect_state(state)

        handle = SaveHandle(step, tuple(t.name for t in tiers), timeline=timeline)
        if not tiers:
            return handle
        # before the ready events: on CUDA the copies are queued ahead of the capture's wait
        collected.tensors = self._snapshot(collected.tensors, handle)
        job = SaveJob(
            step=step,
            plan=None,
            collected=collected,
            chunk_bytes=self.chunk_bytes,
            tiers=tiers,
            handle=handle,
            rank=self.rank,
            world_size=self.world_size,
            ready_events=record_ready_events(collected.devices),
            metadata=metadata,
            attempt=attempt,
            timeline=timeline,
        )
        # one writer per location: refused here, before anything is written, when another
        # live writer holds a tier (tierckpt.lease)
        pipeline.acquire_leases(job)
        self._last = handle
        self._last_saved = job.id
        pipeline.submit(job)
        return handle

    # -- timelines ---------------------------------------------------------------------
    def _propose_timeline(self, step: int) -> tuple[int, bool]:
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
        newest = newest_committed((t.name, t.backend) for t in self._tiers)
        if last is not None and (newest is None or last > newest):
            newest = last
        return timeline_for(step, newest), True

    def wait_captured(self, timeout: float | None = None) -> None:
        """Block until every pending save's bytes are in host memory.

        Call it before anything modifies the saved state (the optimizer step). A failed
        capture does not raise here — training goes on, the checkpoint is not committed, and
        the error is logged and kept on the save's handle (``h.wait()`` raises it).
        """
        if self._pipeline is None:
            return
        for job in self._pipeline.in_flight():
            t0 = time.perf_counter()
            try:
                job.handle.wait_captured(timeout)
            except CheckpointFailed:
                pass
            finally:
                job.handle.blocked_seconds += time.perf_counter() - t0

    def guard(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module | Sequence[torch.nn.Module] | None = None,
    ) -> Any:
        """Make ``optimizer.step()`` wait for pending captures. Returns the hook handle.

        It also tells ``save()`` which tensors change only in the optimizer step and can be
        captured lazily: the parameters of ``model`` (one module or a list; frozen ones too)
        and the optimizer's parameters and state. Every other tensor of a saved state —
        module buffers such as BatchNorm statistics, loose tensors — is copied at ``save()``,
        because the next forward pass may write it. Without ``model``, parameters that are not
        in the optimizer (a frozen base) are copied too, with a warning. Call it once per
        optimizer; the optimizer and modules are held weakly.
        """
        modules = _as_modules(model)
        if not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise TypeError(
                f"guard() needs a torch.optim.Optimizer, got {type(optimizer).__qualname__}"
            )
        self._lazy.add(optimizer, modules)

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.wait_captured()

        return optimizer.register_step_pre_hook(hook)

    def _learn(
        self, optimizer: torch.optim.Optimizer | None, modules: Sequence[torch.nn.Module] = ()
    ) -> None:
        """What ``guard()`` learns, for integrations that install their own wait (Lightning)."""
        self._lazy.add(optimizer, modules)

    def _snapshot(self, tensors: list[torch.Tensor], handle: SaveHandle) -> list[torch.Tensor]:
        """Copy what the next forward pass may write (see :mod:`tierckpt.snapshot`)."""
        if not self._lazy.guarded:
            # nothing tells parameters from buffers: copying all would copy the model at
            # every save, so the whole state stays lazy, as the caller's wait_captured() implies
            if tensors:
                self._warn_once(
                    "no-guard",
                    "save() without guard(): tierckpt cannot tell parameters from buffers, so "
                    "the whole state is captured lazily and must not change until "
                    "wait_captured() returns — but the next forward pass writes module buffers "
                    "(BatchNorm statistics, counters), which may then be saved with their values "
                    "from after save(). Call ck.guard(optimizer, model) once: buffers are then "
                    "copied at save(), parameters and optimizer state captured lazily",
                )
            return tensors
        snap = snapshot_eager(tensors, self._lazy.storages())
        handle.eager_bytes = snap.eager_bytes
        self._warn_eager(snap)
        return snap.tensors

    def _warn_eager(self, snap: Snapshot) -> None:
        """Say, once each, when save() copied what may be parameters, and what to pass."""
        mib = snap.eager_bytes / 2**20
        large = snap.eager_bytes > EAGER_WARN_BYTES
        if not self._lazy.has_modules:
            if large:
                self._warn_once(
                    "optimizer-only-large",
                    f"guard(optimizer) without the model: {mib:.0f} MiB of tensors that are not "
                    "in the optimizer were copied at save() — frozen parameters are being "
                    "copied eagerly at every save. ck.guard(optimizer, model) keeps them lazy",
                )
            elif snap.eager_tensors:
                self._warn_once(
                    "optimizer-only",
                    f"guard(optimizer) without the model: {snap.eager_tensors} tensors "
                    f"({mib:.1f} MiB) of the state are neither optimizer parameters nor "
                    "optimizer state, so they were copied at save() (needed for buffers that "
                    "forward writes, needless for frozen parameters). Pass the model, "
                    "ck.guard(optimizer, model), so frozen parameters are captured lazily",
                )
        elif large:
            self._warn_once(
                "large",
                f"{mib:.0f} MiB of tensors that are neither parameters of a guarded module nor "
                "optimizer state were copied at save() (module buffers and loose tensors are). "
                "If they change only in optimizer.step() (another model's weights), pass "
                "their module too: ck.guard(optimizer, [model, other])",
            )

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("%s", message)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save to finish on every tier (errors stay on handles).

        A tier that makes no progress for ``save_deadline`` seconds meanwhile has its
        pending copies given up (``SaveDeadlineExceeded``), so a dead tier is waited for
        about that long, not its timeouts times the saves queued for it.
        """
        if self._pipeline is None:
            return
        if not self._pipeline.drain(timeout):
            steps = sorted(j.step for j in self._pipeline.in_flight())
            raise TimeoutError(f"steps {steps} not finished after {timeout} s")

    # -- listing -----------------------------------------------------------------------
    def checkpoints(self, tier: str | None = None) -> list[CheckpointId]:
        """Committed checkpoints, oldest first: on ``tier``, or on any tier. The last one is
        the newest, what ``load()`` returns. After a rollback this includes the abandoned
        timeline's checkpoints that retention has not removed yet (older than every
        checkpoint of the newer timeline, whatever their step numbers)."""
        if tier is not None:
            return committed_ids(self._tier(tier).backend)
        out: set[CheckpointId] = set()
        for t in self._tiers:
            try:
                out.update(committed_ids(t.backend))
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
        return sorted(out)

    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps: on ``tier``, or on any tier; one entry per step.

        In checkpoint order, oldest first: the last entry is the step ``load()`` returns.
        While a run stays on one timeline (it never went back to an older step) this is
        ascending step order. After a rollback, steps are ordered by timeline first, and a step
        held by several timelines counts once, as the newest timeline's: e.g. ``[9, 10, 8]``
        when step 8 was saved again after loading step 7 of a run that reached 10.
        :meth:`checkpoints` lists every checkpoint with its timeline.
        """
        return steps_of(self.checkpoints(tier))

    def tier_steps(self) -> dict[str, list[int]]:
        """Which steps are committed on which tier (each list in :meth:`steps` order)."""
        return {t.name: committed_steps(t.backend) for t in self._tiers}

    # -- load --------------------------------------------------------------------------
    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        tier: str | None = None,
        map_location: str | torch.device | None = None,
        fallback: Literal["error", "previous"] = "error",
        timeline: int | None = None,
    ) -> Any:
        """Load the newest committed checkpoint (or ``step``) from the fastest tier holding it.

        The newest checkpoint is the newest step of the newest timeline (a run resumed from an
        older step saves on a new timeline; see :class:`~tierckpt.format.CheckpointId`).
        ``step``: that step, of the newest timeline holding it; ``timeline``: only that
        timeline's checkpoints. ``into``: copy into these existing tensors in place (shapes
        and dtypes must match) and return it. ``fallback="previous"``: if every tier's copy is
        unreadable, try older checkpoints of the same history (older steps of its timeline,
        then the steps of older timelines below the point where the newer one branched off;
        never steps of an abandoned run). ``map_location``: device of the returned tensors
        (default CPU).

        The next ``save()`` after a load chooses its timeline again: a step after the newest
        committed one continues its timeline; an older or equal one starts a new timeline.

        Loading the newest checkpoint beside a writer (an evaluator next to a trainer with a
        small ``keep_last``): when retention removes the chosen checkpoint while it is being
        read, the tiers are listed again and the newest committed one is loaded instead (up to
        ``LOAD_ATTEMPTS`` times; single-rank jobs).
        """
        seen: CheckpointId | None = None  # the newest checkpoint listed after the last failure
        for attempt in range(LOAD_ATTEMPTS):
            try:
                return self._load_once(
                    step,
                    into=into,
                    tier=tier,
                    map_location=map_location,
                    fallback=fallback,
                    timeline=timeline,
                )
            except CheckpointNotFound:
                if step is not None or self.world_size != 1 or attempt == LOAD_ATTEMPTS - 1:
                    raise
                try:
                    newest = max(self.checkpoints(tier), default=None)
                except TierCkptError:
                    newest = None
                if newest is None or newest == seen:
                    raise  # nothing newer appeared: the step is really unreadable
                seen = newest
                log.info("load: the chosen step vanished (retention?); listing again")
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_once(
        self,
        step: int | None,
        *,
        into: Any,
        tier: str | None,
        map_location: str | torch.device | None,
        fallback: Literal["error", "previous"],
        timeline: int | None,
    ) -> Any:
        """One listing of the tiers and one load of the step chosen from it."""
        if fallback not in ("error", "previous"):
            raise ValueError("fallback must be 'error' or 'previous'")
        self._timeline = None  # the run may have gone back: the next save decides again
        tiers = [self._tier(tier)] if tier is not None else self._tiers
        listing: dict[str, list[CheckpointId]] = {}
        for t in tiers:
            try:
                listing[t.name] = committed_ids(t.backend)
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
                listing[t.name] = []
        all_ids = sorted({c for v in listing.values() for c in v}, reverse=True)
        if timeline is not None:
            all_ids = [c for c in all_ids if c.timeline == timeline]
        where = ", ".join(t.name for t in tiers)
        candidates: list[CheckpointId]
        if step is not None:
            holding = [c for c in all_ids if c.step == step]
            what = f"step {step}" + (f" of timeline {timeline}" if timeline is not None else "")
            missing = (
                f"{what} is not committed on any tier ({where}); committed steps: "
                f"{steps_of(all_ids)[-10:] or 'none'}"
            )
            if not holding:
                # held by no tier here: the load fails (with several ranks: on every rank, in
                # agree_on_step)
                candidates = [CheckpointId(step, timeline or 0)]
            else:
                candidates = lineage(all_ids, holding[0]) if fallback == "previous" else holding[:1]
        else:
            missing = f"no committed checkpoint on any tier ({where})" + (
                f" of timeline {timeline}" if timeline is not None else ""
            )
            candidates = lineage(all_ids) if fallback == "previous" else all_ids[:1]
        # every rank must load the same checkpoint: the newest all ranks can read
        candidates = self._strategy.agree_on_step(candidates)
        got: LoadedShard | None = None
        try:
            got = self._load_candidates(tiers, listing, candidates, missing)
        finally:
            # the copies to faster tiers become a checkpoint there; with several ranks only
            # once every rank's file is in: a collective, reached by every rank whether its
            # load worked or not
            self._strategy.publish_repopulated(got)
        return self._deliver(got, into, map_location)

    def _deliver(
        self, loaded: LoadedShard, into: Any, map_location: str | torch.device | None
    ) -> Any:
        state = loaded.state
        if map_location is not None:
            state = _to_device(state, torch.device(map_location))
        if into is not None:
            return restore_into(into, state)
        return state

    def _load_candidates(
        self,
        tiers: list[Tier],
        listing: dict[str, list[CheckpointId]],
        candidates: list[CheckpointId],
        missing: str,
    ) -> LoadedShard:
        """The first readable copy of the first candidate, tiers fastest first.
        ``CheckpointNotFound(missing)`` where no tier holds any candidate."""
        errors: list[str] = []
        first_exc: BaseException | None = None
        for cid in candidates:
            holders = [t for t in tiers if cid in listing[t.name]]
            for t in holders:
                try:
                    loaded = self._load_from(t, cid)
                except BaseException as exc:
                    if not is_recoverable(exc):
                        raise
                    first_exc = first_exc or exc
                    errors.append(f"{cid} on tier {t.name!r}: {exc}")
                    log.warning(
                        "load of %s from tier %s failed, trying the next: %s", cid, t.name, exc
                    )
                    continue
                log.info(
                    "loaded %s from tier %s: %d bytes in %.3f s",
                    cid,
                    t.name,
                    loaded.raw_bytes,
                    loaded.seconds,
                )
                return loaded
        if not errors:
            raise CheckpointNotFound(missing)
        msg = "no readable copy of the checkpoint: " + "; ".join(errors)
        if isinstance(first_exc, CorruptCheckpoint):
            raise CorruptCheckpoint(msg) from first_exc
        if isinstance(first_exc, TierCkptError):
            raise type(first_exc)(msg) from first_exc
        raise CorruptCheckpoint(msg) from first_exc

    def _load_from(self, tier: Tier, cid: CheckpointId) -> LoadedShard:
        step = cid.step
        manifest = self._strategy.read_manifest(tier, cid)  # multi-rank: once per node
        if manifest.world_size != self.world_size:
            raise TierCkptError(
                f"{cid} was saved by {manifest.world_size} ranks, this job has "
                f"{self.world_size}; the native format needs the same world size — save with "
                "tierckpt.dcp (torch.distributed.checkpoint) to reshard"
            )
        repop = []
        if self._strategy.repopulates and tier.backend.is_remote:
            for t in self._tiers:
                if (
                    t.backend.is_durable
                    and not t.backend.is_remote
                    and t.backend.supports_random_write
                    and not t.backend.exists(manifest_name(step, timeline=cid.timeline))
                ):
                    repop.append(t.backend)
        if self._read_pool is None:
            self._read_pool = ThreadPoolExecutor(
                max(2, self.io_threads * 2), thread_name_prefix="tierckpt-read"
            )
        return read_shard(
            tier.backend,
            tier.name,
            manifest,
            self.rank,
            self._read_pool,
            repopulate=repop,
            publish=False,  # the strategy's publish_repopulated commits the copies
        )

    # -- stats / lifecycle ------------------------------------------------------------
    def tier_counts(self) -> dict[str, dict[str, int]]:
        """Per tier, how many copies of saves this Checkpointer ``committed``, how many
        ``failed``, how many were ``skipped`` (a follower more than ``max_behind`` steps behind
        its source) and how many were given up at the ``deadline``; each failure is also on
        its save's handle and in the log."""
        pipeline = self._pipeline
        if pipeline is not None:
            return pipeline.counts()  # read under the lock the pipeline counts under
        return {name: {k: c[k] for k in OUTCOMES} for name, c in self._counts.items()}

    def stats(self) -> list[CommitStats]:
        """One :class:`CommitStats` per checkpoint per tier committed so far, oldest first.

        Step, tier, raw and stored bytes, seconds from ``save()`` to the commit, GB/s,
        compression ratio and the seconds training was blocked by that save. The history is
        bounded (``stats_history``, default the last 1000 commits).
        """
        return self._stats.stats()

    def add_callback(self, fn: Callable[[TierResult], Any]) -> Callable[[TierResult], Any]:
        """Call ``fn(result)`` on every commit on every tier (see :mod:`tierckpt.stats`)."""
        return self._stats.add_callback(fn)

    def remove_callback(self, fn: Callable[[TierResult], Any]) -> None:
        self._stats.remove_callback(fn)

    def _release(self) -> None:
        if self._read_pool is not None:
            self._read_pool.shutdown()
            self._read_pool = None


def _as_modules(
    model: torch.nn.Module | Sequence[torch.nn.Module] | None,
) -> list[torch.nn.Module]:
    if model is None:
        return []
    try:
        modules = [model] if isinstance(model, torch.nn.Module) else list(model)
    except TypeError:
        modules = [model]  # type: ignore[list-item]  # refused below with a clear message
    for m in modules:
        if not isinstance(m, torch.nn.Module):
            raise TypeError(
                f"guard(optimizer, model): model must be a torch.nn.Module or a list of them, "
                f"got {type(m).__qualname__} (pass the module, not its parameters)"
            )
    return modules


def _dist_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _to_device(state: Any, device: torch.device) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, _to_device(v, device)) for k, v in state.items())
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    if isinstance(state, tuple):
        return tuple(_to_device(v, device) for v in state)
    return state
