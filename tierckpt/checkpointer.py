"""Checkpointer: save / load / wait / close — what users touch."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal

import torch

from tierckpt import __version__
from tierckpt.arena import default_host_buffer_bytes
from tierckpt.capture import record_ready_events
from tierckpt.errors import CheckpointFailed, CheckpointNotFound, CorruptCheckpoint, TierCkptError
from tierckpt.format import Manifest, ShardRef, encode_manifest, manifest_name
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.objects import encode_metadata
from tierckpt.observe import CommitStats, StatsRecorder
from tierckpt.pipeline import Pipeline, PipelineOwner, SaveJob, TierRuntime
from tierckpt.plan import collect_state
from tierckpt.policy import TierPolicy, TierSpec, resolve_codec
from tierckpt.restore import (
    LoadedShard,
    is_recoverable,
    read_manifest,
    read_shard,
    restore_into,
)
from tierckpt.retention import committed_steps

__all__ = ["Checkpointer"]

log = logging.getLogger("tierckpt")

DEFAULT_CHUNK_BYTES = 64 << 20


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v else default


class Checkpointer(PipelineOwner):
    """Saves training state through a list of tiers without stopping training.

    ``save(state, step)`` returns a :class:`SaveHandle` at once; the state is captured into
    the host arena in the background. Call :meth:`wait_captured` before the optimizer changes
    the state (``guard(optimizer)`` does it for you), and ``load()`` to restore the newest
    committed checkpoint from the fastest tier that has it.

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`.
        host_buffer_bytes: the host arena budget (default: 1/8 of RAM, at most 32 GiB;
            ``TIERCKPT_HOST_BUFFER_BYTES``). Peak extra host memory of a save is this, not
            the size of the state.
        chunk_bytes: target chunk size (default 64 MiB; ``TIERCKPT_CHUNK_BYTES``).
        io_threads: encoder / reader threads (default 2; ``TIERCKPT_IO_THREADS``).
        on_busy: ``"block"`` (default): a save requested while earlier ones are still
            flushing waits for arena space in the background; ``"skip"``: it is skipped
            (the handle says ``skipped``) so training never waits on slow storage.
        rank, world_size: default from ``torch.distributed`` when initialized, else 0 / 1.
        repopulate: when a load reads from a remote tier, also write the checkpoint to the
            local durable tiers so the next restart reads locally (default True).
        on_commit: called with a :class:`TierResult` each time a checkpoint commits on a
            tier (on a background thread; see :mod:`tierckpt.observe`). More with
            :meth:`add_callback`.
        stats_history: how many commits :meth:`stats` remembers (default 1000).
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
    ) -> None:
        self.policy = tiers if isinstance(tiers, TierPolicy) else TierPolicy(list(tiers))
        if on_busy not in ("block", "skip"):
            raise ValueError(f"on_busy must be 'block' or 'skip', got {on_busy!r}")
        self.on_busy = on_busy
        self.host_buffer_bytes = host_buffer_bytes or default_host_buffer_bytes()
        chunk = chunk_bytes or _env_int("TIERCKPT_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
        # keep at least 4 slots in the arena so capture and writes overlap
        chunk = min(chunk, max(4096, self.host_buffer_bytes // 4 // 4096 * 4096))
        if chunk < 4096 or chunk % 4096:
            raise ValueError(f"chunk_bytes must be a multiple of 4096, got {chunk}")
        self.chunk_bytes = chunk
        self.io_threads = io_threads or _env_int("TIERCKPT_IO_THREADS", 2)
        self.repopulate = repopulate
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size}")
        self._tiers = [
            TierRuntime(spec, backend := spec.make_backend(), resolve_codec(spec.codec, backend))
            for spec in self.policy
        ]
        self._pipeline: Pipeline | None = None
        self._save_count = 0
        self._lock = threading.Lock()
        self._last: SaveHandle | None = None
        self._stats = StatsRecorder(stats_history)
        if on_commit is not None:
            self._stats.add_callback(on_commit)
        self._closed = False
        self._read_pool: ThreadPoolExecutor | None = None

    # -- properties ------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self._tiers]

    def backend(self, tier: str) -> Any:
        return self._tier(tier).backend

    def _tier(self, name: str) -> TierRuntime:
        for t in self._tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers are {self.tier_names}")

    def _pipeline_hooks(self) -> dict[str, Any]:
        return {
            "commit": self._commit,
            "on_result": self._stats.record,
            "on_failure": self._report_failure,
        }

    # -- save ------------------------------------------------------------------------
    def save(self, state: Any, step: int, *, metadata: dict[str, Any] | None = None) -> SaveHandle:
        """Start saving ``state`` as ``step``; returns at once with a :class:`SaveHandle`.

        The state must not change until ``wait_captured()`` returns (the optimizer step):
        ``guard(optimizer)`` enforces it. Unsupported objects (and ``metadata`` that is not
        plain JSON) raise ``UnsupportedObject`` here, before anything is written.
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
        attempt = ""
        if self.world_size > 1:
            # an attempt id for the completion records (one all-reduce at the first save; at
            # every save with on_busy="skip", so that all ranks skip together)
            from tierckpt.distributed import begin_save

            attempt, busy = begin_save(self, step, busy)
        if self.on_busy == "skip" and busy:
            log.warning("step %d skipped: the previous checkpoint is still flushing", step)
            handle = SaveHandle(step, tuple(t.name for t in tiers), skipped=True)
            return handle
        # only the walk (validation + tensor references) runs here; the layout is computed by
        # the capture thread, so training pays microseconds per tensor, not the whole plan
        collected = collect_state(state)

        handle = SaveHandle(step, tuple(t.name for t in tiers))
        if not tiers:
            return handle
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
        )
        self._last = handle
        pipeline.submit(job)
        return handle

    def _report_failure(self, tier: TierRuntime, job: SaveJob, error: BaseException) -> None:
        if job.world_size != 1:
            from tierckpt.distributed import report_failure

            report_failure(tier, job, error)

    def _commit(
        self, tier: TierRuntime, job: SaveJob, ref: ShardRef, raw: int, stored: int
    ) -> Future[None] | None:
        """Single-rank commit: the manifest, written last and create-only."""
        if job.world_size != 1:
            from tierckpt.distributed import commit_multi_rank

            return commit_multi_rank(self, tier, job, ref, raw, stored)
        m = Manifest(
            step=job.step,
            world_size=1,
            shards=(ref,),
            created=time.time(),
            library_version=__version__,
            tier=tier.name,
            raw_bytes=raw,
            stored_bytes=stored,
            codecs=(tier.codec.codec_id,),
            metadata=job.metadata,
        )
        tier.backend.put_atomic(manifest_name(job.step), encode_manifest(m))
        return None

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

    def guard(self, optimizer: torch.optim.Optimizer) -> Any:
        """Make ``optimizer.step()`` wait for pending captures. Returns the hook handle."""

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            self.wait_captured()

        return optimizer.register_step_pre_hook(hook)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for every in-flight save to finish on every tier (errors stay on handles)."""
        if self._pipeline is None:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self._pipeline.in_flight():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            for t in job.handle.tiers:
                if not job.handle._tier_events[t].wait(remaining):
                    raise TimeoutError(f"step {job.step} not finished after {timeout} s")

    # -- listing -----------------------------------------------------------------------
    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending: on ``tier``, or on any tier."""
        if tier is not None:
            return committed_steps(self._tier(tier).backend)
        out: set[int] = set()
        for t in self._tiers:
            try:
                out.update(committed_steps(t.backend))
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
        return sorted(out)

    def tier_steps(self) -> dict[str, list[int]]:
        """Which steps are committed on which tier."""
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
    ) -> Any:
        """Load the newest committed checkpoint (or ``step``) from the fastest tier holding it.

        ``into``: copy into these existing tensors in place (shapes and dtypes must match)
        and return it. ``fallback="previous"``: if every tier's copy of the newest step is
        unreadable, try older committed steps. ``map_location``: device of the returned
        tensors (default CPU).
        """
        if fallback not in ("error", "previous"):
            raise ValueError("fallback must be 'error' or 'previous'")
        tiers = [self._tier(tier)] if tier is not None else self._tiers
        listing: dict[str, list[int]] = {}
        for t in tiers:
            try:
                listing[t.name] = committed_steps(t.backend)
            except TierCkptError as exc:
                log.warning("cannot list tier %s: %s", t.name, exc)
                listing[t.name] = []
        all_steps = sorted({s for v in listing.values() for s in v}, reverse=True)
        if step is not None:
            if step not in all_steps and self.world_size > 1:
                candidates = [step]  # agree_on_step below raises on every rank, not just here
            elif step not in all_steps:
                raise CheckpointNotFound(
                    f"step {step} is not committed on any tier "
                    f"({', '.join(t.name for t in tiers)}); committed steps: "
                    f"{sorted(all_steps)[-10:] or 'none'}"
                )
            else:
                candidates = [step] + (
                    [s for s in all_steps if s < step] if fallback == "previous" else []
                )
        else:
            if not all_steps and self.world_size == 1:
                raise CheckpointNotFound(
                    f"no committed checkpoint on any tier ({', '.join(t.name for t in tiers)})"
                )
            candidates = all_steps if fallback == "previous" else all_steps[:1]
        if self.world_size > 1:
            # every rank must load the same step: agree on the newest one all ranks can read
            from tierckpt.distributed import agree_on_step, publish_repopulated, repopulates

            candidates = agree_on_step(self, candidates)
            if repopulates(self):
                # the copies to faster tiers become a checkpoint there only once every rank's
                # file is in: one collective, reached by every rank whether its load worked
                got: LoadedShard | None = None
                try:
                    got = self._load_candidates(tiers, listing, candidates, publish=False)
                finally:
                    publish_repopulated(self, got)
                assert got is not None
                return self._deliver(got, into, map_location)
        loaded = self._load_candidates(tiers, listing, candidates, publish=True)
        return self._deliver(loaded, into, map_location)

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
        tiers: list[TierRuntime],
        listing: dict[str, list[int]],
        candidates: list[int],
        *,
        publish: bool,
    ) -> LoadedShard:
        """The first readable copy of the first candidate step, tiers fastest first."""
        errors: list[str] = []
        first_exc: BaseException | None = None
        for s in candidates:
            holders = [t for t in tiers if s in listing[t.name]]
            for t in holders:
                try:
                    loaded = self._load_from(t, s, publish=publish)
                except BaseException as exc:
                    if not is_recoverable(exc):
                        raise
                    first_exc = first_exc or exc
                    errors.append(f"step {s} on tier {t.name!r}: {exc}")
                    log.warning(
                        "load of step %d from tier %s failed, trying the next: %s", s, t.name, exc
                    )
                    continue
                log.info(
                    "loaded step %d from tier %s: %d bytes in %.3f s",
                    s,
                    t.name,
                    loaded.raw_bytes,
                    loaded.seconds,
                )
                return loaded
        msg = "no readable copy of the checkpoint: " + "; ".join(errors)
        if isinstance(first_exc, CorruptCheckpoint):
            raise CorruptCheckpoint(msg) from first_exc
        if isinstance(first_exc, TierCkptError):
            raise type(first_exc)(msg) from first_exc
        raise CorruptCheckpoint(msg) from first_exc

    def _load_from(self, tier: TierRuntime, step: int, *, publish: bool = True) -> LoadedShard:
        manifest = read_manifest(tier.backend, step, tier.name)
        if manifest.world_size != self.world_size:
            raise TierCkptError(
                f"step {step} was saved by {manifest.world_size} ranks, this job has "
                f"{self.world_size}; the native format needs the same world size — save with "
                "tierckpt.dcp (torch.distributed.checkpoint) to reshard"
            )
        repop = []
        if self.repopulate and tier.backend.is_remote and (self.world_size == 1 or not publish):
            for t in self._tiers:
                if (
                    t.backend.is_durable
                    and not t.backend.is_remote
                    and t.backend.supports_random_write
                    and not t.backend.exists(manifest_name(step))
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
            publish=publish,
        )

    # -- stats / lifecycle ------------------------------------------------------------
    def stats(self) -> list[CommitStats]:
        """One :class:`CommitStats` per checkpoint per tier committed so far, oldest first.

        Step, tier, raw and stored bytes, seconds from ``save()`` to the commit, GB/s,
        compression ratio and the seconds training was blocked by that save. The history is
        bounded (``stats_history``, default the last 1000 commits).
        """
        return self._stats.stats()

    def add_callback(self, fn: Callable[[TierResult], Any]) -> Callable[[TierResult], Any]:
        """Call ``fn(result)`` on every commit on every tier (see :mod:`tierckpt.observe`)."""
        return self._stats.add_callback(fn)

    def remove_callback(self, fn: Callable[[TierResult], Any]) -> None:
        self._stats.remove_callback(fn)

    def _release(self) -> None:
        if self._read_pool is not None:
            self._read_pool.shutdown()
            self._read_pool = None


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
