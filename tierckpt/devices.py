"""The CUDA surface of the background threads, in one place: the device a thread works on,
the streams it queues work on and the events it waits for.

Rules (issue 14): a background thread (capture, encoder, arena builder, restore) makes the
device of the state it works on its current device before any CUDA call, so that on an
8-GPU node no rank creates a context on GPU 0; capture queues its copies on one dedicated
stream per device, an encoder thread its nvCOMP work on a stream of its own, never the
default stream (usually the training stream); and threads wait for events created with
``blocking=True``, which sleep in the driver instead of spinning a core.

Every call here is a thin wrapper so that tests on a machine without CUDA replace these
functions (``monkeypatch.setattr(devices, "set_device", ...)``) and observe what each thread
did.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "blocking_event",
    "copy_async",
    "copy_many",
    "cuda_available",
    "cuda_devices",
    "current_stream_wait",
    "device_empty",
    "free_bytes",
    "indexed",
    "new_stream",
    "on_streams",
    "pinned_empty",
    "set_device",
    "thread_stream",
    "use_device",
]

_local = threading.local()


def set_device(index: int) -> None:
    """``torch.cuda.set_device`` (the one call tests record per thread)."""
    torch.cuda.set_device(index)


def current_device() -> int:
    """``torch.cuda.current_device()`` of the calling thread."""
    return int(torch.cuda.current_device())


def new_stream(device: torch.device) -> Any:
    """A new CUDA stream on ``device`` (never the default stream)."""
    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize()`` sleeps until the work is done (no busy spin)."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def on_streams(streams: Iterable[Any]) -> Iterator[None]:
    """Make each stream the current stream of its device for the block."""
    with contextlib.ExitStack() as stack:
        for s in streams:
            stack.enter_context(torch.cuda.stream(s))
        yield


def cuda_devices(devices: Iterable[torch.device | str]) -> list[torch.device]:
    """The CUDA devices among ``devices``, with an index, sorted, without duplicates."""
    out: set[torch.device] = set()
    for d in devices:
        dev = torch.device(d)
        if dev.type == "cuda":
            out.add(dev if dev.index is not None else torch.device("cuda", 0))
    return sorted(out, key=lambda d: d.index or 0)


def use_device(device: torch.device | str | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (no-op for CPU or None).

    Called by every background thread before it touches CUDA: a fresh thread's current
    device is 0, whatever the training thread set."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    index = dev.index if dev.index is not None else 0
    # asked each time, not cached: on a user's thread (a load decoding on the GPU) the
    # user may have changed the device since
    if current_device() != index:
        set_device(index)


def thread_stream(device: torch.device) -> Any:
    """This thread's own stream on ``device``, created on first use and reused (an encoder
    thread's nvCOMP work goes there, not on the default stream)."""
    cache: dict[torch.device, Any] = _local.__dict__.setdefault("streams", {})
    s = cache.get(device)
    if s is None:
        use_device(device)
        s = new_stream(device)
        cache[device] = s
    return s


def cuda_available() -> bool:
    """``torch.cuda.is_available()``."""
    return bool(torch.cuda.is_available())


def indexed(device: torch.device) -> torch.device:
    """``device`` with an index: plain ``cuda`` means the calling thread's current device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", current_device())
    return device


def device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` on ``device``, allocated on the calling
    thread's current stream (the stream that may free and reuse it)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def pinned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised page-locked host buffer of ``nbytes`` (torch's caching host allocator:
    freed blocks are reused by the next load instead of being pinned again)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` on the calling thread's current stream: from
    pinned host memory to the device it returns at once and the copy engine does the rest."""
    dst.copy_(src, non_blocking=True)


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dsts[i].copy_(srcs[i])`` for every ``i`` on the calling thread's current stream, in
    as few kernels as torch allows (``_foreach_copy_``: one launch for many small tensors)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs, non_blocking=True)
        return
    for d, s in zip(dsts, srcs, strict=True):  # pragma: no cover - torch < 2.1
        d.copy_(s, non_blocking=True)


def free_bytes(device: torch.device) -> int:
    """Bytes ``device`` can still hand out: what the driver reports free plus what torch's
    caching allocator holds reserved but unused."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free) + max(0, int(cached))


def current_stream_wait(device: torch.device, event: Any) -> None:
    """Make the calling thread's current stream on ``device`` (the training stream, in the
    optimizer's step hook) wait for ``event`` on the GPU; the host does not wait."""
    torch.cuda.current_stream(device).wait_event(event)
