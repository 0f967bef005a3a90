"""The tiers: one writer thread per tier writes its chunks in order (or, for a tier with a
``source``, copies the source's durable file), then the index and footer, makes the file
durable, commits (manifest last), reports the copy done and then applies retention
(``_retain``: deletions of older checkpoints trail the report, never delay it).

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import functools
import logging
import queue
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tierckpt._types import BytesLike
from tierckpt.codecs import SupportsObserve, codec_from_config
from tierckpt.errors import CheckpointExists, FormatError, TierCkptError
from tierckpt.format import (
    CHECKSUM_ALGO,
    FOOTER_SIZE,
    FORMAT_VERSION,
    ChunkRecord,
    Footer,
    ShardRef,
    align_up,
    checksum,
    encode_index,
    manifest_name,
)
from tierckpt.handle import TierResult
from tierckpt.pipeline._capture import _encode
from tierckpt.pipeline._lend import Countdown, Loan, abort_quietly, early_view
from tierckpt.pipeline._retain import _RetainMixin
from tierckpt.pipeline._stall import _StallMixin
from tierckpt.pipeline._values import Encoded, SaveJob, Tier, _ChunkState, _Follow, _TierWrite
from tierckpt.plan import ChunkPlan
from tierckpt.reported import forget_causes, reported
from tierckpt.retention import note_failed_save
from tierckpt.verify import read_verified

log = logging.getLogger("tierckpt")
_ZEROS = bytes(4096)


class _TiersMixin(_RetainMixin, _StallMixin):
    # -- capture ---------------------------------------------------------------------
    def _release(self, state: _ChunkState, tier: str) -> None:
        """``tier`` is done with this chunk; the last holder frees its slot (a given-up tier
        no longer holds it, so this is then a no-op)."""
        with self._lock:
            if tier not in state.holders:
                return
            state.holders.discard(tier)
            last = not state.holders
            if last:
                self._held_chunks.remove(state)
        if last:
            self._release_slots([state])

    def _tier_loop(self, tier: Tier) -> None:
        q = self._tier_q[tier.name]
        progress: dict[int, _TierWrite] = {}
        while True:
            try:
                item = q.get(timeout=self._leases.renewal_timeout(tier))
            except queue.Empty:
                self._tier_side_call(tier, q, self._leases.renew, tier)
                continue
            if item is None:
                return
            kind, job, payload = item
            if kind == "lease":  # (rank, step, future)
                self._tier_side_call(tier, q, self._leases.take, tier, *payload)
                continue
            assert job is not None
            if kind == "retain":  # an owner's commit asked for it (Pipeline.retain_later)
                self._tier_side_call(tier, q, self._run_counted_pass, tier, job)
                continue
            self._tier_busy(tier, progressed=False, idle=False)
            tw = progress.setdefault(id(job), _TierWrite())
            ok = False
            try:
                if kind == "start":
                    self._tier_start(tier, job, tw)
                elif kind == "chunk":
                    loan = Loan(functools.partial(self._release, payload, tier.name))
                    try:
                        if tw.error is None and self._abandoned:
                            tw.error = self._abandoned_error(job)
                        if tw.error is None:
                            self._tier_chunk(tier, job, tw, payload, loan)
                    finally:
                        if not loan.handed:  # else the writer releases it (write_lent)
                            loan.release()
                elif kind == "end":
                    del progress[id(job)]
                    self._tier_end(tier, job, tw)
                ok = tw.error is None
            except BaseException as exc:
                tw.error = exc
                if tw.writer is not None:
                    abort_quietly(tier, tw.writer)
                    tw.writer = None
                if kind == "end":
                    self._tier_failed(tier, job, exc)
            finally:
                self._tier_busy(tier, progressed=ok, idle=q.empty())

    def _tier_side_call(
        self, tier: Tier, q: queue.Queue[Any], fn: Callable[..., bool | None], *args: Any
    ) -> None:
        """A lease's take or renewal or a deferred retention pass, timed like a copy's work:
        a call blocked in a store that does not answer counts as no progress (``close()``
        does not wait for it past ``save_deadline``); ``fn`` returning False: it failed."""
        self._tier_busy(tier, progressed=False, idle=False)
        ok = False
        try:
            ok = fn(*args) is not False
        finally:
            self._tier_busy(tier, progressed=ok, idle=q.empty())

    def _tier_failed(self, tier: Tier, job: SaveJob, error: BaseException) -> None:
        with self._lock:
            given_up = job.given_up.get(tier.name)
            if given_up is None:
                job.settled.add(tier.name)  # failed on its own: reported once, as that
        self._source_done(tier, job, None, given_up or error)
        if given_up is not None:
            return  # reported when it was given up
        # a failed save (disk full) runs retention too, so the disk frees itself; a remote
        # tier that just failed would likely fail again: its next commit does it
        retain = self.retains(tier, job) and not tier.backend.is_remote
        self._finish_then_retain(tier, job, None, error, retain=retain)

    def _tier_start(self, tier: Tier, job: SaveJob, tw: _TierWrite) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
            if err is None and tier.name in job.follows:
                self._follow_active[tier.name] = job
        if err is not None:
            raise err
        refused = job.refused.get(tier.name)
        if refused is not None:  # committed there by an earlier save: nothing is written
            raise refused
        lease_error = job.lease_errors.get(tier.name)
        if lease_error is not None:
            raise lease_error
        self._leases.get(tier, job.rank).acquire()  # a no-op while held; raises once lost
        if tier.backend.exists(manifest_name(job.step, timeline=job.timeline)):
            raise CheckpointExists(
                f"{job.id} is already committed on tier {tier.name!r} "
                f"({tier.backend.url}); refusing to overwrite it — save under another step or "
                "delete the old one first (tierckpt gc)"
            )
        tw.writer = tier.backend.open_writer(job.shard_on(tier))
        if job.plan is not None:  # lets an object store size its parts from the shard
            tw.writer.size_hint(job.plan.data_bytes, self.host_buffer_bytes)
        tw.emit = self._emitter(job.step, tier.name)

    def _tier_chunk(
        self, tier: Tier, job: SaveJob, tw: _TierWrite, state: _ChunkState, loan: Loan
    ) -> None:
        with self._lock:
            err = job.given_up.get(tier.name)
            enc = state.encoded.get(tier.codec) if tier.name in state.holders else None
        if err is not None:
            raise err
        assert enc is not None, "a tier writes only chunks it holds"
        early = early_view(tier, job, tw.writer, self.arena, state)
        if early is not None:
            self._append_early(tier, tw, state.plan, early, enc, loan)
        else:
            self._append(tier, tw, state.plan, enc.result(), loan)
        # given up during the write: the slot may hold other bytes by now; stop here
        self._check_given_up(tier, job)

    def _append_early(
        self,
        tier: Tier,
        tw: _TierWrite,
        chunk: ChunkPlan,
        view: memoryview,
        enc: Future[Encoded],
        loan: Loan,
    ) -> None:
        """:meth:`_append` of a raw chunk handed to the writer while its checksum is still being
        computed (host chunks' checksums wait for the end of the capture: the first parts go on
        the wire that much sooner). The slot is freed once the writer and the checksum are
        both done with it."""
        assert tw.writer is not None
        release = Countdown(2, loan.release)
        try:
            # sets loan.handed when the writer has taken ``release`` (it then calls it once)
            self._append(tier, tw, chunk, None, loan, lent=(view, release))
        finally:
            try:
                done = enc.result()  # the encoder reads the slot until then
            finally:
                if loan.handed:
                    release()  # else the tier's thread releases the slot (not handed)
        if len(memoryview(done.data).cast("B")) != len(view):
            raise FormatError(  # cannot happen for a passthrough codec; never record a lie
                f"tier {tier.name!r}: chunk {chunk.seq} was uploaded raw ({len(view)} bytes) "
                f"but encoded as {done.codec_config}"
            )
        self._record(tw, chunk, done, tw.offset - len(view), len(view))

    def _append(
        self,
        tier: Tier,
        tw: _TierWrite,
        chunk: ChunkPlan,
        enc: Encoded | None,
        loan: Loan | None = None,
        *,
        lent: tuple[memoryview, Callable[[], None]] | None = None,
    ) -> None:
        """Write one encoded chunk at the next aligned offset and record it. ``loan``: the
        chunk's arena slot, lent to a writer that can upload from it (``write_lent``: no copy),
        which then releases the slot once its parts are acknowledged. ``lent``: raw bytes and
        their release, written lent but not recorded (``enc`` None: the caller records them)."""
        assert tw.writer is not None
        self._leases.renew(tier)  # a long save (or copy from a source) must not let it lapse
        start = align_up(tw.offset)
        if start > tw.offset and not tier.backend.supports_random_write:
            tw.writer.write(tw.offset, _ZEROS[: start - tw.offset])
        t0 = time.perf_counter()
        write_lent = getattr(tw.writer, "write_lent", None) if loan is not None else None
        if lent is not None:
            assert loan is not None
            data: BytesLike = lent[0]
            loan.handed = True  # from here the writer calls lent[1], also on failure
            tw.writer.write_lent(start, data, lent[1])  # type: ignore[attr-defined]
        elif write_lent is not None:
            assert loan is not None and enc is not None
            data = enc.data
            loan.handed = True  # from here the writer calls loan.release, also on failure
            write_lent(start, data, loan.release)
        else:
            assert enc is not None
            data = enc.data
            tw.writer.write(start, data)
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        self._tier_busy(tier, progressed=True, idle=False)
        n = len(memoryview(data).cast("B"))
        if tw.emit is not None:
            tw.emit("write", n, seconds)
        tw.offset = start + n
        tw.stored += n
        if enc is not None:
            self._record(tw, chunk, enc, start, n)

    def _record(self, tw: _TierWrite, chunk: ChunkPlan, enc: Encoded, start: int, n: int) -> None:
        """The index record of a chunk of ``n`` stored bytes written at ``start``."""
        try:
            codec_idx = tw.codecs.index(enc.codec_config)
        except ValueError:
            tw.codecs.append(enc.codec_config)
            codec_idx = len(tw.codecs) - 1
        rec = ChunkRecord(chunk.logical_offset, chunk.raw_size, n, start, codec_idx, enc.checksum)
        tw.records.append(rec.to_json())

    def _tier_end(self, tier: Tier, job: SaveJob, tw: _TierWrite) -> None:
        if job.capture_error is not None:
            raise job.capture_error
        if tw.error is not None:
            raise tw.error
        follow = job.follows.get(tier.name)
        if follow is not None:
            self._copy_from_source(tier, job, tw, follow)
        self._enter_commit(tier, job)
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
        self._check_abandoned(job)
        if job.confirm is not None and tier.name in job.confirm_on:
            job.confirm(tier, job)  # its timeline was chosen without this tier's listing
        # publishing replaces whatever has this name: only while the location is still ours
        self._leases.get(tier, job.rank).verify()
        t0 = time.perf_counter()
        tw.writer.commit()
        seconds = time.perf_counter() - t0
        tw.write_seconds += seconds
        if tw.emit is not None:
            tw.emit("sync", size, seconds)
        self._source_done(tier, job, (job.shard_on(tier), tw.records, tw.codecs), None)
        if isinstance(tier.codec, SupportsObserve):  # the auto policy learns the link's speed
            tier.codec.observe(tw.stored, tw.write_seconds)
        tw.writer = None
        ref = ShardRef(job.rank, job.shard_on(tier), size, footer.index_checksum)
        key = (job.step, tier.name)
        with self._lock:  # the exit handler abandons under the same lock: commit or abandon
            if self._abandoned:
                raise self._abandoned_error(job)
            self._committing.add(key)
        t0 = time.perf_counter() if tw.emit else 0.0
        try:
            pending = self.commit(tier, job, ref, job.laid_out.data_bytes, tw.stored)
        finally:
            with self._lock:
                self._committing.discard(key)
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
        tier: Tier,
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

    def _copy_from_source(self, tier: Tier, job: SaveJob, tw: _TierWrite, follow: _Follow) -> None:
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
            self._check_abandoned(job)
            self._check_given_up(tier, job)
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
        tier: Tier,
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
        tier: Tier,
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
            tier.name,
            job.step,
            job.laid_out.data_bytes,
            stored,
            seconds,
            codec_desc,
            job.timeline,
            blocked_seconds=job.handle.blocked_seconds,
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
        # the owner says which ranks apply retention where; only while holding the lease.
        # Reported durable first: deleting older checkpoints is not part of this save's time
        self._finish_then_retain(tier, job, result, None, retain=self.retains(tier, job))

    def _finish(
        self,
        tier: Tier,
        job: SaveJob,
        result: TierResult | None,
        error: BaseException | None,
        *,
        outcome: str = "failed",
        defer_hooks: bool = False,
    ) -> None:
        """Report ``tier``'s copy of ``job`` done: committed (``result``) or not (``error``,
        counted as ``outcome``). ``defer_hooks``: the caller must not block (capture)."""
        if error is not None:
            note_failed_save(tier.backend)  # its abort may have left files: sweep next time
            if outcome == "skipped":
                log.warning("%s", error)
            else:
                log.error("step %d failed on tier %s: %s", job.step, tier.name, error)
                reported(tier.backend, error)  # its warnings say nothing new after this
            hook = self.on_failure
            if hook is not None:
                # e.g. tell rank 0 not to wait for this rank (I/O on a tier that may hang)
                err: BaseException = error
                if defer_hooks:
                    self.defer(lambda: hook(tier, job, err))
                else:
                    hook(tier, job, err)
        elif result is not None:
            forget_causes(tier.backend)  # a cause met before is news again when it comes back
        with self._lock:
            self._counts[tier.name]["committed" if error is None else outcome] += 1
            self._unfollow_locked(tier.name, job)
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
            job.confirm = None  # its owner's method: a job kept by a thread's last item must
            # not keep an owner dropped unclosed alive (see pipeline.weakly)
