"""Per-rank functions for tests/test_private_commit.py (run by ``dist_workers.run`` as
``"private_commit_workers:<name>"``): the private-tier commit through node stores, on
simulated nodes (``TIERCKPT_NODE`` per rank)."""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same, w_fail_save

from tierckpt import Checkpointer, MemoryTier
from tierckpt import distributed as tdist
from tierckpt.distributed import _private, _strategy
from tierckpt.errors import CheckpointFailed


class _Counting:
    """A store client that counts the calls made on it (rank 0's store, seen by this rank)."""

    def __init__(self, store: Any, calls: Counter[str], checked: list[int]) -> None:
        self._store = store
        self._calls = calls
        self._checked = checked

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self._calls[name] += 1
            if name == "check":
                self._checked.append(len(args[0]))
            return real(*args, **kwargs)

        return call


def _count_global_store_calls() -> tuple[Counter[str], list[int]]:
    """From now on, count this process's calls on rank 0's store (the default group's, as
    the private-tier commit gets it from ``_private._store``)."""
    calls: Counter[str] = Counter()
    checked: list[int] = []
    real = _private._store
    wrapped: dict[int, _Counting] = {}

    def counting() -> Any:
        st = real()
        if id(st) not in wrapped:
            wrapped[id(st)] = _Counting(st, calls, checked)
        return wrapped[id(st)]

    _private._store = counting  # type: ignore[assignment]
    return calls, checked


def w_private_store_ops(rank: int, world: int, per_node: int) -> dict[str, Any]:
    """Save steps 1 and 2 to a RAM tier; count this rank's calls on rank 0's store during
    step 2 (step 1 made the node stores); every rank loads step 2 back."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank // per_node}"
    calls, checked = _count_global_store_calls()
    with (
        tdist.knobs(commit_timeout=60, poll_max=0.2),
        Checkpointer(
            [MemoryTier(namespace=f"mem-{os.getpid()}", keep_last=None)],
            host_buffer_bytes=16 << 20,
            chunk_bytes=64 << 10,
        ) as ck,
    ):
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        dist.barrier()
        calls.clear()
        checked.clear()
        ck.save(rank_state(rank, 2), 2).wait(timeout=60)
        dist.barrier()
        out = {"calls": dict(calls), "checked": sorted(set(checked)), "steps": ck.steps()}
        out["diff"] = same(ck.load(), rank_state(rank, 2))
    return out


def w_private_fail_on_node(rank: int, world: int, root: str, victim: int, per_node: int) -> Any:
    """``dist_workers.w_fail_save`` (RAM and a shared local tier; the victim's storage fails
    at step 2) on simulated nodes of ``per_node`` ranks."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank // per_node}"
    return w_fail_save(rank, world, root, victim)


def w_private_kill(rank: int, world: int, root: str, victim: int, per_node: int) -> dict[str, Any]:
    """Step 1 commits on a RAM tier; at step 2 the victim dies (SIGKILL) as it is about to
    publish its record: no rank commits step 2, and each says why. The survivors stay until
    all of them have their answer (rank 0's process hosts the process group's store and node
    0's, as in a job, where rank 0 trains on)."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank // per_node}"
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=4, poll_max=0.2):
        ck = Checkpointer(
            [MemoryTier(namespace=f"mem-{os.getpid()}", keep_last=None)],
            host_buffer_bytes=16 << 20,
            chunk_bytes=64 << 10,
        )
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        dist.barrier()
        if rank == victim:

            def die(*_a: Any, **_k: Any) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            _strategy._publish_private = die  # type: ignore[assignment]
        h = ck.save(rank_state(rank, 2), 2)
        try:
            h.wait(timeout=60)
            out["error"] = None
        except CheckpointFailed as exc:
            out["error"] = str(exc)
            out["error_types"] = {t: type(e).__name__ for t, e in exc.errors.items()}
        out["steps"] = ck.steps()
    Path(root, f"done-{rank}").touch()
    deadline = time.monotonic() + 90
    while len(list(Path(root).glob("done-*"))) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return out
