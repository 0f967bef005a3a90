"""Background stages: capture → encode → write per tier → commit. All threads live here.

One capture thread copies chunks into the host arena (waiting for free slots: backpressure).
As soon as a chunk is in the arena it is encoded on a small pool (once per distinct codec
among the tiers; the raw codec costs only a checksum) and handed to every tier's writer
thread, in tier order. A tier thread writes its chunks in sequence, so S3 multipart parts go
out in order while the local tier pwrites at its own pace; a chunk's arena slot is released
once every tier has written it. After the last chunk each tier writes the index and footer,
makes the file durable and commits (manifest last), then applies retention. A failure on one
tier fails that tier's copy of that checkpoint only; it is reported on the handle and in the
log, and the next save starts clean.

A tier with a ``source`` (e.g. S3 behind the local disk) takes no chunks from the arena: once
the source tier's file is durable, the follower's thread reads it back chunk by chunk, checks
each chunk's checksum, re-encodes it for its own codec when that differs, and writes it. So a
slow tier never holds arena slots, and capture goes at the pace of the tiers fed directly.

Whoever wants to know where a save's time goes (``tierckpt bench``'s per-stage breakdown)
subscribes to :class:`StageEvent` s with :meth:`Pipeline.subscribe`; with no subscriber no
stage is timed for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch

from tierckpt._types import BytesLike
from tierckpt.arena import HostArena
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.capture import CaptureStreams, copy_chunk
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import BackendError, FormatError, TierCkptError
from tierckpt.format import (
    CHECKSUM_ALGO,
    FOOTER_SIZE,
    FORMAT_VERSION,
    CheckpointId,
    ChunkRecord,
    Footer,
    ShardRef,
    align_up,
    checksum,
    encode_index,
    manifest_name,
    shard_name,
)
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.plan import ChunkPlan, CollectedState, SavePlan, layout_plan
from tierckpt.policy import TierSpec
from tierckpt.restore import read_verified
from tierckpt.retention import gc_tier

__all__ = ["Pipeline", "SaveJob", "StageEvent", "TierRuntime"]

log = logging.getLogger("tierckpt")
_ZEROS = bytes(4096)


#: the stages a save goes through, in order: ``plan`` (lay the chunks out), ``arena_wait``
#: (wait for a free arena slot: backpressure), ``capture`` (copy a chunk into the arena; for
#: a CUDA tensor, queueing the copy), ``encode`` (compress; not for raw), ``checksum``,
#: ``write`` (a chunk, or the index and footer, to one tier), ``sync`` (that tier's file made
#: durable: fsync + rename, or the multipart upload completed), ``commit`` (the manifest)
Stage = Literal["plan", "arena_wait", "capture", "encode", "checksum", "write", "sync", "commit"]


@dataclass(frozen=True, slots=True)
class StageEvent:
    """One stage's work on one piece of one save, as the pipeline did it.

    ``tier`` is None for the work shared by every tier fed from the arena (plan, arena wait,
    capture, and encode/checksum, which run once per distinct codec); ``nbytes`` is what the
    stage handled (raw bytes in for capture and encode, stored bytes for checksum and write,
    the file's size for sync, the state's raw bytes for plan and commit).
    """

    stage: Stage
    step: int
    tier: str | None
    nbytes: int
    seconds: float


#: receives every StageEvent, on the pipeline's own threads (several at once): it must be
#: quick and thread-safe; an exception it raises is logged and otherwise ignored
StageListener = Callable[[StageEvent], None]
#: reports one stage (stage, nbytes, seconds) of one job, on one tier or none
_Emit = Callable[[Stage, int, float], None]


@dataclass
class TierRuntime:
    spec: TierSpec
    backend: Backend
    codec: Codec

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True, slots=True)
class Encoded:
    data: BytesLike
    checksum: str
    codec_config: dict[str, Any]


@dataclass
class _ChunkState:
    plan: ChunkPlan
    slot: int
    remaining: int
    encoded: dict[Codec, Future[Encoded]] = field(default_factory=dict)


@dataclass
class _Follow:
    """A follower tier's wait for its source tier's durable file of one job."""

    source: TierRuntime
    #: (file name, chunk records, codec table) of the source's file, or the source's error
    done: Future[tuple[str, list[list[Any]], list[dict[str, Any]]]] = field(default_factory=Future)


@dataclass
class SaveJob:
    step: int
    #: the layout; None until the capture thread lays ``collected`` out
    plan: SavePlan | None
    tiers: list[TierRuntime]
    handle: SaveHandle
    rank: int
    world_size: int
    ready_events: dict[torch.device, Any]
    metadata: dict[str, Any]
    capture_error: BaseException | None = None
    #: what save() collected (tree + tensor references), laid out by the capture thread
    collected: CollectedState | None = None
    chunk_bytes: int = 0

    @property
    def laid_out(self) -> SavePlan:
        assert self.plan is not None, "the capture thread lays the plan out first"
        return self.plan

    #: multi-rank saves: the id all ranks agreed on for this attempt (tierckpt.distributed)
    attempt: str = ""
    #: follower tier name -> its source; set by the capture thread
    follows: dict[str, _Follow] = field(default_factory=dict)
    #: the timeline this checkpoint is saved on (chosen by the owner, see CheckpointId)
    timeline: int = 0

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.step, self.timeline)

    @property
    def shard(self) -> str:
        """This rank's shard file name."""
        return shard_name(self.step, self.rank, timeline=self.timeline)


@dataclass
class _TierWrite:
    """One tier's progress on one job."""

    writer: ObjectWriter | None = None
    offset: int = 0
    records: list[list[Any]] = field(default_factory=list)
    codecs: list[dict[str, Any]] = field(default_factory=list)
    stored: int = 0
    error: BaseException | None = None
    write_seconds: float = 0.0
    #: this tier's stage reporter for the job; None when nobody listens
    emit: _Emit | None = None


#: commits one tier's copy; returns None when done, or a Future (from ``Pipeline.defer``) that
#: completes once committed — multi-rank rank 0 waits for the other ranks that way, without
#: holding the tier's writer thread
CommitFn = Callable[[TierRuntime, SaveJob, ShardRef, int, int], "Future[None] | None"]


class Pipeline:
    def __init__(
        self,
        tiers: list[TierRuntime],
        *,
        chunk_bytes: int,
        host_buffer_bytes: int,
        io_threads: int,
        commit: CommitFn,
        on_result: Callable[[TierResult, SaveHandle], None] | None = None,
        on_failure: Callable[[TierRuntime, SaveJob, BaseException], None] | None = None,
        retains: Callable[[TierRuntime, SaveJob], bool] | None = None,
    ) -> None:
        self.tiers = tiers
        self.on_result = on_result
        self.on_failure = on_failure
        #: whether this rank applies a tier's retention once a job committed there; default:
        #: rank 0 (the other ranks' copies are on the same storage)
        self.retains = retains or _rank_zero_retains
        self.chunk_bytes = chunk_bytes
        self.host_buffer_bytes = host_buffer_bytes
        self.commit = commit
        self.arena: HostArena | None = None
        self._streams = CaptureStreams()
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="tierckpt-encode")
        self._commit_pool: ThreadPoolExecutor | None = None  # deferred commits, made on demand
        self._capture_q: queue.Queue[SaveJob | None] = queue.Queue()
        self._tier_q: dict[str, queue.Queue[tuple[str, SaveJob, Any] | None]] = {
            t.name: queue.Queue() for t in tiers
        }
        self._lock = threading.Lock()
        self._in_flight: list[SaveJob] = []
        self._closed = False
        #: replaced, never mutated, so threads iterate a snapshot without the lock
        self._listeners: tuple[StageListener, ...] = ()
        self._threads = [
            threading.Thread(target=self._capture_loop, name="tierckpt-capture", daemon=True)
        ]
        for t in tiers:
            self._threads.append(
                threading.Thread(
                    target=self._tier_loop, args=(t,), name=f"tierckpt-{t.name}", daemon=True
                )
            )
        for th in self._threads:
            th.start()

    # -- public ----------------------------------------------------------------------
    def submit(self, job: SaveJob) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the checkpointer is closed")
            self._in_flight.append(job)
        self._capture_q.put(job)

    def defer(self, fn: Callable[[], None]) -> Future[None]:
        """Run a commit's waiting part (``fn``) off the tier's writer thread."""
        with self._lock:
            if self._commit_pool is None:
                self._commit_pool = ThreadPoolExecutor(4, thread_name_prefix="tierckpt-commit")
            return self._commit_pool.submit(fn)

    def subscribe(self, listener: StageListener) -> Callable[[], None]:
        """Send every :class:`StageEvent` of the saves that start from now on to ``listener``
        (see :data:`StageListener`); returns the function that unsubscribes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def _emitter(self, step: int, tier: str | None) -> _Emit | None:
        """The reporter of ``step``'s stages on ``tier`` (None: shared work), or None when
        nobody listens, so that then no stage is timed."""
        listeners = self._listeners
        if not listeners:
            return None

        def emit(stage: Stage, nbytes: int, seconds: float) -> None:
            event = StageEvent(stage, step, tier, nbytes, seconds)
            for fn in listeners:
                try:
                    fn(event)
                except Exception:  # a profiler's bug must not fail a checkpoint
                    log.exception("stage listener %r failed on %s", fn, event)

        return emit

    def in_flight(self) -> list[SaveJob]:
        with self._lock:
            return list(self._in_flight)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._capture_q.put(None)
        for th in self._threads:
            th.join()
        with self._lock:
            commit_pool = self._commit_pool
        if commit_pool is not None:
            commit_pool.shutdown(wait=True)  # each deferred commit is bounded by its timeout
        self._pool.shutdown(wait=True)
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    # -- capture ---------------------------------------------------------------------
    def _ensure_arena(self, plan: SavePlan) -> HostArena:
        """The arena, grown (once, between saves) if this plan needs bigger or more slots."""
        biggest = max((c.raw_size for c in plan.chunks), default=0)
        slot = align_up(max(biggest, 4096))
        a = self.arena
        if a is not None:
            slot = max(slot, a.slot_bytes)
        cap = max(2, self.host_buffer_bytes // slot)
        want = min(max(2, len(plan.chunks), a.n_slots if a else 0), cap)
        if a is not None and a.slot_bytes >= slot and a.n_slots >= want:
            return a
        if a is not None:
            a.wait_idle()  # a bigger state than any before: grow once, between saves
            a.close()
        self.arena = HostArena(want, slot)
        log.debug(
            "host arena: %d slots x %d bytes (%.2f s to allocate)",
            want,
            slot,
            self.arena.alloc_seconds,
        )
        return self.arena

    def _capture_loop(self) -> None:
        while True:
            job = self._capture_q.get()
            if job is None:
                for q in self._tier_q.values():
                    q.put(None)
                return
            try:
                self._capture(job)
            except BaseException as exc:
                job.capture_error = exc
                log.error("step %d: capture failed: %s", job.step, exc)
                job.handle._set_captured(exc)
            for t in job.tiers:
                self._tier_q[t.name].put(("end", job, None))

    def _capture(self, job: SaveJob) -> None:
        emit = self._emitter(job.step, None)
        if job.plan is None:
            assert job.collected is not None
            t0 = time.perf_counter() if emit else 0.0
            job.plan = layout_plan(job.collected, job.chunk_bytes or self.chunk_bytes)
            job.collected = None
            if emit is not None:
                emit("plan", job.plan.data_bytes, time.perf_counter() - t0)
        plan = job.plan
        by_name = {t.name: t for t in job.tiers}
        job.follows = {
            t.name: _Follow(by_name[t.spec.source])
            for t in job.tiers
            if t.spec.source is not None and t.spec.source in by_name
        }
        direct = [t for t in job.tiers if t.name not in job.follows]
        a = self._ensure_arena(plan)
        for t in job.tiers:
            self._tier_q[t.name].put(("start", job, None))
        codecs = {t.codec for t in direct}
        events = []
        for chunk in plan.chunks:
            t0 = time.perf_counter() if emit else 0.0
            slot = a.acquire()
            try:
                t1 = time.perf_counter() if emit else 0.0
                slot_t = a.slot(slot)
                event = copy_chunk(plan, chunk, slot_t, self._streams, job.ready_events)
            except BaseException:
                a.release(slot)
                raise
            if emit is not None:
                emit("arena_wait", chunk.raw_size, t1 - t0)
                emit("capture", chunk.raw_size, time.perf_counter() - t1)
            if event is not None:
                events.append(event)
            state = _ChunkState(chunk, slot, remaining=len(direct))
            view = memoryview(slot_t[: chunk.raw_size].numpy())  # type: ignore[arg-type]
            for codec in codecs:
                state.encoded[codec] = self._pool.submit(
                    _encode, codec, chunk.dtype, view, event, emit
                )
            for t in direct:
                self._tier_q[t.name].put(("chunk", job, state))
        for ev in events:
            ev.synchronize()
        job.handle._set_captured()

    # -- tiers -----------------------------------------------------------------------
    def _release(self, state: _ChunkState) -> None:
        with self._lock:
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            state.encoded.clear()
            assert self.arena is not None
            self.arena.release(state.slot)

    def _tier_loop(self, tier: TierRuntime) -> None:
        q = self._tier_q[tier.name]
        progress: dict[int, _TierWrite] = {}
        while True:
            item = q.get()
            if item is None:
                return
            kind, job, payload = item
            tw = progress.setdefault(id(job), _TierWrite())
            try:
                if kind == "start":
                    self._tier_start(tier, job, tw)
                elif kind == "chunk":
                    try:
                        if tw.error is None:
                            self._tier_chunk(tier, job, tw, payload)
                    finally:
                        self._release(payload)
                elif kind == "end":
                    del progress[id(job)]
                    self._tier_end(tier, job, tw)
            except BaseException as exc:
                tw.error = exc
                if tw.writer is not None:
                    tw.writer.abort()
                    tw.writer = None
                if kind == "end":
                    self._source_done(tier, job, None, exc)
                    self._finish(tier, job, None, exc)

    def _tier_start(self, tier: TierRuntime, job: SaveJob, tw: _TierWrite) -> None:
        if tier.backend.exists(manifest_name(job.step, timeline=job.timeline)):
            raise FileExistsError(
                f"{job.id} is already committed on tier {tier.name!r} "
                f"({tier.backend.url}); refusing to overwrite it — save under another step or "
                "delete the old one first (tierckpt gc)"
            )
        tw.writer = tier.backend.open_writer(job.shard)
        tw.emit = self._emitter(job.step, tier.name)

    def _tier_chunk(
        self, tier: TierRuntime, job: SaveJob, tw: _TierWrite, state: _ChunkState
    ) -> None:
        self._append(tier, tw, state.plan, state.encoded[tier.codec].result())

    def _append(self, tier: TierRuntime, tw: _TierWrite, chunk: ChunkPlan, enc: Encoded) -> None:
        """Write one encoded chunk at the next aligned offset and record it."""
        assert tw.writer is not None
        start = align_up(tw.offset)
        if start > tw.offset and not tier.backend.supports_random_write:
            tw.writer.write(tw.offset, _ZEROS[: start - tw.offset])
        t0 = time.perf_counter()
        tw.writer.write(start, enc.data)
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        n = len(memoryview(enc.data).cast("B"))
        if tw.emit is not None:
            tw.emit("write", n, seconds)
        try:
            codec_idx = tw.codecs.index(enc.codec_config)
        except ValueError:
            tw.codecs.append(enc.codec_config)
            codec_idx = len(tw.codecs) - 1
        rec = ChunkRecord(chunk.logical_offset, chunk.raw_size, n, start, codec_idx, enc.checksum)
        tw.records.append(rec.to_json())
        tw.offset = start + n
        tw.stored += n

    def _tier_end(self, tier: TierRuntime, job: SaveJob, tw: _TierWrite) -> None:
        if job.capture_error is not None:
            raise job.capture_error
        if tw.error is not None:
            raise tw.error
        follow = job.follows.get(tier.name)
        if follow is not None:
            self._copy_from_source(tier, job, tw, follow)
        assert tw.writer is not None
        index = {
            "format": "tierckpt-shard",
            "version": FORMAT_VERSION,
            "step": job.step,
            **({"timeline": job.timeline} if job.timeline else {}),
            "rank": job.rank,
            "world_size": job.world_size,
            "checksum_algo": CHECKSUM_ALGO,
            "codecs": tw.codecs,
            "chunks": tw.records,
            **job.laid_out.index_skeleton(),
        }
        blob = encode_index(index)
        index_offset = tw.offset
        t0 = time.perf_counter() if tw.emit else 0.0
        tw.writer.write(index_offset, blob)
        size = index_offset + len(blob) + FOOTER_SIZE
        footer = Footer(index_offset, len(blob), checksum(blob), size)
        tw.writer.write(index_offset + len(blob), footer.encode())
        if tw.emit is not None:
            tw.emit("write", len(blob) + FOOTER_SIZE, time.perf_counter() - t0)
        if tw.writer.size != size:
            raise FormatError(f"shard size {tw.writer.size} != expected {size}")
        t0 = time.perf_counter()
        tw.writer.commit()
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        if tw.emit is not None:
            tw.emit("sync", size, seconds)
        self._source_done(tier, job, (job.shard, tw.records, tw.codecs), None)
        observe = getattr(tier.codec, "observe", None)
        if observe is not None:  # the auto policy learns the link's speed
            observe(tw.stored, tw.write_seconds)
        tw.writer = None
        ref = ShardRef(job.rank, job.shard, size, footer.index_checksum)
        t0 = time.perf_counter() if tw.emit else 0.0
        pending = self.commit(tier, job, ref, job.laid_out.data_bytes, tw.stored)
        if tw.emit is not None:  # a deferred (multi-rank) commit: only its first part
            tw.emit("commit", job.laid_out.data_bytes, time.perf_counter() - t0)
        if pending is not None:
            codecs = list(tw.codecs)
            stored = tw.stored
            pending.add_done_callback(lambda f: self._after_deferred(tier, job, stored, codecs, f))
            return
        self._after_commit(tier, job, tw.stored, tw.codecs, None)

    def _source_done(
        self,
        tier: TierRuntime,
        job: SaveJob,
        result: tuple[str, list[list[Any]], list[dict[str, Any]]] | None,
        error: BaseException | None,
    ) -> None:
        """Hand this tier's durable file (or its failure) to the tiers that copy from it."""
        for f in job.follows.values():
            if f.source is tier and not f.done.done():
                if error is not None:
                    f.done.set_exception(error)
                else:
                    assert result is not None
                    f.done.set_result(result)

    def _copy_from_source(
        self, tier: TierRuntime, job: SaveJob, tw: _TierWrite, follow: _Follow
    ) -> None:
        """Read the source tier's durable file chunk by chunk into this tier's writer."""
        src = follow.source
        try:
            file, records, codecs = follow.done.result()
        except BaseException as exc:
            raise TierCkptError(
                f"step {job.step}: tier {tier.name!r} copies from tier {src.name!r}, whose copy "
                f"failed: {exc}"
            ) from exc
        chunks = job.laid_out.chunks
        if len(records) != len(chunks):
            raise FormatError(
                f"step {job.step}: tier {src.name!r} wrote {len(records)} chunks, "
                f"the plan has {len(chunks)}"
            )
        stored_buf: torch.Tensor | None = None
        raw_buf: torch.Tensor | None = None
        source_codecs = [codec_from_config(c) for c in codecs]
        for i, fields in enumerate(records):
            rec = ChunkRecord(*fields)
            if stored_buf is None or stored_buf.numel() < rec.stored_size:
                stored_buf = torch.empty(max(rec.stored_size, 1), dtype=torch.uint8)
            stored = memoryview(stored_buf.numpy())[: rec.stored_size]  # type: ignore[arg-type]
            where = f"tier {src.name!r} {src.backend.url}/{file}, read back for tier {tier.name!r}"
            read_verified(src.backend, file, rec, i, stored, tier=src.name, where=where)
            codec = source_codecs[rec.codec]
            if codec.is_passthrough:
                raw = stored
            else:
                if raw_buf is None or raw_buf.numel() < rec.raw_size:
                    raw_buf = torch.empty(max(rec.raw_size, 1), dtype=torch.uint8)
                raw = memoryview(raw_buf.numpy())[: rec.raw_size]  # type: ignore[arg-type]
                codec.decode(stored, raw)
            enc = _encode(tier.codec, chunks[i].dtype, raw, None, tw.emit)
            self._append(tier, tw, chunks[i], enc)

    def _after_deferred(
        self,
        tier: TierRuntime,
        job: SaveJob,
        stored: int,
        codecs: list[dict[str, Any]],
        done: Future[None],
    ) -> None:
        try:
            self._after_commit(tier, job, stored, codecs, done.exception())
        except BaseException as exc:  # a callback's error would otherwise be lost
            if not job.handle.done(tier.name):
                self._finish(tier, job, None, exc)

    def _after_commit(
        self,
        tier: TierRuntime,
        job: SaveJob,
        stored: int,
        codecs: list[dict[str, Any]],
        error: BaseException | None,
    ) -> None:
        if error is not None:
            self._finish(tier, job, None, error)
            return
        seconds = time.perf_counter() - job.handle.started
        codec_desc = ",".join(sorted({c["id"] for c in codecs})) or "raw"
        result = TierResult(
            tier.name, job.step, job.laid_out.data_bytes, stored, seconds, codec_desc, job.timeline
        )
        log.info(
            "committed %s on %s: %d bytes in %.3f s (%.2f GB/s), codec %s ratio %.2f",
            job.id,
            tier.name,
            result.raw_bytes,
            seconds,
            result.gbps,
            codec_desc,
            result.ratio,
        )
        if self.retains(tier, job):  # the owner says which ranks apply retention where
            try:
                protect = {j.id for j in self.in_flight() if j is not job}
                gc_tier(tier.backend, tier.spec.keep_last, protect=protect)
            except (BackendError, OSError) as exc:
                log.warning(
                    "retention on tier %s failed (will retry next save): %s", tier.name, exc
                )
        self._finish(tier, job, result, None)

    def _finish(
        self,
        tier: TierRuntime,
        job: SaveJob,
        result: TierResult | None,
        error: BaseException | None,
    ) -> None:
        if error is not None:
            log.error("step %d failed on tier %s: %s", job.step, tier.name, error)
            if self.on_failure is not None:
                self.on_failure(tier, job, error)  # e.g. tell rank 0 not to wait for this rank
        if result is not None and self.on_result is not None:
            self.on_result(result, job.handle)
        job.handle._set_tier(tier.name, result, error)
        if job.handle.done():
            with self._lock:
                if job in self._in_flight:
                    self._in_flight.remove(job)
            if job.plan is not None:
                job.plan.sources.clear()
            job.collected = None


def _rank_zero_retains(tier: TierRuntime, job: SaveJob) -> bool:
    return job.rank == 0


def _encode(
    tier_codec: Codec, dtype: str, view: memoryview, event: Any, emit: _Emit | None = None
) -> Encoded:
    if event is not None:
        event.synchronize()
    profile = getattr(tier_codec, "profile", None)
    if profile is not None:  # the auto policy measures its candidate on real data, once
        profile(dtype, view)
    codec = tier_codec.for_dtype(dtype)
    data: BytesLike
    if codec.is_passthrough:
        data, config = view, codec.get_config()
    else:
        t0 = time.perf_counter() if emit else 0.0
        out = codec.encode(view)
        if emit is not None:
            emit("encode", len(view), time.perf_counter() - t0)
        if len(memoryview(out).cast("B")) >= len(view):
            # incompressible: store raw bytes, never more than raw
            data, config = view, {"id": "raw"}
        else:
            data, config = out, codec.get_config()
    t0 = time.perf_counter() if emit else 0.0
    digest = checksum(data)
    if emit is not None:
        emit("checksum", len(memoryview(data).cast("B")), time.perf_counter() - t0)
    return Encoded(data, digest, config)


_Owner = TypeVar("_Owner", bound="PipelineOwner")


class PipelineOwner:
    """Lifecycle shared by the objects that own a :class:`Pipeline` and its tiers
    (``Checkpointer``, ``dcp.TierWriter``): ``close()`` once, context manager, and a
    best-effort close when collected unclosed."""

    _pipeline: Pipeline | None
    _tiers: list[TierRuntime]
    _closed: bool
    chunk_bytes: int
    host_buffer_bytes: int
    io_threads: int

    def _pipeline_hooks(self) -> dict[str, Any]:
        """``commit`` (and optionally ``on_result``, ``on_failure``, ``retains``) for the
        Pipeline."""
        raise NotImplementedError

    def _get_pipeline(self) -> Pipeline:
        """The pipeline, started on first use."""
        if self._closed:
            raise TierCkptError(f"this {type(self).__name__} is closed")
        if self._pipeline is None:
            self._pipeline = Pipeline(
                self._tiers,
                chunk_bytes=self.chunk_bytes,
                host_buffer_bytes=self.host_buffer_bytes,
                io_threads=self.io_threads,
                **self._pipeline_hooks(),
            )
        return self._pipeline

    def _release(self) -> None:
        """Extra resources of the owner, released by ``close()`` after the pipeline."""

    def close(self) -> None:
        """Wait for in-flight saves to finish on every tier, then release threads and memory."""
        if self._closed:
            return
        self._closed = True
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None
        self._release()
        for t in self._tiers:
            t.backend.close()

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._pipeline is not None:
                self._pipeline.close()
        except Exception:
            pass
