"""Stop at a step when the job is asked to: SIGTERM (Kubernetes, SLURM, torchrun, a spot
reclaim) turned into a flag the training loop checks once per step.

Python's default answer to SIGTERM ends the process at once: the save in flight is lost (what
was committed before stays), and the state of the steps since the last checkpoint with it. With
:class:`Preemption` installed, the signal only sets a flag; the loop asks :meth:`Preemption.check`
after each step, saves that step and leaves. A job of several ranks must stop at the same step
on every rank, or the save's collective waits for a rank that went on training: ``check()`` is
one all-reduce of one integer (on the default process group, on the device its collectives use),
so every rank gets the same answer as soon as any rank got a signal::

    ck = tierckpt.Checkpointer(policy)
    with tierckpt.Preemption(grace_s=30) as stop:  # SIGTERM; SLURM: signals=(SIGTERM, SIGUSR1)
        for step in range(start, steps):
            train_step()
            if stop.check():                       # the same answer on every rank
                ck.save(state, step).wait(tier="local")   # within the grace period
                break
            if step % every == 0:                  # after the check: each step saved once
                ck.save(state, step)
    ck.close(timeout=stop.time_left())   # the slower tiers get the rest of the grace period;
                                         # what they have not committed then is given up

A second signal of the same kind while the first is being handled ends the process as it would
have without :class:`Preemption` (the previous handler runs, or the default action): an
operator who means it sends it twice. Signal handlers can only be installed from the main
thread (Python's rule); :class:`Preemption` says so if it is made elsewhere.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from types import FrameType
from typing import Any

__all__ = ["Preemption"]

log = logging.getLogger("tierckpt")

_Handler = Any  # what signal.getsignal returns: a callable, SIG_DFL, SIG_IGN or None


class Preemption:
    """Turns ``signals`` (default SIGTERM) into a flag; see the module docstring.

    ``rank`` and ``world_size`` default to ``torch.distributed``'s when it is initialized
    (else one rank). ``grace_s``: the grace period between the signal and the kill (e.g.
    Kubernetes' ``terminationGracePeriodSeconds``, 30 s by default), for :meth:`time_left`.
    Use it as a context manager, or call :meth:`close` to put the previous handlers back.
    """

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM,),
        *,
        rank: int | None = None,
        world_size: int | None = None,
        grace_s: float | None = None,
    ) -> None:
        from tierckpt.checkpointer._steps import resolve_rank

        if grace_s is not None and (
            isinstance(grace_s, bool)
            or not isinstance(grace_s, int | float)
            or not 0 < grace_s < float("inf")
        ):
            raise ValueError(
                "Preemption(grace_s=) is the seconds between the signal and the kill "
                f"(e.g. terminationGracePeriodSeconds), a number > 0; got {grace_s!r}"
            )
        self.grace_s = None if grace_s is None else float(grace_s)

        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("Preemption needs at least one signal (default: SIGTERM)")
        self.rank, self.world_size = resolve_rank(rank, world_size)
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "Preemption installs signal handlers, which Python allows only in the main "
                "thread: make it there (before the training loop) and pass it to the thread "
                "that trains"
            )
        #: the first signal received (None: none yet) and when (time.time())
        self.signal: signal.Signals | None = None
        self.received_at: float | None = None
        self._agreed = False
        #: when check() first said stop (time.time()): the grace of a rank that got no signal
        self._agreed_at: float | None = None
        self._flag: Any = None  # the all-reduce's one-element tensor, made at the first check
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    @property
    def requested(self) -> bool:
        """Whether this process got one of the signals (no collective; see :meth:`check`)."""
        return self.signal is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.signal is None:
            self.signal, self.received_at = sig, time.time()
            return  # logged by check(): nothing but the flag here, in the middle of any code
        # asked again: end as without this handler
        previous = self._previous.get(sig, signal.SIG_DFL)
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            signal.raise_signal(sig)

    def check(self) -> bool:
        """Whether the job is asked to stop: True on every rank once any rank got a signal.

        With several ranks this is a collective: every rank must call it at the same points
        (once per step, after the same step). Stays True once it was."""
        if self._agreed:
            return True
        asked = self.signal is not None
        if self.world_size > 1:
            asked = self._any_rank(asked)
        if asked:
            self._agreed = True
            self._agreed_at = time.time()
            self._say()
        return asked

    def time_left(self, reserve_s: float = 2.0) -> float | None:
        """Seconds left of ``grace_s`` since the signal (on a rank that got none: since
        :meth:`check` said stop), less ``reserve_s`` for the process to exit; at least 0.
        None without ``grace_s`` or before a stop was asked: then wait without a bound.
        Made for ``ck.close(timeout=stop.time_left())``."""
        start = self.received_at if self.received_at is not None else self._agreed_at
        if self.grace_s is None or start is None:
            return None
        return max(0.0, self.grace_s - (time.time() - start) - reserve_s)

    def _any_rank(self, mine: bool) -> bool:
        """One all-reduce (MAX) of ``mine`` over the default process group."""
        import torch.distributed as dist

        if self._flag is None:
            import torch

            from tierckpt.distributed._collectives import collective_device

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    "Preemption.check() with world_size > 1 needs an initialized "
                    "torch.distributed process group (every rank calls it at the same step)"
                )
            self._flag = torch.zeros(1, dtype=torch.int32, device=collective_device())
        self._flag.fill_(int(mine))
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX)
        return bool(self._flag.item())

    def _say(self) -> None:
        if self.signal is not None:
            log.warning(
                "rank %d: %s received %.1f s ago: stopping at this step (%s again ends the "
                "process at once)",
                self.rank,
                self.signal.name,
                time.time() - (self.received_at or time.time()),
                self.signal.name,
            )
        else:
            log.warning("rank %d: another rank was asked to stop: stopping at this step", self.rank)

    def close(self) -> None:
        """Put the previous handlers back (where this one is still installed)."""
        if threading.current_thread() is not threading.main_thread():
            return  # the interpreter's own teardown runs in the main thread
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
