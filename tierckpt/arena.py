"""The host arena: one buffer, allocated once, pre-touched, reused for every checkpoint.

The arena is cut into equal slots of ``slot_bytes`` (the chunk size); a chunk being captured
holds one slot until every tier has written it. When all slots are taken, ``acquire`` waits
(backpressure) instead of allocating, so host memory used by checkpointing is bounded by the
arena's size whatever the size of the state. The buffer is ordinary memory, 4 KiB aligned and
pre-touched (first touch of fresh memory is ~40x slower than a warm copy); with CUDA exactly its
bytes are then page-locked with ``cudaHostRegister`` so device-to-host copies run at full speed
and asynchronously. (``torch.empty(pin_memory=True)`` would go through torch's caching host
allocator, which rounds every block up to a power of two: a 20 GB arena would pin 32 GiB.)
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
import weakref
from typing import Any

import torch

from tierckpt import config
from tierckpt.config import total_ram as total_ram

__all__ = ["HostArena", "default_host_buffer_bytes"]

ALIGN = 4096
#: an arena of at least this many bytes starts on a huge-page boundary and asks the kernel for
#: transparent huge pages (``madvise(MADV_HUGEPAGE)``, Linux): a direct-I/O write pins every
#: page it writes from (``get_user_pages``), ~3 ms of kernel time per 64 MiB in 4 KiB pages
#: against ~0.9 ms in 2 MiB pages here, on every checkpoint
HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
#: cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinned memory
_REGISTER_PORTABLE = 1

log = logging.getLogger("tierckpt")


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def register_host(ptr: int, nbytes: int) -> None:
    """Page-lock ``nbytes`` of host memory at ``ptr`` for CUDA (``cudaHostRegister``)."""
    err = int(_cudart().cudaHostRegister(ptr, nbytes, _REGISTER_PORTABLE))
    if err != 0:
        raise RuntimeError(
            f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err} (the locked-memory "
            "limit, `ulimit -l`, may be too low; or lower host_buffer_bytes)"
        )


def unregister_host(ptr: int) -> None:
    err = int(_cudart().cudaHostUnregister(ptr))
    if err != 0:
        log.warning("cudaHostUnregister of the host arena failed with CUDA error %d", err)


def _unpin(_memory: torch.Tensor, ptr: int) -> None:
    unregister_host(ptr)  # _memory: kept alive until the registration is gone


def _advise_huge(ptr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages over ``nbytes`` at ``ptr`` (huge-page aligned); False
    where the call is missing or refused (not Linux, THP off): the arena works the same in
    small pages, only its direct-I/O writes cost more kernel time."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return int(madvise(ptr, nbytes, _MADV_HUGEPAGE)) == 0


def default_host_buffer_bytes() -> int:
    """The default arena budget: 1/8 of physical RAM, at most 32 GiB, at least 256 MiB.

    ``TIERCKPT_HOST_BUFFER_BYTES`` overrides it (:func:`tierckpt.config.host_buffer_bytes`).
    """
    return config.host_buffer_bytes()


class HostArena:
    """A fixed pool of ``n_slots`` host buffers of ``slot_bytes`` each, in one allocation."""

    def __init__(self, n_slots: int, slot_bytes: int, *, pin: bool | None = None) -> None:
        if n_slots < 1 or slot_bytes < ALIGN or slot_bytes % ALIGN:
            raise ValueError(
                f"arena needs >= 1 slot of a multiple of {ALIGN} bytes, "
                f"got {n_slots} x {slot_bytes}"
            )
        self.n_slots = n_slots
        self.slot_bytes = slot_bytes
        want_pin = torch.cuda.is_available() if pin is None else pin
        nbytes = n_slots * slot_bytes
        t0 = time.perf_counter()
        align = HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGN
        raw = torch.empty(nbytes + align, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % align
        self._raw = raw
        self.buffer = raw[skip : skip + nbytes]
        #: whether the kernel was asked to back the arena with huge pages (before the first
        #: touch, so the pre-touch below faults them in as huge pages where it has them)
        self.huge_pages = align == HUGE_PAGE and _advise_huge(self.buffer.data_ptr(), nbytes)
        self.buffer.fill_(0)  # pre-touch every page now, not during the first checkpoint
        self.pinned = False
        self._unpin: weakref.finalize[Any, Any] | None = None
        if want_pin:
            try:
                register_host(self.buffer.data_ptr(), nbytes)
            except RuntimeError as exc:
                if pin:  # asked for explicitly: fail loudly
                    raise
                # still correct, only slower: copies into pageable memory are synchronous
                log.warning("host arena not pinned; device-to-host copies will be slower: %s", exc)
            else:
                self.pinned = True
                # unregistered exactly once: at close(), or when the arena is collected (the
                # finalizer holds the buffer, so its memory outlives the registration)
                self._unpin = weakref.finalize(self, _unpin, self._raw, self.buffer.data_ptr())
        self.alloc_seconds = time.perf_counter() - t0
        #: the slots of the first allocation; those past it were added by :meth:`grow`
        self._base = n_slots
        self._extra: list[torch.Tensor | None] = []
        #: slots grow() added whose memory was given back (retire_free_extra): reused first
        self._retired: list[int] = []
        self._free = list(range(n_slots - 1, -1, -1))
        self._cond = threading.Condition()
        self._closed = False

    @property
    def live_slots(self) -> int:
        """The slots with memory (``n_slots`` counts the retired ones too)."""
        return self.n_slots - len(self._retired)

    @property
    def extra_slots(self) -> int:
        """The slots with memory that :meth:`grow` added."""
        return self.live_slots - self._base

    @property
    def nbytes(self) -> int:
        return self.live_slots * self.slot_bytes

    def slot(self, i: int) -> torch.Tensor:
        if i >= self._base:
            extra = self._extra[i - self._base]
            if extra is None:
                raise RuntimeError(f"arena slot {i} was retired")
            return extra
        return self.buffer[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def grow(self) -> int:
        """One more slot, allocated now and returned taken (the caller releases it as any
        other): for a capture that would otherwise wait for slots a stalled tier holds. Its
        memory is apart from the first allocation, aligned for direct I/O and not pinned (a
        device copy into it is still correct, only synchronous)."""
        raw = torch.empty(self.slot_bytes + ALIGN, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN
        with self._cond:
            if self._closed:
                raise RuntimeError("host arena is closed")
            view = raw[skip : skip + self.slot_bytes]
            if self._retired:
                i = self._retired.pop()
                self._extra[i - self._base] = view
                return i
            self._extra.append(view)
            self.n_slots += 1
            return self.n_slots - 1

    def retire_free_extra(self) -> int:
        """Give back the memory of every free slot :meth:`grow` added (the arena shrinks back
        towards its first allocation once the stall it grew past is over); how many."""
        with self._cond:
            idle = [i for i in self._free if i >= self._base]
            for i in idle:
                self._free.remove(i)
                self._extra[i - self._base] = None
                self._retired.append(i)
            return len(idle)

    def acquire(self, timeout: float | None = None) -> int:
        """Take a free slot, waiting for one to be released (backpressure)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                if self._closed:
                    raise RuntimeError("host arena is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("no host arena slot was released in time")
                self._cond.wait(remaining)
            return self._free.pop()

    def release(self, i: int) -> None:
        with self._cond:
            if i in self._free or i in self._retired or not 0 <= i < self.n_slots:
                raise RuntimeError(f"arena slot {i} released twice or out of range")
            self._free.append(i)
            self._cond.notify_all()  # acquirers and wait_idle() share the condition

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every slot is free again (all chunks written by every tier); False
        if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._free) < self.live_slots and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return True

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self.pinned = False
        if self._unpin is not None:
            self._unpin()
