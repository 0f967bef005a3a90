"""Per-rank functions of ``test_double_save.py``, run by :func:`dist_workers.run` as
``"double_save_workers:<function>"``: a step saved twice by every rank of a job."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import rank_state, same

from tierckpt import Checkpointer, LocalTier, MemoryTier
from tierckpt import distributed as tdist
from tierckpt.backends import local as local_backend
from tierckpt.backends.local import LocalBackend
from tierckpt.format import shard_name


def _slow_step_writes(step: int, seconds: float) -> None:
    """This rank's shard writes of ``step`` each take ``seconds`` longer (a slow disk)."""
    real = local_backend._LocalWriter.write
    marker = f"/{step:012d}/"

    def write(self: Any, offset: int, data: Any) -> None:
        if marker in f"/{self.name}":
            time.sleep(seconds)
        real(self, offset, data)

    local_backend._LocalWriter.write = write  # type: ignore[method-assign]


def _outcome(fn: Any) -> str:
    try:
        fn()
    except Exception as exc:  # what the caller sees, by type and message
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def _files(root: str, step: int) -> dict[str, float]:
    """Every shard file of ``step`` under ``root``, with its modification time."""
    return {
        str(p.relative_to(root)): p.stat().st_mtime
        for p in sorted(Path(root).rglob("rank-*.tck"))
        if f"{step:012d}" in str(p)
    }


def w_save_twice(
    rank: int, world: int, root: str, when: str, memory: bool = False
) -> dict[str, Any]:
    """Steps 5 and 10 saved; then step 10 again with other values, on every rank:
    ``when="committed"``: after ``ck.wait()`` (rank 0's commit is slow, so that the other ranks
    come back first: their wait means only that their shard is durable); ``when="in_flight"``:
    0.3 s later, while rank 0's slow disk is still writing its first save of step 10.
    ``memory``: a private RAM tier before the shared local one."""
    out: dict[str, Any] = {}
    tiers: list[Any] = [LocalTier(root, keep_last=None)]
    if memory:
        tiers.insert(0, MemoryTier(namespace=f"double-{rank}"))
    if rank == 0:
        _slow_step_writes(10, 0.7 if when == "committed" else 2.0)
    with tdist.knobs(commit_timeout=60, poll_max=0.05):
        ck = Checkpointer(tiers)
        ck.save(rank_state(rank, 5), 5).wait(timeout=60)
        first = ck.save(rank_state(rank, 10), 10)
        if when == "committed":
            ck.wait()
        else:
            time.sleep(0.3)
        before = _files(root, 10)
        other = rank_state(rank, 10)
        other["w"] = torch.full_like(other["w"], 9999.0 + rank)
        other["extra"] = torch.ones(3)

        def save_again() -> None:
            ck.save(other, 10).wait(timeout=60)

        out["second"] = _outcome(save_again)
        out["first"] = _outcome(lambda: first.wait(timeout=60))
        ck.wait()
        dist.barrier()  # every rank's saves are over
        # the shard files there were before the second save (this rank's own, at least)
        out["replaced"] = sorted(n for n, t in _files(root, 10).items() if before.get(n, t) != t)
        out["steps"] = ck.steps()
        ck.close()
        # the checkpoint as the next job finds it on the shared tier
        with Checkpointer([LocalTier(root, keep_last=None)]) as fresh:
            out["loaded_diff"] = same(fresh.load(), rank_state(rank, 10))
    return out


def w_retry_after_a_failure(rank: int, world: int, root: str, victim: int) -> dict[str, Any]:
    """Step 1 commits; ``victim``'s shard of step 2 fails (disk full), so step 2 is committed
    nowhere although the other ranks' shards are durable; every rank saves step 2 again (a
    retry, other values) and it commits; then step 2 a third time is refused everywhere."""
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=60, poll_max=0.05):
        ck = Checkpointer([LocalTier(root, keep_last=None)])
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        backend: LocalBackend = ck.backend("local")
        real_open = backend.open_writer
        if rank == victim:

            def full(name: str) -> Any:
                if name == shard_name(2, rank):
                    raise OSError(28, "No space left on device")
                return real_open(name)

            backend.open_writer = full  # type: ignore[method-assign]
        out["first"] = _outcome(lambda: ck.save(rank_state(rank, 2), 2).wait(timeout=60))
        ck.wait()
        backend.open_writer = real_open  # type: ignore[method-assign]
        dist.barrier()
        retry = rank_state(rank, 102)
        out["retry"] = _outcome(lambda: ck.save(retry, 2).wait(timeout=60))
        tdist.wait_committed(backend, 2, timeout=60)
        out["third"] = _outcome(lambda: ck.save(rank_state(rank, 202), 2).wait(timeout=60))
        ck.wait()
        dist.barrier()
        out["loaded_diff"] = same(ck.load(), retry)
        out["steps"] = ck.steps()
        ck.close()
    return out
