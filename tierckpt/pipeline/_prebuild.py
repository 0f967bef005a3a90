"""The host arena built at the writer's construction, on a background thread.

Allocating, touching and pinning an arena of many GiB takes seconds; done inside the first
save's capture it would stall training behind ``guard`` (the optimizer step waits for the
capture). So the writer starts this thread when it is made, and the first save takes the
arena it built (waiting only if the save comes before the arena is ready).

Part of :class:`~tierckpt.pipeline.Pipeline`."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from tierckpt import devices
from tierckpt.arena import HostArena
from tierckpt.format import align_up

log = logging.getLogger("tierckpt")

__all__ = ["ArenaPrebuild"]


class ArenaPrebuild:
    """Builds a ``HostArena`` of ``host_buffer_bytes`` in slots of ``chunk_bytes`` on a thread
    that first selects ``device`` (the rank's GPU: pinning creates a CUDA context there, not
    on GPU 0)."""

    def __init__(
        self, host_buffer_bytes: int, chunk_bytes: int, device: torch.device | None
    ) -> None:
        self.slot_bytes = align_up(max(chunk_bytes, 4096))
        self.n_slots = max(2, host_buffer_bytes // self.slot_bytes)
        self.device = device
        self._future: Future[HostArena] = Future()
        self._lock = threading.Lock()
        self._taken = False
        self.thread = threading.Thread(target=self._build, name="tierckpt-arena", daemon=True)
        self.thread.start()

    def _build(self) -> None:
        try:
            devices.use_device(self.device)
            arena = HostArena(self.n_slots, self.slot_bytes)
        except BaseException as exc:
            # the first save builds its arena itself then (slower, still correct)
            log.warning("host arena could not be built ahead of the first save: %s", exc)
            self._future.set_exception(exc)
            return
        log.debug(
            "host arena built ahead: %d slots x %d bytes, pinned=%s (%.2f s)",
            self.n_slots,
            self.slot_bytes,
            arena.pinned,
            arena.alloc_seconds,
        )
        self._future.set_result(arena)

    def done(self) -> bool:
        return self._future.done()

    def take(self) -> HostArena | None:
        """The arena (waiting for it if still being built), once; None if building failed."""
        with self._lock:
            if self._taken:
                return None
            self._taken = True
        try:
            return self._future.result()
        except BaseException:
            return None

    def peek(self) -> HostArena | None:
        """The arena if it is built and no save has taken it yet, without waiting (a load
        onto the GPU stages through its free slots); None otherwise."""
        with self._lock:
            if self._taken or not self._future.done() or self._future.exception() is not None:
                return None
            return self._future.result()

    def discard(self) -> None:
        """Release the arena if no save took it (the writer is closed)."""
        arena = self.take()
        if arena is not None:
            arena.close()
