"""Tuning of the multi-rank commit: :class:`DistKnobs`, their environment overrides
(:func:`get_knobs`) and a context manager for tests (:func:`knobs`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tierckpt import config

__all__ = ["DistKnobs", "get_knobs", "knobs"]


@dataclass(frozen=True, slots=True)
class DistKnobs:
    """Tuning of the multi-rank commit; see :func:`get_knobs`."""

    #: how long rank 0 waits for every rank's record before failing the tier's save
    commit_timeout: float = config.DEFAULT_COMMIT_TIMEOUT_S
    #: first and largest pause between two polls (the pause doubles up to the largest)
    poll_initial: float = 0.05
    poll_max: float = config.DEFAULT_COMMIT_POLL_MAX_S
    #: at most this many missing records: GET each by name; more: one LIST of the step folder
    direct_probe_max: int = 16
    #: records GET in parallel by rank 0 when many arrive at once
    record_readers: int = 16
    #: how many candidate steps each rank offers to the load agreement
    agree_max_candidates: int = 32


_knobs_override: DistKnobs | None = None


def get_knobs() -> DistKnobs:
    """The knobs in force: :func:`knobs` overrides, then the environment, then defaults."""
    if _knobs_override is not None:
        return _knobs_override
    k = DistKnobs()
    env_timeout = config.commit_timeout_s()
    env_poll = config.commit_poll_max_s()
    if env_timeout is not None:
        k = dataclasses.replace(k, commit_timeout=env_timeout)
    if env_poll is not None:
        k = dataclasses.replace(k, poll_max=env_poll)
    return k


@contextlib.contextmanager
def knobs(**changes: Any) -> Iterator[DistKnobs]:
    """Override knobs in this process for the duration of a ``with`` block (tests)."""
    global _knobs_override
    old = _knobs_override
    _knobs_override = dataclasses.replace(get_knobs(), **changes)
    try:
        yield _knobs_override
    finally:
        _knobs_override = old
