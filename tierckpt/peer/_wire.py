"""Moving shard files between ranks over a gloo process group: :func:`exchange`.

One exchange is a round every rank of the group takes part in (those with nothing to send or
receive return at once). Each sender offers one file (a committed shard and the manifest that
lists it) to each of its destinations; each receiver decides from the manifest whether it takes
the file and where it goes. Four steps, each posted without blocking on every pair and then
waited for, so that no order of ranks can deadlock:

1. headers (``valid, step, timeline, file size, manifest length, rank, kept``) from senders to
   receivers;
2. the manifests (for valid headers), and the checkpoints the sender asks its receivers to
   keep (``kept`` keys, :func:`~tierckpt.distributed.checkpoint_key`: its pins and what its
   node RAM keeps by ``keep_best`` / ``keep_every_n_steps``), sent whatever the offer;
3. the receivers' answers (take it or not: already held, over budget, invalid);
4. the file, in pieces of at most :data:`PIECE_BYTES`, straight from a copy-on-write map of the
   sender's file into a shared map of the receiver's temporary file: no staging copy on either
   side, so a transfer takes no host memory beyond the replica itself.

Where a pull's time goes (``benchmarks/bench_recovery.py``): the handshakes of steps 1-3 are
a few small messages (well under a millisecond on loopback); the file is one stream whose
receiving end must first get fresh tmpfs pages (a replacement node's memory is empty): the
kernel allocates and zeroes each 4 KiB page on the first write to it, which costs about as
much as the copy off the socket itself (on a 2-vCPU VM, ~55 ms of a 128 MiB pull's ~110 ms).
So a pull receives into a *spare segment* where the caller has one (``spare``: pages
allocated at setup, :mod:`tierckpt.peer._spare`), renamed to the receiving file's temporary
name. Without one, a thread of the receiver populates the rest of the file ahead of the
pieces (:func:`populate_ahead`: ``MADV_POPULATE_WRITE``, Linux 5.14+, in steps of
:data:`POPULATE_STEP`), which can take those faults off the stream's path on a node with a
spare core; the map also asks for huge pages (``MADV_HUGEPAGE``, used where the tmpfs
allows them: ``shmem_enabled`` ``advise``), which make the allocation itself cheaper.

A receiver renames its file into place once it is whole; committing it (its manifest, create-
only) is the caller's. Everything here blocks the calling thread; the process group must be
used by that one thread only.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.backends._templock import hold_new_temp
from tierckpt.backends.base import validate_name
from tierckpt.errors import FormatError
from tierckpt.format import CheckpointId, Manifest, decode_manifest
from tierckpt.limits import MAX_MANIFEST_BYTES
from tierckpt.peer._spare import SpareSegment, populate_pages

__all__ = [
    "PIECE_BYTES",
    "POPULATE_STEP",
    "Offer",
    "Received",
    "exchange",
    "populate_ahead",
    "send_file_map",
]

#: the largest single send: big enough that per-message cost vanishes, small enough that a
#: dead peer is noticed within one piece's time
PIECE_BYTES = 256 << 20
_HEADER = 7
#: pages a receiver populates per call ahead of the arriving bytes: small enough that a stop
#: (a failed round) waits little, large enough that the calls cost nothing
POPULATE_STEP = 4 << 20
#: populate a receiving file's pages ahead of the bytes (:func:`populate_ahead`)
POPULATE_AHEAD = True
#: the most checkpoint keys a sender asks its receivers to keep (pins, best, every n-th)
MAX_KEPT = 4096


@dataclass(frozen=True, slots=True)
class Offer:
    """A committed shard file this rank sends: ``path`` on this node, ``manifest`` its
    checkpoint's manifest (encoded), ``rank`` whose shard it is."""

    cid: CheckpointId
    rank: int
    manifest: bytes
    path: str
    size: int


@dataclass(frozen=True, slots=True)
class Received:
    """A file that arrived: ``rank``'s shard of ``manifest``, now at ``path``."""

    src: int
    rank: int
    manifest: Manifest
    body: bytes
    path: str
    size: int


#: (source rank, whose shard, manifest) -> the file's final path, or None to decline
Accept = Callable[[int, int, Manifest], "str | None"]


def send_file_map(path: str, size: int) -> tuple[Any, torch.Tensor]:
    """A private copy-on-write map of ``path`` (no copy is made unless written) as a uint8
    tensor: writable, so torch takes it without a warning; unlinking the file meanwhile
    (retention) does not disturb it."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise FormatError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, expected {size}")
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def populate_ahead(buf: torch.Tensor, stop: threading.Event, step: int = POPULATE_STEP) -> int:
    """Allocate the pages of a receiving file's map ahead of the arriving bytes, ``step``
    bytes per call, until ``stop`` (:func:`tierckpt.peer._spare.populate_pages`: never writes a
    byte, so bytes already received stay as they are; before Linux 5.14 it does nothing and
    the receive faults the pages in itself). Returns the bytes populated."""
    return populate_pages(buf, stop, step)


def _recv_map(
    path: str, size: int, spare: SpareSegment | None = None
) -> tuple[str, int, Any, torch.Tensor]:
    tmp = f"{path}.{secrets.token_hex(6)}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    taken = spare.take(tmp, size) if spare is not None else None
    if taken is not None:  # pages allocated before the pull: nothing to populate
        return tmp, *taken
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if not hold_new_temp(fd, tmp):  # a sweep took it for a dead pull's: another name
        os.close(fd)
        return _recv_map(path, size)
    try:
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)  # honoured where the tmpfs allows huge pages
        except OSError:
            pass
    return tmp, fd, mm, torch.frombuffer(mm, dtype=torch.uint8)


def _close(mm: Any) -> None:
    """Unmap now, or (a tensor of a finished send still refers to it) when collected."""
    try:
        mm.close()
    except BufferError:
        pass


def _wait(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


def exchange(
    group: Any,
    me: int,
    offers: dict[int, Offer | None],
    sources: Sequence[int],
    accept: Accept,
    tag: int = 0,
    *,
    kept: Sequence[int] = (),
    kept_in: dict[int, list[int]] | None = None,
    spare: SpareSegment | None = None,
) -> list[Received]:
    """One round: send ``offers`` (destination rank -> offer; None: nothing this round) and
    receive from ``sources``; ``accept`` names where a received file goes. ``kept``:
    checkpoint keys sent to every destination (at most :data:`MAX_KEPT`); ``kept_in``, if
    given, gets each source's. ``spare``: a pre-allocated segment the (one) received file
    goes into (:mod:`tierckpt.peer._spare`). See the module docstring. Raises on a broken peer (the
    group's timeout) or a malformed manifest."""
    import torch.distributed as dist

    def isend(t: torch.Tensor, dst: int, k: int) -> Any:
        return dist.isend(t, dst, group=group, tag=tag * 64 + k)

    def irecv(t: torch.Tensor, src: int, k: int) -> Any:
        return dist.irecv(t, src, group=group, tag=tag * 64 + k)

    # 1. headers
    kept = list(kept)[-MAX_KEPT:]
    out_h = {}
    for dst, o in offers.items():
        v = (
            [0] * (_HEADER - 1)
            if o is None
            else [1, o.cid.step, o.cid.timeline, o.size, len(o.manifest), o.rank]
        )
        out_h[dst] = torch.tensor([*v, len(kept)], dtype=torch.int64)
    in_h = {src: torch.zeros(_HEADER, dtype=torch.int64) for src in sources}
    _wait([isend(t, d, 0) for d, t in out_h.items()] + [irecv(t, s, 0) for s, t in in_h.items()])
    heads = {s: [int(x) for x in t.tolist()] for s, t in in_h.items()}
    for s, h in heads.items():
        if h[0] and not 0 < h[4] <= MAX_MANIFEST_BYTES:
            raise FormatError(f"rank {s} announced a manifest of {h[4]} bytes")
        if not 0 <= h[6] <= MAX_KEPT:
            raise FormatError(f"rank {s} announced {h[6]} checkpoints to keep")
    # 2. manifests, and the checkpoints to keep
    m_out = {
        d: torch.frombuffer(bytearray(o.manifest), dtype=torch.uint8)
        for d, o in offers.items()
        if o is not None
    }
    m_in = {s: torch.empty(h[4], dtype=torch.uint8) for s, h in heads.items() if h[0]}
    k_out = torch.tensor(kept, dtype=torch.int64)
    k_in = {s: torch.empty(h[6], dtype=torch.int64) for s, h in heads.items() if h[6]}
    _wait(
        [isend(t, d, 1) for d, t in m_out.items()]
        + [irecv(t, s, 1) for s, t in m_in.items()]
        + ([isend(k_out, d, 63) for d in offers] if kept else [])  # a tag of its own
        + [irecv(t, s, 63) for s, t in k_in.items()]
    )
    if kept_in is not None:
        for s in sources:
            kept_in[s] = [int(x) for x in k_in[s].tolist()] if s in k_in else []
    # 3. answers
    takes: dict[int, tuple[str, Manifest, bytes, int, int]] = {}
    for s, t in m_in.items():
        body = t.numpy().tobytes()
        _valid, step, timeline, size, _n, rank, _kept = heads[s]
        m = decode_manifest(body, where=f"manifest sent by rank {s}")
        ref = m.shard_for(rank)
        validate_name(ref.file)
        if (m.step, m.timeline) != (step, timeline) or ref.size != size:
            raise FormatError(f"rank {s} sent a manifest that does not match its header {heads[s]}")
        path = accept(s, rank, m)
        if path is not None:
            takes[s] = (path, m, body, size, rank)
    ans_out = {s: torch.tensor([int(s in takes)], dtype=torch.int64) for s in m_in}
    ans_in = {d: torch.zeros(1, dtype=torch.int64) for d, o in offers.items() if o is not None}
    _wait(
        [isend(t, s, 2) for s, t in ans_out.items()] + [irecv(t, d, 2) for d, t in ans_in.items()]
    )
    # 4. the files
    sending = {d: offers[d] for d, t in ans_in.items() if int(t.item())}
    maps_out: dict[int, tuple[Any, torch.Tensor]] = {}
    maps_in: dict[int, tuple[str, int, Any, torch.Tensor]] = {}
    received: list[Received] = []
    stop = threading.Event()
    fillers: list[threading.Thread] = []
    to_fill: list[torch.Tensor] = []
    try:
        for d, o in sending.items():
            assert o is not None
            maps_out[d] = send_file_map(o.path, o.size)
        for s, (path, _m, _b, size, _r) in takes.items():
            maps_in[s] = _recv_map(path, size, spare if len(takes) == 1 else None)
        if maps_in and POPULATE_AHEAD and not (spare is not None and len(takes) == 1):
            # the fresh pages' allocation overlaps the transfer instead of stalling it
            to_fill += [x[3] for x in maps_in.values()]

            def fill() -> None:
                for t in to_fill:
                    populate_ahead(t, stop)

            fillers.append(threading.Thread(target=fill, name="tierckpt-peer-populate"))
            fillers[0].start()
        works: list[Any] = []
        longest = max(
            [o.size for o in sending.values() if o] + [x[3] for x in takes.values()] + [0]
        )
        for i, start in enumerate(range(0, longest, PIECE_BYTES)):
            works = []
            for d, (_mm, t) in maps_out.items():
                if start < t.numel():
                    works.append(isend(t[start : start + PIECE_BYTES], d, 3 + i % 60))
            for s, (_tmp, _fd, _mm, t) in maps_in.items():
                if start < t.numel():
                    works.append(irecv(t[start : start + PIECE_BYTES], s, 3 + i % 60))
            _wait(works)
        del works
        stop.set()
        for th in fillers:
            th.join()
        to_fill.clear()  # its views of the maps must go before the maps can close
        for s in list(maps_in):
            tmp, fd, mm, _t = maps_in.pop(s)
            del _t
            _close(mm)  # MAP_SHARED: the bytes are in the file whether or not it unmaps now
            path, m, body, size, rank = takes[s]
            try:  # renamed while its lock is held (tierckpt.backends._templock)
                os.replace(tmp, path)
            finally:
                os.close(fd)
            received.append(Received(s, rank, m, body, path, size))
    finally:
        stop.set()  # a failed round: the filler stops before its maps go
        for th in fillers:
            th.join()
        to_fill.clear()
        for d in list(maps_out):
            mm, _t = maps_out.pop(d)
            del _t
            _close(mm)
        for s in list(maps_in):  # a failed round: nothing half-written stays
            tmp, fd, mm, _t = maps_in.pop(s)
            del _t
            _close(mm)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            os.close(fd)
    return received
