"""The torch.save habit under DDP: only rank 0 saves (the model is replicated). A
checkpointer of the process group would have rank 0 wait in the first save's all-reduce for
ranks that never call it; given ``rank=0, world_size=1`` it is a one-process writer on rank 0,
and every rank loads that checkpoint the same way (docs/faq.md). Real processes with gloo."""

from __future__ import annotations

import logging
import time
from typing import Any

import dist_workers
import pytest
import torch
import torch.distributed as dist

from tierckpt import Checkpointer, LocalTier
from tierckpt import distributed as tdist
from tierckpt.distributed import _collectives


def w_rank0_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    torch.manual_seed(0)  # a replicated model: the same weights on every rank
    model = torch.nn.Linear(64, 64)
    ck = Checkpointer([LocalTier(root)], rank=0, world_size=1)
    if rank == 0:
        for step in (1, 2):
            ck.save({"model": model.state_dict(), "step": step}, step).wait(timeout=60)
    dist.barrier()  # the training loop's next collective: no rank waits in tierckpt's
    got = ck.load()
    ck.close()
    return {
        "step": got["step"],
        "same": all(torch.equal(got["model"][k], v) for k, v in model.state_dict().items()),
    }


@pytest.mark.distributed
def test_only_rank_0_saves_and_every_rank_loads(tmp_path: Any) -> None:
    res = dist_workers.run("test_rank0_only:w_rank0_saves", 3, timeout=120, root=str(tmp_path))
    assert res == [{"step": 2, "same": True}] * 3


def w_late_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1 comes to the first save and to the load 2.5 s late, with a patience of 1 s: rank
    0 says what it waits for (the hang of a rank-0-only save or load says the same, after
    30 s), then both save, and load."""
    _collectives.PATIENCE_S = 1.0
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logging.getLogger("tierckpt").addHandler(Keep(logging.WARNING))
    ck = Checkpointer([LocalTier(root)])
    if rank == 1:
        time.sleep(2.5)
    ck.save({"w": torch.ones(4) * rank}, 1).wait(timeout=60)
    tdist.wait_committed(ck.backend("local"), 1, timeout=60)
    if rank == 1:
        time.sleep(2.5)
    got = ck.load()
    ck.close()
    return {
        "waited": [m for m in said if "in save()" in m],
        "waited_load": [m for m in said if "in load()" in m],
        "loaded": got["w"].tolist(),
    }


@pytest.mark.distributed
def test_a_rank_alone_in_the_first_save_says_what_it_waits_for(tmp_path: Any) -> None:
    res = dist_workers.run("test_rank0_only:w_late_rank", 2, timeout=120, root=str(tmp_path))
    assert len(res[0]["waited"]) == 1 and len(res[0]["waited_load"]) == 1, res
    assert "rank=0, world_size=1" in res[0]["waited"][0]
    assert res[1]["waited"] == res[1]["waited_load"] == []
    assert [r["loaded"] for r in res] == [[0.0] * 4, [1.0] * 4]
