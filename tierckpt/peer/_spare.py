"""A spare segment: node RAM allocated before a pull, so that the pull receives into pages
that already exist.

A replacement node's memory is empty, and tmpfs allocates (and zeroes) each 4 KiB page of a
new file on the first write to it: receiving a shard into a new file costs the kernel about
as much as the copy off the socket (on a 2-vCPU VM, ~55-70 ms of a 128 MiB pull's ~110 ms),
and a thread populating the file ahead of the arriving bytes did not hide it. So a rank that
will pull at its load — its node RAM lacks the newest checkpoint that a partner holds a
replica of, which every rank learns at setup from one small ``all_gather`` (the partners
know the replica's exact size) — allocates a spare segment of that size when the
``Checkpointer`` is built, in a background thread (``MADV_POPULATE_WRITE`` over a shared map,
or a write to every page where the kernel lacks it), while the job builds its model. The
pull renames the spare into place as its receiving file and receives into its pages; the
load waits for the spare first if it is not ready yet (``RestoreReport.spare_wait_seconds``).

The spare is ``<run folder>.replicas/spare/rank-<r>.seg``: outside every tier's folder (no
listing, manifest or retention sees it: it is never a checkpoint, and its bytes are garbage
until a pull overwrites all of them and renames it), counted in the node-RAM budget like
every file of the run's folders (it is only made if it fits), removed with a dead run's
folders. A rank that needs no spare (its node RAM has the newest checkpoint) removes its own
stale one at setup; one left by a crashed process of the same rank is reused (its pages are
still there). A pull killed after taking the spare leaves a temporary file (``*.tmp``) that
no manifest names, swept like any unfinished write.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tierckpt import _libc
from tierckpt.backends.base import Backend
from tierckpt.catalog import committed_ids
from tierckpt.distributed import checkpoint_key
from tierckpt.errors import TierCkptError
from tierckpt.noderam import REPLICA_SUFFIX, NodeRamBackend
from tierckpt.peer._placement import Placement
from tierckpt.restore import read_manifest

__all__ = ["SPARE_DIR", "SpareSegment", "newest_shard", "populate", "prepare_spare", "spare_path"]

log = logging.getLogger("tierckpt")

#: the spare's folder in the run's replica folder
SPARE_DIR = "spare"
#: newest checkpoints looked at for a whole shard
_CANDIDATES = 16
#: pages populated per call: a close stops the filler within one step
_STEP = 8 << 20


def spare_path(replica_root: str, rank: int) -> str:
    """The spare segment of ``rank`` under its run's replica folder ``replica_root``."""
    return os.path.join(replica_root, SPARE_DIR, f"rank-{rank:06d}.seg")


def populate_pages(buf: torch.Tensor, stop: threading.Event | None, step: int) -> int:
    """Allocate the pages of ``buf`` (a uint8 tensor over a page-aligned shared map) front to
    back, ``step`` bytes per call (``MADV_POPULATE_WRITE``: the kernel allocates and maps them
    as a write fault would, without writing a byte, so bytes already there stay as they are);
    stops at ``stop`` or where the kernel does not know the advice (before Linux 5.14).
    Returns the bytes populated."""
    madvise = _libc.madvise
    if madvise is None:
        return 0
    base, size = buf.data_ptr(), buf.numel()
    done = 0
    while done < size and not (stop is not None and stop.is_set()):
        n = min(step, size - done)
        if madvise(base + done, n, _libc.MADV_POPULATE_WRITE) != 0:
            break
        done += n
    return done


def populate(mm: Any, size: int, stop: threading.Event | None = None) -> None:
    """Allocate every page of the shared map ``mm`` (``size`` bytes) without changing a byte
    that is already there: :func:`populate_pages`, and where the kernel lacks that advice a
    write of each remaining page's first byte with its own value (a write fault per page)."""
    if not size:
        return
    t = torch.frombuffer(mm, dtype=torch.uint8, count=size)
    done = populate_pages(t, stop, _STEP)
    if done < size and not (stop is not None and stop.is_set()):
        rest = t[done:]
        rest[:: mmap.PAGESIZE] = rest[:: mmap.PAGESIZE].clone()  # one write per page
    del t


class SpareSegment:
    """One rank's spare segment of ``size`` bytes at ``path``: :meth:`start` allocates it in
    a background thread, :meth:`take` hands it to a pull, :meth:`discard` removes it."""

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd: int | None = None
        self._mm: Any = None
        self.error: str | None = None
        #: seconds the allocation took (for tests and benchmarks)
        self.seconds = 0.0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._fill, name="tierckpt-peer-spare", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        t0 = time.perf_counter()
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
            self._fd = fd
            # locked before a pull renames it into a tier folder as its temporary file: a
            # sweep never takes it for a dead pull's (tierckpt.backends._templock)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.ftruncate(fd, self.size)
            self._mm = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            populate(self._mm, self.size, self._stop)
        except Exception as exc:  # a spare is a courtesy: the pull then allocates as it goes
            self.error = str(exc)
            log.warning("PeerTier: could not prepare a spare segment %s: %s", self.path, exc)
            self._release(unlink=True)
        self.seconds = time.perf_counter() - t0

    def wait(self) -> float:
        """Wait until the spare is ready; the seconds waited."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
        return time.perf_counter() - t0

    def take(self, dest: str, size: int) -> tuple[int, Any, torch.Tensor] | None:
        """Rename the ready spare to ``dest`` (a pull's temporary file) and return its
        ``(fd, map, uint8 tensor of size bytes)``, the file cut or grown to ``size``; None
        if there is no ready spare (the caller then makes a new file)."""
        self.wait()
        fd, mm = self._fd, self._mm
        if fd is None or mm is None or self.error is not None:
            return None
        self._fd = self._mm = None  # the caller owns them now
        try:
            os.rename(self.path, dest)
        except OSError as exc:  # gone, or another file system: the pull makes its own file
            log.warning("PeerTier: spare segment %s not used: %s", self.path, exc)
            _close_map(mm)
            os.close(fd)
            return None
        try:
            if size != self.size:
                if size < self.size:
                    os.ftruncate(fd, size)  # the pages past the end are freed
                    return fd, mm, torch.frombuffer(mm, dtype=torch.uint8, count=size)
                _close_map(mm)
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            return fd, mm, torch.frombuffer(mm, dtype=torch.uint8, count=size)
        except BaseException:
            _close_map(mm)
            os.close(fd)
            raise

    def _release(self, unlink: bool) -> None:
        if self._mm is not None:
            _close_map(self._mm)
            self._mm = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if unlink:
            try:
                os.unlink(self.path)
            except OSError:
                pass

    def discard(self) -> None:
        """Stop the allocation and remove the spare (a load that did not need it, close)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._release(unlink=True)


def _close_map(mm: Any) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a tensor over it still lives: unmapped when collected


def newest_shard(backend: Backend, rank: int) -> tuple[int, int] | None:
    """(checkpoint key, shard size) of the newest checkpoint whose ``rank`` shard is whole
    on ``backend``, or None."""
    for cid in reversed(committed_ids(backend)[-_CANDIDATES:]):
        try:
            ref = read_manifest(backend, cid.step, "noderam", timeline=cid.timeline).shard_for(rank)
            if backend.size(ref.file) == ref.size:
                return checkpoint_key(cid), ref.size
        except (OSError, TierCkptError):
            continue
    return None


def prepare_spare(
    ram: NodeRamBackend,
    replicas: Callable[[int], NodeRamBackend],
    placement: Placement,
    rank: int,
    group: Any,
) -> SpareSegment | None:
    """Setup, every rank together (one ``all_gather`` on ``group``): tell each rank the
    newest replica its partners hold of its shard (``replicas(src)``: where this rank keeps
    ``src``'s); a rank whose node RAM (``ram``) lacks that checkpoint will pull it at its
    load, so it starts allocating a spare segment of its size (at :func:`spare_path`) if
    the node-RAM budget allows; otherwise a stale spare there is removed. See the module
    docstring."""
    import torch.distributed as dist

    path = spare_path(ram.budget_root + REPLICA_SUFFIX, rank)
    world = len(placement.partners)
    smax = max(placement.max_sources(), 1)
    vec = torch.full((3 * smax,), -1, dtype=torch.int64)
    for i, src in enumerate(placement.sources(rank)[:smax]):
        got = newest_shard(replicas(src), src)
        if got is not None:
            vec[3 * i : 3 * i + 3] = torch.tensor([src, *got], dtype=torch.int64)
    gathered = [torch.empty_like(vec) for _ in range(world)]
    dist.all_gather(gathered, vec, group=group)
    mine = [
        (int(v[j + 1]), int(v[j + 2]))
        for v in (g.tolist() for g in gathered)
        for j in range(0, len(v), 3)
        if v[j] == rank
    ]
    if mine:
        key, size = max(mine)
        own = newest_shard(ram, rank)
        if own is None or own[0] < key:
            try:
                have = os.stat(path).st_blocks * 512  # a crashed predecessor's: reused
            except OSError:
                have = 0
            try:
                ram.check_budget(max(0, size - have), os.path.relpath(path, ram.root))
            except OSError as exc:
                log.warning("PeerTier: no spare segment for the pull: %s", exc)
            else:
                spare = SpareSegment(path, size)
                spare.start()
                return spare
    try:
        os.unlink(path)  # stale: nothing to pull (or no room for it)
    except OSError:
        pass
    return None
