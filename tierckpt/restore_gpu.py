"""Restore onto the GPU: chunks fetched and decoded into pinned host staging, then copied to the
device chunk by chunk while the next chunks are fetched and decoded.

``load(map_location="cuda")`` and ``load(into=...)`` with tensors on one CUDA device read a
shard here instead of into host tensors (:func:`tierckpt.restore.read_shard`):

* each storage the checkpoint holds is allocated once on the device, so tensors that shared
  storage when saved (a weight and its transposed view, tied embeddings) share it again;
* each read thread makes the target device its current device, takes a slot of a pinned
  staging ring (the host arena's free slots when the arena is built and large enough, else
  a small ring pinned for this load), reads and verifies the chunk into it (decoding it
  there with the CPU codec when the chunk is compressed), and queues non-blocking
  host-to-device copies on its own stream of the target device (never the default stream:
  usually the training stream). A slot is reused only once the copies out of it completed
  (a blocking event, synchronized by the next taker): double buffering, so the copy engine
  moves one chunk while the threads fetch and decode the next;
* an nvCOMP chunk crosses the bus compressed and is decoded on the device straight into its
  storage (``NvcompCodec.decode_device``), with no round trip through the host; without the
  nvCOMP package it is decoded on the CPU into the staging slot;
* a chunk of many small tensors crosses in one copy into a device buffer and is scattered on
  the device with one ``_foreach_copy_``, not one small copy per tensor.

The load returns once every copy completed. Everything is verified before a byte reaches the
caller's tensors: ``into=`` targets are filled from the fresh device copy afterwards (device to
device), so with ``into=`` the device must hold the state twice for a moment; where it cannot
(its free memory), the load takes the host path as before.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt import devices
from tierckpt.arena import HostArena
from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.codecs.nvcomp import NvcompCodec
from tierckpt.errors import CorruptChunk, FormatError
from tierckpt.format import ChunkRecord, Manifest, tree_args
from tierckpt.restore import (
    LoadedShard,
    _Repopulation,
    _SpanLayout,
    as_parameters,
    finish_shard,
    parse_tensor_entry,
    read_index,
    read_shard,
)
from tierckpt.tree import decode_tree
from tierckpt.verify import read_verified

__all__ = [
    "DeviceTarget",
    "StagingRing",
    "read_shard_to_device",
    "stateful_device",
    "target_for",
]

log = logging.getLogger("tierckpt")

#: pinned bytes a load stages through when it cannot borrow the host arena's slots
STAGING_BYTES = 512 << 20
#: a chunk whose bytes land in more storages than this crosses in one copy and is scattered
#: on the device (one kernel) instead of one small copy per storage
SCATTER_MIN_PARTS = 8
#: device memory left free when ``into=`` stages the state on the device before copying
HEADROOM_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class DeviceTarget:
    """Where a load puts the state: ``device`` (a CUDA device, with an index). ``optional``:
    chosen from where the targets live (``into=``), not asked for, so a device without room
    for the state beside them gets the host path instead."""

    device: torch.device
    optional: bool = False


def is_gpu(device: torch.device) -> bool:
    """Whether ``device`` takes the GPU restore path (tests widen this)."""
    return device.type == "cuda"


def tensor_devices(tree: Any) -> set[torch.device]:
    """The devices of the tensors in ``tree`` (dicts, lists, tuples)."""
    out: set[torch.device] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.add(x.device)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(tree)
    return out


def _one_gpu(devs: set[torch.device]) -> torch.device | None:
    if len(devs) != 1:
        return None  # host tensors, or several devices: the host path, as before
    (dev,) = devs
    return devices.indexed(dev) if is_gpu(dev) else None


def target_for(into: Any, map_location: str | torch.device | None) -> DeviceTarget | None:
    """The GPU a load restores onto: ``map_location`` when it is a CUDA device; else, with
    ``into=``, the one CUDA device all its tensors are on (optional); None: the host path."""
    if map_location is not None:
        asked = torch.device(map_location)
        return DeviceTarget(devices.indexed(asked)) if is_gpu(asked) else None
    if into is None:
        return None
    dev = _one_gpu(tensor_devices(into))
    return DeviceTarget(dev, optional=True) if dev is not None else None


def stateful_device(into: Any) -> torch.device | None:
    """For ``load(into={"model": model, "optim": opt, ...})`` or ``load(into=model)``: the one
    CUDA device every tensor of the targets (the ``Stateful`` ones through ``state_dict()``)
    is on, else None. The checkpoint is then restored there and handed to
    ``load_state_dict()`` on the device."""
    values = [into] if _is_stateful(into) else list(into.values())
    parts = [v.state_dict() if _is_stateful(v) else v for v in values]
    return _one_gpu(tensor_devices(parts))


def _is_stateful(x: object) -> bool:
    return not isinstance(x, (torch.Tensor, dict, list, tuple, str, bytes)) and callable(
        getattr(x, "state_dict", None)
    )


class StagingRing:
    """Pinned host slots a load stages chunks in. ``take()`` hands out a free slot once the
    copies queued out of it last time completed (their event is synchronized: the thread
    sleeps, no spin); ``give(i, event)`` returns it with the event of those copies."""

    def __init__(
        self, slots: list[torch.Tensor], release: Callable[[], None] | None = None
    ) -> None:
        self.slots = slots
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(len(slots)):
            self._free.put(i)
        self._pending: list[Any] = [None] * len(slots)
        self._release = release
        self._closed = False

    @classmethod
    def open(cls, slot_bytes: int, n_slots: int, arena: HostArena | None = None) -> StagingRing:
        """``n_slots`` slots of at least ``slot_bytes``: the arena's free slots when it is
        pinned, its slots are big enough and at least two are free (taken without waiting:
        a save in flight keeps the ones it holds), else slots pinned for this load."""
        if arena is not None and arena.pinned and arena.slot_bytes >= slot_bytes:
            taken: list[int] = []
            try:
                while len(taken) < n_slots:
                    taken.append(arena.acquire(timeout=0))
            except (TimeoutError, RuntimeError):
                pass  # no more free (or closed): what we have
            if len(taken) >= 2:

                def release() -> None:
                    for i in taken:
                        arena.release(i)

                return cls([arena.slot(i) for i in taken], release)
            for i in taken:
                arena.release(i)
        n = max(2, min(n_slots, STAGING_BYTES // max(slot_bytes, 1)))
        return cls([devices.pinned_empty(slot_bytes) for _ in range(n)])

    def take(self) -> int:
        i = self._free.get()
        ev, self._pending[i] = self._pending[i], None
        if ev is not None:
            ev.synchronize()  # the copies out of this slot are done: it may be overwritten
        return i

    def give(self, i: int, event: Any) -> None:
        self._pending[i] = event
        self._free.put(i)

    def close(self) -> None:
        """Wait for every copy still queued out of the slots; then hand borrowed arena slots
        back. Called once every reader thread is done with the ring."""
        if self._closed:
            return
        self._closed = True
        for i, ev in enumerate(self._pending):
            if ev is not None:
                ev.synchronize()
                self._pending[i] = None
        if self._release is not None:
            self._release()


class _PerThread:
    """Buffers of one load, one per thread and kind, grown on demand and reused from chunk
    to chunk (device buffers are allocated with the thread's stream current, so only that
    stream's later work can reuse their memory)."""

    def __init__(self, make: Callable[[int], torch.Tensor]) -> None:
        self._make = make
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}

    def get(self, kind: str, n: int) -> torch.Tensor:
        key = (threading.get_ident(), kind)
        buf = self._bufs.get(key)  # keys are per thread: no other thread writes this entry
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = self._make(n)
        return buf[:n]


def _mv(t: torch.Tensor) -> memoryview:
    """A host uint8 tensor as a writable memoryview."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _room(device: torch.device, nbytes: int) -> bool:
    try:
        free = devices.free_bytes(device)
    except RuntimeError:
        return False
    return nbytes + HEADROOM_BYTES <= free


def read_shard_to_device(
    backend: Backend,
    tier: str,
    manifest: Manifest,
    rank: int,
    pool: ThreadPoolExecutor,
    target: DeviceTarget,
    *,
    arena: HostArena | None = None,
    repopulate: Sequence[Backend] = (),
    publish: bool = True,
) -> LoadedShard:
    """Read, verify and decode one rank's shard from one tier onto ``target.device`` (see
    the module docstring); ``repopulate`` and ``publish`` as in
    :func:`tierckpt.restore.read_shard`. An optional target without room for the state
    reads on the host instead."""
    t0 = time.perf_counter()
    device = target.device
    ref = manifest.shard_for(rank)
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    index, index_blob, footer_blob = read_index(backend, ref, tier)
    chunks: list[ChunkRecord] = index["chunks"]
    slot_bytes = max((c.raw_size for c in chunks), default=1)
    workers = int(getattr(pool, "_max_workers", 4))
    data_bytes = int(index["data_bytes"])
    if target.optional and not _room(device, data_bytes + 2 * workers * slot_bytes):
        log.info(
            "%s: not enough free memory on %s for the state (%d bytes) beside the targets; "
            "restoring through host memory",
            where,
            device,
            data_bytes,
        )
        return read_shard(
            backend, tier, manifest, rank, pool, repopulate=repopulate, publish=publish
        )
    codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
    for ci, rec in enumerate(chunks):
        if codecs[rec.codec].is_passthrough and rec.stored_size != rec.raw_size:
            raise FormatError(
                f"{where}: raw chunk {ci} stores {rec.stored_size} bytes "
                f"but declares {rec.raw_size}"
            )
    on_gpu = {i: isinstance(c, NvcompCodec) and c._have_nvcomp() for i, c in enumerate(codecs)}
    sizes = [int(n) for _off, n in index["storages"]]
    offsets = [int(s[0]) for s in index["storages"]]
    layout = _SpanLayout(offsets, sizes)
    # one allocation per storage: views of one storage stay views of one on the device (made
    # on the caller's thread, whose current device is left as it is: they name their device)
    spans = [devices.device_empty(n, device) for n in sizes]
    host = _PerThread(lambda n: torch.empty(n, dtype=torch.uint8))
    on_device = _PerThread(lambda n: devices.device_empty(n, device))
    repop = _Repopulation(repopulate, ref.file)
    ring = StagingRing.open(slot_bytes, workers + 1, arena)

    def one(ci: int) -> int:
        devices.use_device(device)  # a read thread's current device is GPU 0 until set
        rec = chunks[ci]
        codec = codecs[rec.codec]
        gpu_decode = on_gpu[rec.codec]
        if gpu_decode and rec.stored_size > slot_bytes:
            raise FormatError(
                f"{where}: nvcomp chunk {ci} stores {rec.stored_size} bytes, more than its "
                f"{rec.raw_size} raw bytes"
            )
        lo, hi = rec.logical_offset, rec.logical_offset + rec.raw_size
        tiled = layout.parts(lo, hi)
        parts = [p for p in (tiled if tiled is not None else layout.overlaps(lo, hi)) if p[0] >= 0]
        slot = ring.take()
        event = None
        stream = None
        try:
            buf = ring.slots[slot]
            if codec.is_passthrough or gpu_decode:
                staged = buf[: rec.stored_size]  # raw, or nvCOMP bytes decoded on the device
                read_verified(backend, ref.file, rec, ci, _mv(staged), tier=tier, where=where)
                repop.write(rec.file_offset, _mv(staged))
            else:
                stored = _mv(host.get("stored", rec.stored_size))
                read_verified(backend, ref.file, rec, ci, stored, tier=tier, where=where)
                repop.write(rec.file_offset, stored)
                staged = buf[: rec.raw_size]
                _decode_host(codec, stored, _mv(staged), ci, tier, where, ref.file)
            stream = devices.thread_stream(device)
            with devices.on_streams([stream]):
                if gpu_decode:
                    assert isinstance(codec, NvcompCodec)
                    dev_in = on_device.get("stored", rec.stored_size)
                    devices.copy_async(dev_in, staged)
                    if len(parts) == 1 and parts[0][1:] == (lo, hi):  # one storage: in place
                        si, a, b = parts[0]
                        out = spans[si][a - offsets[si] : b - offsets[si]]
                        _decode_device(codec, dev_in, out, staged, ci, tier, where, ref.file)
                    else:
                        whole = on_device.get("decoded", rec.raw_size)
                        _decode_device(codec, dev_in, whole, staged, ci, tier, where, ref.file)
                        _scatter(spans, offsets, parts, whole, lo)
                elif len(parts) > SCATTER_MIN_PARTS:
                    whole = on_device.get("decoded", rec.raw_size)
                    devices.copy_async(whole, staged)
                    _scatter(spans, offsets, parts, whole, lo)
                else:
                    for si, a, b in parts:
                        devices.copy_async(
                            spans[si][a - offsets[si] : b - offsets[si]], staged[a - lo : b - lo]
                        )
                event = devices.blocking_event()
                event.record(stream)
        finally:
            if event is None and stream is not None:
                # failed after queuing copies: the slot is reused once they completed
                event = devices.blocking_event()
                event.record(stream)
            ring.give(slot, event)
        return rec.stored_size

    futures: list[Future[int]] = []
    try:
        for ci in range(len(chunks)):
            futures.append(pool.submit(one, ci))
        stored_total = sum(f.result() for f in futures)
        covered = sum(c.raw_size for c in chunks)
        if covered != data_bytes:
            raise FormatError(f"{where}: chunks cover {covered} of {data_bytes} bytes")
        home = spans[0].device if spans else devices.device_empty(0, device).device
        tensors = [
            _rebuild(e, spans, sizes, i, where, home) for i, e in enumerate(index["tensors"])
        ]
        as_parameters(tensors, index, where)
    except BaseException:
        # the other chunks' threads use the ring and the storages: cancel what has not
        # started, wait for the rest, then for their copies, before the storages may be freed
        for f in futures:
            f.cancel()
        concurrent.futures.wait(futures)
        ring.close()
        repop.abort()
        raise
    ring.close()  # every copy completed: the state is on the device when the load returns
    try:
        # only now: rebuilding a quantized tensor copies its integers, which must be in place
        state = decode_tree(index.get("tree"), tensors, **tree_args(index))
    except BaseException:
        repop.abort()
        raise
    return finish_shard(
        repop,
        ref,
        index_blob,
        footer_blob,
        manifest,
        publish=publish,
        state=state,
        tier=tier,
        raw_bytes=data_bytes,
        stored_bytes=stored_total,
        t0=t0,
    )


def _scatter(
    spans: list[torch.Tensor],
    offsets: list[int],
    parts: list[tuple[int, int, int]],
    whole: torch.Tensor,
    lo: int,
) -> None:
    """Copy each storage's share of a chunk on the device (``whole`` holds the chunk)."""
    dsts = [spans[si][a - offsets[si] : b - offsets[si]] for si, a, b in parts]
    srcs = [whole[a - lo : b - lo] for _si, a, b in parts]
    devices.copy_many(dsts, srcs)


def _decode_host(
    codec: Codec, stored: memoryview, out: memoryview, ci: int, tier: str, where: str, file: str
) -> None:
    try:
        codec.decode(stored, out)
    except CorruptChunk as exc:
        raise CorruptChunk(f"{where}: chunk {ci}: {exc}", tier=tier, file=file, chunk=ci) from exc


def _decode_device(
    codec: NvcompCodec,
    data: torch.Tensor,
    out: torch.Tensor,
    host_copy: torch.Tensor,
    ci: int,
    tier: str,
    where: str,
    file: str,
) -> None:
    try:
        codec.decode_device(data, out, host_copy=_mv(host_copy))
    except CorruptChunk as exc:
        raise CorruptChunk(f"{where}: chunk {ci}: {exc}", tier=tier, file=file, chunk=ci) from exc


def _rebuild(
    entry: Any,
    spans: list[torch.Tensor],
    sizes: Sequence[int],
    i: int,
    where: str,
    home: torch.device,
) -> torch.Tensor:
    rec = parse_tensor_entry(entry, i, where, sizes)
    if rec.storage == -1:
        return torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype, device=home)
    item = torch.empty((), dtype=rec.dtype).element_size()
    t = torch.empty(0, dtype=rec.dtype, device=home)
    t.set_(spans[rec.storage].untyped_storage(), rec.offset // item, rec.shape, rec.stride)
    return t
