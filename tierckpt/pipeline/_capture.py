"""Capture: lay a save's state out in chunks, copy each into a slot of the host arena (waiting
for a free slot: backpressure), encode it once per distinct codec on a small pool, and hand it
to every tier fed from the arena, in tier order.

Part of :class:`~tierckpt.pipeline.Pipeline`; the state it changes is declared in ``_base``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from tierckpt import _native, devices
from tierckpt._types import BytesLike
from tierckpt.arena import HostArena
from tierckpt.capture import SPLIT_MIN_BYTES, ChunkHash, compress_chunk, copy_chunk
from tierckpt.codecs import Codec, SupportsProfile
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.codecs.nvcomp import NvcompCodec
from tierckpt.format import align_up, checksum
from tierckpt.pipeline._copyteam import CopyTeam, copy_threads
from tierckpt.pipeline._stall import _StallMixin
from tierckpt.pipeline._values import Encoded, SaveJob, _ChunkState, _Emit, _Follow
from tierckpt.plan import ShardLayout, layout_plan

log = logging.getLogger("tierckpt")


#: seconds a tier holding arena slots makes no progress before capture grows the arena
#: (within its budget) rather than wait for them
GROW_AFTER_S = 2.0


class _CaptureMixin(_StallMixin):
    #: the helpers that copy host chunks with the capture thread, made on first use and
    #: reused by every save; closed when the capture loop ends (the writer's close)
    _copy_team: CopyTeam | None = None
    #: whether capture grew the arena past a stalled tier (said once)
    _grew = False

    def _ensure_arena(self, plan: ShardLayout) -> HostArena:
        """The arena, grown (once, between saves) if this plan needs bigger or more slots."""
        biggest = max((c.raw_size for c in plan.chunks), default=0)
        slot = align_up(max(biggest, 4096))
        if self.arena is None and self._prebuilt is not None:
            # built at the writer's construction, off the save's critical path
            self.arena, self._prebuilt = self._prebuilt.take(), None
        a = self.arena
        if a is not None:
            slot = max(slot, a.slot_bytes)
        cap = max(2, self.host_buffer_bytes // slot)
        want = min(max(2, len(plan.chunks), a.live_slots if a else 0), cap)
        if a is not None and a.slot_bytes >= slot and a.live_slots >= want:
            return a
        if a is not None:
            # a bigger state than any before: grow once, between saves
            while not a.wait_idle(self._stall_timeout()):
                self._give_up_stalled()
            a.close()
        self.arena = HostArena(want, slot)
        log.debug(
            "host arena: %d slots x %d bytes (%.2f s to allocate)",
            want,
            slot,
            self.arena.alloc_seconds,
        )
        return self.arena

    def _acquire(self, a: HostArena) -> int:
        """A free arena slot; a tier that holds slots without progress past the deadline is
        given up meanwhile, so this waits at most about ``save_deadline`` per stalled tier.

        Where a tier holding slots has made no progress for :data:`GROW_AFTER_S` (a store
        that stopped answering, not one that is slow) and the arena is below its budget
        (``host_buffer_bytes``: an arena sized to a small state has two slots), the arena
        grows by a slot instead of waiting: the other tiers (the local disk) go on committing
        at their pace while the stalled one holds what it holds, up to the budget; past it,
        the deadline as before."""
        while True:
            # grown past what stalled tiers hold at most (a slow healthy tier gets no more
            # slots: it grew to the budget and stayed there, the disk ~100 saves behind), and
            # shrunk back once nothing is stalled
            held = self._slots_held_stalled(GROW_AFTER_S)
            if not held and a.extra_slots and a.retire_free_extra():
                log.debug("host arena: back to %d slots", a.live_slots)
            budget = a.nbytes + a.slot_bytes <= self.host_buffer_bytes
            if budget and a.extra_slots < held:
                self._give_up_stalled()  # past the deadline its copies go, as when this waited
                try:
                    return a.acquire(timeout=0)
                except TimeoutError:
                    slot = a.grow()
                    if not self._grew:  # once per writer: the memory an operator sees rise
                        self._grew = True
                        log.warning(
                            "a tier fed from the host arena made no progress for %.0f s: the "
                            "arena grows past the slots it holds (%d slots, %.0f MiB, at most "
                            "host_buffer_bytes=%.0f MiB) so the other tiers go on committing",
                            GROW_AFTER_S,
                            a.live_slots,
                            a.nbytes / 2**20,
                            self.host_buffer_bytes / 2**20,
                        )
                    return slot
            timeout = self._stall_timeout()
            if budget:
                timeout = GROW_AFTER_S if timeout is None else min(timeout, GROW_AFTER_S)
            try:
                return a.acquire(timeout=timeout)
            except TimeoutError:
                self._give_up_stalled()

    def _capture_loop(self) -> None:
        while True:
            job = self._capture_q.get()
            if job is None:
                if self._copy_team is not None:
                    self._copy_team.close()
                for q in self._tier_q.values():
                    q.put(None)
                return
            try:
                self._capture(job)
            except BaseException as exc:
                # at exit, say so (not e.g. that the encode pool, shut down, refused a chunk)
                error = self._abandoned_error(job) if self._abandoned else exc
                job.capture_error = error
                log.error("step %d: capture failed: %s", job.step, error)
                job.handle._set_captured(error)
            for t in job.tiers:
                self._tier_q[t.name].put(("end", job, None))

    def _capture(self, job: SaveJob) -> None:
        emit = self._emitter(job.step, None)
        _native.prepare()  # (a writer made without one started) used once it is built
        self._check_abandoned(job)
        # this thread works on the state's device (a fresh thread's is GPU 0 on every rank)
        cuda = devices.cuda_devices(job.ready_events)
        device = cuda[0] if cuda else None
        devices.use_device(device)
        if job.plan is None:
            assert job.collected is not None
            t0 = time.perf_counter() if emit else 0.0
            # resolve_conj / resolve_neg run on the capture stream, after the save point
            with self._streams.ordered_after(job.ready_events):
                job.plan = self._layouts.layout(
                    job.collected, job.chunk_bytes or self.chunk_bytes, layout_plan
                )
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
        self._register_follows(job)
        a = self._ensure_arena(plan)
        self._grace(job)
        for t in job.tiers:
            self._tier_q[t.name].put(("start", job, None))
        events = []
        # host chunks are copied by this thread and helpers at once (one thread alone reaches
        # a fraction of the memory bandwidth), also while training computes: see _copyteam
        team = self._host_copy_team() if not cuda and _has_big_chunk(plan) else None
        # checksums (and so writes) of host chunks wait while this save is copied, so that
        # the copy, which training waits for, has the cores and memory bandwidth to itself;
        # they start when the capture ends, or earlier when the arena runs low on free
        # slots and the rest of the save does not fit (the copy would otherwise wait for
        # them: backpressure), or once the save's commit is awaited and not its capture (a
        # blocking save: copy, checksum and write then overlap, and it commits sooner)
        gate = threading.Event()
        if cuda:
            gate.set()  # device copies leave the host's cores free
        low_water = max(1, a.live_slots // 4)
        # a guarded save: its tensors changed since save() before their copy (StateChanged)
        watched, job.watched = job.watched, None
        h = job.handle
        changed = None
        with _opens_at_exit(gate):
            for chunk in plan.chunks:
                with self._lock:
                    if all(t.name in job.given_up for t in direct):
                        break  # every tier fed from the arena gave this save up: nothing to copy
                t0 = time.perf_counter() if emit else 0.0
                self._check_abandoned(job)
                if not gate.is_set():
                    free = a.free_slots
                    if free <= low_water and free < len(plan.chunks) - chunk.seq:
                        gate.set()  # the rest of the save does not fit: slots must come back
                    elif h.commit_awaited.is_set() and not h.capture_awaited.is_set():
                        gate.set()  # a blocking save(...).wait(): its commit is awaited
                slot = self._acquire(a)
                with self._lock:
                    codecs = {t.codec for t in direct if t.name not in job.given_up}
                if not codecs:  # the last of them was given up while this waited for a slot
                    a.release(slot)  # (and the finished save let go of the state's tensors)
                    break
                # every tier fed from the arena takes one nvCOMP codec: compress on the device,
                # and only the compressed bytes cross PCIe
                dev_codec = _device_codec(codecs, chunk.dtype, device)
                on_device: tuple[int, Any] | None = None
                hasher: ChunkHash | None = None
                try:
                    t1 = time.perf_counter() if emit else 0.0
                    slot_t = a.slot(slot)
                    if dev_codec is not None:
                        on_device = compress_chunk(
                            plan, chunk, slot_t, self._streams, job.ready_events, dev_codec
                        )
                    if on_device is not None:
                        event = on_device[1]
                    else:
                        hasher = _fused_hash(job, codecs, chunk.dtype, bool(cuda))
                        event = copy_chunk(
                            plan, chunk, slot_t, self._streams, job.ready_events, team, hasher
                        )
                except BaseException:
                    a.release(slot)
                    raise
                if emit is not None:
                    emit("arena_wait", chunk.raw_size, t1 - t0)
                    emit("capture", chunk.raw_size, time.perf_counter() - t1)
                if watched is not None:
                    changed = watched.changed(plan, chunk, job.step)
                    if changed is not None:  # nothing more of it is copied or written
                        if event is not None:
                            event.synchronize()
                        a.release(slot)
                        break
                if event is not None:
                    events.append(event)
                view = memoryview(slot_t[: chunk.raw_size].numpy())  # type: ignore[arg-type]
                with self._lock:  # a tier given up meanwhile gets no more chunks of this save
                    takers = [t for t in direct if t.name not in job.given_up]
                    state = _ChunkState(chunk, slot, job, {t.name for t in takers})
                    for codec in {t.codec for t in takers}:
                        if on_device is not None and dev_codec is not None:
                            stored = view[: on_device[0]]
                            config = dev_codec.get_config()
                            state.encoded[codec] = self._pool.submit(
                                _stored, stored, event, config, emit, device
                            )
                            continue
                        digest = hasher.digest if hasher is not None else None
                        state.encoded[codec] = self._pool.submit(
                            _encode, codec, chunk.dtype, view, event, emit, device, gate, digest
                        )
                    if takers:
                        self._held_chunks.append(state)
                    now = time.monotonic()
                    for t in takers:  # a tier's clock runs from when it has work it has not done
                        self._stalled_since.setdefault(t.name, now)
                if not takers:
                    a.release(slot)
                    break
                for t in takers:
                    self._tier_q[t.name].put(("chunk", job, state))
        if len(cuda) == 1 and changed is None:
            # the optimizer's step hook may now make the training stream wait for these
            # events on the GPU instead of waiting on the host
            job.queued_events = (cuda[0], list(events))
        for ev in events:
            ev.synchronize()  # blocking events: this thread sleeps until the copy is done
        if changed is not None:
            raise changed  # after the copies: no slot is handed back while one writes it
        if watched is not None and not cuda:
            # an in-place change still running while its chunk was copied moved its counter
            # only when it ended (a torn or unreadable chunk, checked clean): every tensor is
            # looked at again once the training thread waits for this save (its own
            # operations have ended then: wait_captured, the step hook, wait) or SETTLE_S
            # passed. (CUDA: the step hook lets the
            # optimizer queue its step once the copies are queued: not looked at again)
            settled = time.monotonic() + SETTLE_S
            while not (h.capture_awaited.is_set() or h.commit_awaited.is_set()):
                if time.monotonic() >= settled:
                    break
                h.capture_awaited.wait(0.005)
            changed = watched.changed_any(job.step)
            if changed is not None:
                raise changed
        # the copies are done: the save holds no device storage from here (not until the
        # slowest tier commits); the arena slots hold the bytes
        plan.sources.clear()
        job.handle._set_captured()

    def _host_copy_team(self) -> CopyTeam | None:
        """The pipeline's copy team (made on first use), or None on a single core."""
        if self._copy_team is None:
            threads = copy_threads()
            if threads <= 1:
                return None
            self._copy_team = CopyTeam(threads)
        return self._copy_team

    # -- tiers -----------------------------------------------------------------------


#: how long a guarded CPU capture nobody waits for waits before its last look at the state's
#: version counters: an in-place operation running while a chunk was copied ends by then
SETTLE_S = 0.1


def _encode(
    tier_codec: Codec,
    dtype: str,
    view: memoryview,
    event: Any,
    emit: _Emit | None = None,
    device: torch.device | None = None,
    gate: threading.Event | None = None,
    digest: str | None = None,
) -> Encoded:
    """The chunk at ``view`` as ``tier_codec`` stores it, with its checksum; ``digest``: the
    raw bytes' checksum, already taken as they were copied (:class:`ChunkHash`), used when
    the codec stores them raw."""
    if gate is not None:
        gate.wait()  # set when the capture ends (always: also when it fails)
    devices.use_device(device)  # an encoder thread works on the chunk's device
    if event is not None:
        event.synchronize()  # a blocking event: sleeps, no spin
    if isinstance(tier_codec, SupportsProfile):  # the auto policy measures its candidate, once
        tier_codec.profile(dtype, view)
    codec = tier_codec.for_dtype(dtype)
    data: BytesLike
    if codec.is_passthrough:
        data, config = view, codec.get_config()
        if digest is not None:
            return Encoded(data, digest, config)
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


@contextlib.contextmanager
def _opens_at_exit(gate: threading.Event) -> Iterator[None]:
    try:
        yield
    finally:
        gate.set()


def _fused_hash(job: SaveJob, codecs: set[Codec], dtype: str, cuda: bool) -> ChunkHash | None:
    """A hasher for a host chunk copied while nobody waits for the capture (a lazy capture:
    training computes meanwhile), when every codec stores its bytes raw: hashing each block
    right after it is copied saves reading the chunk back from memory for its checksum.
    None when someone waits (a blocking save): the copy alone is on the path training waits
    for, and checksums come after it, as before."""
    if cuda or job.handle.capture_awaited.is_set():
        return None
    for codec in codecs:
        if isinstance(codec, SupportsProfile) or not codec.for_dtype(dtype).is_passthrough:
            return None
    return ChunkHash(job.handle.capture_awaited)


def _has_big_chunk(plan: ShardLayout) -> bool:
    """Whether a chunk is big enough to be split among copy threads."""
    return any(c.raw_size >= SPLIT_MIN_BYTES for c in plan.chunks)


def _device_codec(
    codecs: set[Codec], dtype: str, device: torch.device | None = None
) -> NvcompCodec | None:
    """The nvCOMP codec (for ``dtype``) when it is the only codec the chunk is encoded with;
    a remote tier's ``codec="auto"`` counts as nvCOMP where it compresses on ``device``
    (:meth:`~tierckpt.codecs.adaptive.AdaptiveCodec.on_device`)."""
    codecs = {(c.on_device(device) or c) if isinstance(c, AdaptiveCodec) else c for c in codecs}
    if len(codecs) != 1:
        return None
    (codec,) = codecs
    if not isinstance(codec, NvcompCodec):
        return None
    per_dtype = codec.for_dtype(dtype)
    return per_dtype if isinstance(per_dtype, NvcompCodec) else None


def _stored(
    data: memoryview,
    event: Any,
    config: dict[str, Any],
    emit: _Emit | None = None,
    device: torch.device | None = None,
) -> Encoded:
    """A chunk compressed on the device: wait for its copy, then checksum the stored bytes."""
    devices.use_device(device)
    if event is not None:
        event.synchronize()
    t0 = time.perf_counter() if emit else 0.0
    digest = checksum(data)
    if emit is not None:
        emit("checksum", len(data), time.perf_counter() - t0)
    return Encoded(data, digest, config)
