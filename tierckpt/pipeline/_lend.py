"""A tier's writer and the arena slots lent to it: a :class:`Loan` is one tier's hold on a
chunk's slot, a :class:`Countdown` frees it after several holders (the writer and the
checksum), :func:`early_view` says when a chunk may be uploaded before its checksum is known,
and :func:`abort_quietly` aborts a writer without ending the tier's thread.

Part of :class:`~tierckpt.pipeline.Pipeline` (its tiers' writer threads)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from tierckpt import devices
from tierckpt.arena import HostArena
from tierckpt.backends.base import ObjectWriter
from tierckpt.codecs import SupportsProfile
from tierckpt.pipeline._values import SaveJob, Tier, _ChunkState

log = logging.getLogger("tierckpt")


class Loan:
    """One tier's hold on a chunk's arena slot: released once, by the tier's thread after a
    plain write, or by the writer (``write_lent``) once it no longer reads the slot."""

    __slots__ = ("handed", "release")

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release
        #: the writer took the release over
        self.handed = False


class Countdown:
    """Calls ``release`` on the ``n``-th call: an arena slot lent to a writer before its
    checksum is known is freed once the writer is done with it and the checksum too."""

    __slots__ = ("_left", "_lock", "_release")

    def __init__(self, n: int, release: Callable[[], None]) -> None:
        self._left = n
        self._release = release
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


def early_view(
    tier: Tier,
    job: SaveJob,
    writer: ObjectWriter | None,
    arena: HostArena | None,
    state: _ChunkState,
) -> memoryview | None:
    """The chunk's arena bytes where ``tier`` may upload them before their checksum is known
    (None: it waits for the encoder): a raw tier (the stored bytes are the slot's, whatever the
    encoder computes) of a host-only save (the slot is filled before the chunk is queued; a
    device copy is done only at its event) whose writer lends (``write_lent``)."""
    codec = tier.codec
    if (
        isinstance(codec, SupportsProfile)
        or not codec.for_dtype(state.plan.dtype).is_passthrough
        or devices.cuda_devices(job.ready_events)
        or getattr(writer, "write_lent", None) is None
        or arena is None
    ):
        return None
    slot = arena.slot(state.slot)[: state.plan.raw_size]
    return memoryview(slot.numpy())  # type: ignore[arg-type]


def abort_quietly(tier: Tier, writer: ObjectWriter) -> None:
    """``writer.abort()``, which must never raise (:class:`ObjectWriter`'s contract). One that
    raises anyway (a third-party backend, a bug) must not end this tier's thread: every later
    save on the tier would wait for it until given up, for the rest of the run."""
    try:
        writer.abort()
    except Exception as exc:
        log.warning(
            "tier %s: abort of %s failed (what it staged may be left behind; retention sweeps "
            "it at the next commit there): %s",
            tier.name,
            writer.name,
            exc,
        )
