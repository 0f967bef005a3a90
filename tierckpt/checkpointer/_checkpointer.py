"""Checkpointer: save / load / wait / close — what users touch.

The facade: the public API and its documentation. Saves are in :mod:`._saving`, loads in
:mod:`._loading`, ``guard()`` in :mod:`._guarded`, pins and protectors in :mod:`._retention`."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch

from tierckpt import config
from tierckpt.catalog import steps_of
from tierckpt.checkpointer._guarded import as_modules
from tierckpt.checkpointer._loading import LoadContext, list_checkpoints, list_each_tier, load
from tierckpt.checkpointer._observed import Observed
from tierckpt.checkpointer._readpool import ReadPool
from tierckpt.checkpointer._retention import Protectors, pin_target
from tierckpt.checkpointer._saving import SavePath
from tierckpt.checkpointer._stateful import has_stateful, load_stateful
from tierckpt.checkpointer._steps import as_map_location, as_step, resolve_rank
from tierckpt.config import resolve_writer_config
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.peer import open_peer
from tierckpt.pipeline import (
    OUTCOMES,
    Pipeline,
    Tier,
    check_save_deadline,
    default_save_deadline,
    in_owner_process,
    open_tiers,
)
from tierckpt.restore_gpu import stateful_device
from tierckpt.retention import pin_on_tiers, pinned_ids, unpin_on_tiers, with_metrics
from tierckpt.stats import CheckpointEvent
from tierckpt.urls import TiersLike, as_policy

__all__ = ["Checkpointer"]

log = logging.getLogger("tierckpt")

DEFAULT_CHUNK_BYTES = config.DEFAULT_CHUNK_BYTES


class Checkpointer(SavePath, Observed):
    """Saves training state through a list of tiers without stopping training.

    ``save(state, step)`` returns a :class:`SaveHandle` at once; the state is captured into
    the host arena in the background. Call ``guard(optimizer, model)`` once: the optimizer
    step then waits for an unfinished capture, and the tensors a forward pass can write (module
    buffers, loose tensors) are copied at ``save()`` while parameters and optimizer state are
    captured lazily. ``load()`` restores the newest committed checkpoint from the fastest tier
    that has it.

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`; a folder path or URL
            (``"/nvme/run1"``, ``"s3://bucket/run1"``) is that one tier (:func:`tierckpt.tier`),
            and a list may mix tiers and locations.
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
        on_event: called with a :class:`~tierckpt.stats.CheckpointEvent` for every outcome
            of every tier's copy: commits, failures, skips (``max_behind``), deadline
            give-ups, and saves skipped by ``on_busy="skip"``. More with
            :meth:`add_event_callback`; sinks in :mod:`tierckpt.integrations.sinks`.
        stats_history: how many commits :meth:`stats` remembers (default 1000).
        exit_timeout_s: when the interpreter exits with saves still in flight, how long they
            get to finish before the unfinished ones are abandoned, never committed (default
            60 s; ``TIERCKPT_EXIT_TIMEOUT_S``; 0 abandons at once). ``close()`` waits while the
            tiers make progress; ``close(timeout=)`` at most that long (``CloseTimeout`` on
            what it gives up).
        save_deadline: seconds a save may hold training behind a tier fed from the host
            arena that makes no progress (default 30; ``TIERCKPT_SAVE_DEADLINE``;
            ``float("inf")``: wait for it). Past it that tier's copy of the save is given up
            (``SaveDeadlineExceeded`` on the handle, never committed there), its arena slots
            are freed and training goes on; the next save tries the tier again. ``wait()``
            and ``close()`` give up a tier stalled for as long the same way.
    """

    def __init__(
        self,
        tiers: TiersLike,
        *,
        host_buffer_bytes: int | None = None,
        chunk_bytes: int | None = None,
        io_threads: int | None = None,
        on_busy: Literal["block", "skip"] = "block",
        rank: int | None = None,
        world_size: int | None = None,
        repopulate: bool = True,
        on_commit: Callable[[TierResult], Any] | None = None,
        on_event: Callable[[CheckpointEvent], Any] | None = None,
        stats_history: int = 1000,
        exit_timeout_s: float | None = None,
        save_deadline: float | None = None,
    ) -> None:
        self.policy = as_policy(tiers)
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
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self._tiers = open_tiers(self.policy)
        self._pipeline: Pipeline | None = None
        self._init_save_path(stats_history)
        if on_commit is not None:
            self._stats.add_callback(on_commit)
        if on_event is not None:
            self._stats.add_event_callback(on_event)
        #: copies node-RAM commits to partner nodes (a PeerTier in the policy), else None
        self._peer = open_peer(
            self.policy.tiers, self._tiers, rank=self.rank, world_size=self.world_size
        )
        if self._peer is not None:
            self._stats.add_event_callback(self._peer.on_event)
        self._closed = False
        self._pid = os.getpid()
        self._read_pool = ReadPool(max(2, self.io_threads * 2))
        self._protectors: Protectors = Protectors()  # callables naming steps to keep
        # last: nothing after this may fail and leave the arena's thread behind
        self._start_arena_prebuild()

    # -- properties ------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    @in_owner_process
    def backend(self, tier: str) -> Any:
        return self._tier(tier).backend

    def _tier(self, name: str) -> Tier:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {self.tier_names}")

    # -- save ------------------------------------------------------------------------
    @in_owner_process
    def save(
        self,
        state: Any,
        step: int,
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
    ) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`.
        ``step``: a non-negative ``int`` (a NumPy integer or a one-element integer tensor is
        taken as the int it holds; a float or a bool is refused).

        The checkpoint is the state at this call. Module buffers and loose tensors (which the
        next forward pass may write) are copied here (``h.eager_bytes``); parameters and
        optimizer state are captured lazily and must not change until ``wait_captured()``
        returns: ``guard(optimizer, model)`` enforces it and tells which tensors are which.
        Unsupported objects (and ``metadata`` that is not plain JSON) raise
        ``UnsupportedObject`` here, before anything is written.
        At the first save to a tier this checkpointer takes its writer lease there: held by a
        writer known live (another job; another ``Checkpointer`` here), ``WriterConflict`` is
        raised and nothing written (presumed live by age only: see ``tierckpt.lease``).
        ``metrics``: numbers stored with the checkpoint (in its manifest's metadata under
        ``"metrics"``), which a tier's ``keep_best`` / ``best_metric`` retention ranks by.
        """
        t0 = time.perf_counter()
        step = as_step(step)
        if self._peer is not None and self._peer.spare is not None:
            self._peer.release_spare()  # training went on without a pull into it
        try:
            merged = with_metrics(metadata, metrics)
        except BaseException as exc:  # a bad metric (NaN) on one rank: its round still runs
            self._save_not_started(step, exc)
            raise
        handle = self._save(state, step, merged)
        handle.blocked_seconds += time.perf_counter() - t0
        return handle

    @in_owner_process
    def wait_captured(self, timeout: float | None = None) -> None:
        """Block until every pending save's bytes are in host memory.

        Call it before anything modifies the saved state (the optimizer step). A failed
        capture does not raise here — training goes on, the checkpoint is not committed, and
        the error is logged and kept on the save's handle (``h.wait()`` raises it).
        """
        self._wait_captures(timeout, on_device=False)

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
        modules = as_modules(model)
        if not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise TypeError(
                f"guard() needs a torch.optim.Optimizer, got {type(optimizer).__qualname__}"
            )
        self._guarded.learn(optimizer, modules)
        me = weakref.ref(self)  # the optimizer must not keep this alive (its leases, threads)

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            ck = me()
            if ck is not None:
                ck._wait_captures(None, on_device=True)

        handle = optimizer.register_step_pre_hook(hook)
        self._guard_hooks.append(handle)  # removed by close()
        return handle

    def _learn(
        self, optimizer: torch.optim.Optimizer | None, modules: Sequence[torch.nn.Module] = ()
    ) -> None:
        """What ``guard()`` learns, for integrations that install their own wait (Lightning)."""
        self._guarded.learn(optimizer, modules)

    @in_owner_process
    def wait(self, timeout: float | None = None, *, retention: bool = False) -> None:
        """Wait for every in-flight save to finish on every tier (errors stay on handles).

        A tier that makes no progress for ``save_deadline`` seconds meanwhile has its
        pending copies given up (``SaveDeadlineExceeded``), so a dead tier is waited for
        about that long, not its timeouts times the saves queued for it.

        Finished means durable and committed: the retention pass that deletes the older
        checkpoints a tier's rules no longer keep runs after that, on the tier's thread,
        before its next save there. ``retention=True`` waits for those passes too (the old
        checkpoints are gone on return); ``close()`` waits for them too, except for a pass
        blocked for ``save_deadline`` in a store that stopped answering.
        """
        if self._pipeline is None:
            return
        end = None if timeout is None else time.monotonic() + timeout
        if not self._pipeline.drain(timeout):
            steps = sorted(j.step for j in self._pipeline.in_flight())
            raise TimeoutError(f"steps {steps} not finished after {timeout} s")
        left = None if end is None else max(0.0, end - time.monotonic())
        if retention and not self._pipeline.wait_retention(left):
            raise TimeoutError(f"retention still deleting old checkpoints after {timeout} s")

    # -- listing -----------------------------------------------------------------------
    @in_owner_process
    def checkpoints(self, tier: str | None = None) -> list[CheckpointId]:
        """Committed checkpoints, oldest first: on ``tier``, or on any tier. The last one is
        the newest, what ``load()`` returns. After a rollback this includes the abandoned
        timeline's checkpoints that retention has not removed yet (older than every
        checkpoint of the newer timeline, whatever their step numbers). The retention passes
        of commits already reported done are waited for first, so a checkpoint they delete
        is not listed. A tier that cannot be listed is logged and left out; where none of
        the others holds a checkpoint this raises :class:`~tierckpt.errors.TiersUnreadable`
        (not an empty list: whether one exists is unknown), as do :meth:`steps`,
        :meth:`latest_step` and :meth:`load` (not ``CheckpointNotFound``)."""
        self._settle_retention(tier)
        return list_checkpoints(self._load_context(), tier, hint=True)

    @in_owner_process
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

    @in_owner_process
    def latest_step(self, tier: str | None = None, *, timeline: int | None = None) -> int | None:
        """The newest committed step (on ``tier``, or on any tier); None when there is none.

        Newest as :meth:`load` means it: the newest step of the newest timeline, so after a
        rollback this is the resumed run's step even when the abandoned run reached a higher
        one. ``timeline``: the newest step of that timeline only.
        """
        ids = self.checkpoints(tier)
        if timeline is not None:
            ids = [c for c in ids if c.timeline == timeline]
        return ids[-1].step if ids else None

    @in_owner_process
    def tier_steps(self) -> dict[str, list[int]]:
        """Which steps are committed on which tier (each list in :meth:`steps` order). A
        tier that cannot be listed (down, or silent for ``TIERCKPT_LEASE_WAIT_S`` while
        another answered) is left out, with a warning; where none could be listed this raises
        :class:`~tierckpt.errors.TiersUnreadable`."""
        self._settle_retention()
        return {n: steps_of(ids) for n, ids in list_each_tier(self._load_context()).items()}

    def _settle_retention(self, tier: str | None = None) -> None:
        """Wait for the retention passes already started on ``tier`` (None: every tier; see
        :meth:`wait`): this object's listings never show a checkpoint that a commit reported
        done is about to delete. At most ``TIERCKPT_LEASE_WAIT_S``, as a listing waits for a
        silent store: a pass blocked in one (an S3 outage) held ``steps("local")`` a minute."""
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.wait_retention(config.lease_wait_s(), tiers=None if tier is None else {tier})

    # -- pins --------------------------------------------------------------------------
    @in_owner_process
    def pin(self, step: int, *, timeline: int | None = None, reason: str = "") -> CheckpointId:
        """Keep checkpoint ``step`` on every tier until :meth:`unpin`: retention never removes
        a pinned checkpoint. The pin is a small marker stored on each tier, so it survives
        restarts; the step may still be in flight. ``timeline``: default, the one being saved,
        else the newest holding ``step``. Returns the pinned checkpoint."""
        cid = pin_target(
            as_step(step),
            timeline,
            in_flight=self._pipeline.in_flight() if self._pipeline is not None else (),
            last_saved=self._last_saved,
            committed=self.checkpoints,
            tier_names=self.tier_names,
        )
        pin_on_tiers([(t.name, t.backend) for t in self._tiers], cid, reason=reason)
        return cid

    @in_owner_process
    def unpin(self, step: int, *, timeline: int | None = None) -> None:
        """Let retention remove checkpoint ``step`` again (it goes at the next commit if no
        other rule keeps it). Unpinning a step that is not pinned does nothing."""
        step = as_step(step)
        pinned = [
            c
            for c in self.pinned()
            if c.step == step and (timeline is None or c.timeline == timeline)
        ]
        for cid in pinned:
            unpin_on_tiers([(t.name, t.backend) for t in self._tiers], cid)

    @in_owner_process
    def pinned(self) -> list[CheckpointId]:
        """The checkpoints pinned on any tier, oldest first."""
        out: set[CheckpointId] = set()
        for t in self._tiers:
            out.update(pinned_ids(t.backend))
        return sorted(out)

    def protect_steps(self, fn: Callable[[], Iterable[int]]) -> Callable[[], None]:
        """Ask ``fn()`` at every retention which steps it must keep on every tier (an
        integration's live pointers, e.g. Lightning's ``ModelCheckpoint`` files; a load's step
        while it is read). ``fn`` runs on a background thread; if it raises, that retention
        is skipped (logged). Returns a function that removes ``fn``."""
        return self._protectors.add(fn)

    # -- load --------------------------------------------------------------------------
    @in_owner_process
    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        tier: str | None = None,
        map_location: str | torch.device | None = None,
        fallback: Literal["error", "previous"] = "error",
        timeline: int | None = None,
        strict: bool = True,
    ) -> Any:
        """Load the newest committed checkpoint (or ``step``) from the fastest tier holding it.

        The newest checkpoint is the newest step of the newest timeline (a run resumed from an
        older step saves on a new timeline; see :class:`~tierckpt.format.CheckpointId`).
        ``step``: that step, of the newest timeline holding it; ``timeline``: only that
        timeline's checkpoints. ``into``: copy into these existing tensors in place (shapes
        must match; a tensor of another floating-point dtype is cast, as ``load_state_dict``
        does) and return it (NumPy arrays too, of the same dtype; a tuple is rebuilt with the
        checkpoint's values); ``strict=False``: restore only the keys both hold (the others
        stay as they are, logged), as ``load_state_dict(strict=False)`` does; a target that
        shares no key with the checkpoint is refused either way. ``nn.Parameter`` values
        come back as Parameters with their ``requires_grad``, as with ``torch.load``.
        ``fallback="previous"``: if every tier's copy is unreadable, try older checkpoints of
        the same history (older steps of its timeline, then the steps of older timelines
        below the point where the newer one branched off; never steps of an abandoned run).
        ``map_location``: device of the returned tensors (default CPU; NumPy arrays stay on
        the CPU).

        The next ``save()`` after a load chooses its timeline again: a step after the newest
        committed one continues its timeline; an older or equal one starts a new timeline.

        This Checkpointer's own saves keep the checkpoint a load reads until it is read (and
        ``into`` waits for their captures). Beside another process's writer: when its retention
        removes the chosen checkpoint mid-read, the newest is loaded instead (``LOAD_ATTEMPTS``).

        A top-level value of ``into`` with ``state_dict()`` / ``load_state_dict()`` (DCP's
        ``Stateful``: a module, an optimizer, a user class) gets its part of the checkpoint
        through ``load_state_dict()``, as ``save()`` took it through ``state_dict()``; so does
        ``into`` itself where it is one (``load(into=model)``), all checked first (an
        optimizer's part, which only its ``load_state_dict()`` checks, is handed over first:
        where it refuses, every part is put back and a ``StateMismatch`` names it).
        """
        step = None if step is None else as_step(step, "load")
        map_location = as_map_location(map_location)
        if into is not None:  # this writer's saves in flight still copy what it overwrites
            self._wait_captures(None, on_device=False)
        if tier is not None and self._peer is not None:
            self._peer.release_spare()  # a load of one tier pulls nothing from partners

        def read(**kw: Any) -> Any:
            return load(
                self._load_context(),
                step,
                tier=tier,
                map_location=map_location,
                fallback=fallback,
                timeline=timeline,
                **kw,
            )

        with self._read_pool.in_use():  # a close() meanwhile ends them after this load
            try:
                if has_stateful(into):
                    # restored onto the targets' GPU where it has room, then handed over (the
                    # device is looked at once load_stateful has checked the targets)
                    def device() -> Any:
                        return stateful_device(into) if map_location is None else None

                    return load_stateful(
                        into, lambda: read(into=None, device=device()), strict=strict
                    )
                return read(into=into, strict=strict)
            finally:
                if self._closed:  # a load after close(): its reader threads end with it
                    self._read_pool.release()

    def _load_context(self) -> LoadContext:
        """What a load needs from this object, as it is now."""
        return LoadContext(
            tiers=self._tiers,
            rank=self.rank,
            world_size=self.world_size,
            strategy=self._strategy,
            tier_named=self._tier,
            read_pool=self._read_pool.get,
            forget_timeline=self._forget_timeline,
            staging=self._arena_for_load,
            prepare_load=self._peer.prepare_load if self._peer is not None else None,
            protectors=self._protectors,
            saving=self._saving_steps,
        )

    def _saving_steps(self) -> list[int]:
        pipeline = self._pipeline
        return sorted({j.step for j in pipeline.in_flight()}) if pipeline is not None else []

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

    def _release(self) -> None:
        for handle in self._guard_hooks:
            handle.remove()
        self._strategy.settle()  # rank 0: the other nodes' copies of its last commits
        if self._peer is not None:
            self._peer.close()
        self._read_pool.release()
