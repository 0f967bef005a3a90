"""Per-rank functions of ``test_dcp_overlap.py``: ``dcp.async_save`` calls that overlap on one
reused ``TierWriter`` (launched by ``dist_workers.run("dcp_overlap_workers:<fn>", world)``)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tierckpt import LocalTier
from tierckpt.dcp import TierReader, TierWriter


def _state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s state at ``step``: its own tensor, and one every rank has (DCP saves
    rank 0's)."""
    return {f"r{rank}": torch.full((1000,), float(step * 10 + rank)), "step": torch.tensor(step)}


class _Late(DefaultSavePlanner):
    """Plans this rank's part only once ``go`` is set: the save's reset() has run, and the
    other save (begun after it) runs its reset and its plan meanwhile."""

    def __init__(self, go: threading.Event) -> None:
        super().__init__()
        self.go = go

    def create_local_plan(self) -> Any:
        self.go.wait(30)
        return super().create_local_plan()


class _Signal(DefaultSavePlanner):
    """Sets ``done`` once this rank's plan of its save is made."""

    def __init__(self, done: threading.Event) -> None:
        super().__init__()
        self.done = done

    def create_local_plan(self) -> Any:
        plan = super().create_local_plan()
        time.sleep(0.2)  # into the coordinator's global plan, on the other save's group
        self.done.set()
        return plan


def w_overlap(rank: int, world: int, root: str, same_step: bool = False) -> dict[str, Any]:
    """Steps 1 and 2 (or 1 twice) with ``dcp.async_save`` through one writer, each on its own
    process group, the second begun before the first is done; step 1 plans only after step 2
    has planned (its reset() came first), on every rank: what each save's future says, and
    what a load of each step reads."""
    tiers = [LocalTier(os.path.join(root, "ck"))]
    writer = TierWriter(tiers)
    pgs = [dist.new_group(backend="gloo"), dist.new_group(backend="gloo")]
    second = 1 if same_step else 2
    go = threading.Event()
    f1 = dcp.async_save(
        _state(rank, 1),
        storage_writer=writer,
        checkpoint_id=1,
        process_group=pgs[0],
        planner=_Late(go),
    )
    time.sleep(0.3)  # the first save's reset() runs before the second's
    f2 = dcp.async_save(
        _state(rank, second) if not same_step else _state(rank, 101),
        storage_writer=writer,
        checkpoint_id=second,
        process_group=pgs[1],
        planner=_Signal(go),
    )
    out: dict[str, Any] = {}
    for name, fut in (("save1", f1), ("save2", f2)):
        try:
            fut.result(timeout=120)
            out[name] = "ok"
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            out[name] = f"{type(exc).__name__}: {exc}"[-600:]
    writer.close()
    dist.barrier()
    for step in sorted({1, second}):
        target = {f"r{rank}": torch.zeros(1000), "step": torch.tensor(-1)}
        reader = TierReader(tiers, step)
        try:
            dcp.load(target, storage_reader=reader)
            out[f"load{step}"] = {
                "x0": float(target[f"r{rank}"][0]),
                "step": int(target["step"]),
                "id": str(reader.loaded_id),
            }
        except BaseException as exc:
            out[f"load{step}"] = f"{type(exc).__name__}: {exc}"[-600:]
    return out
