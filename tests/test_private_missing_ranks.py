"""On a private tier rank 0's commit timeout names the ranks whose records are missing, not
every rank of their node: of its own node it sees which ranks published into the node's
store. Real processes with gloo (``dist_workers``); the worker function is in this module."""

from __future__ import annotations

import os
import time
from typing import Any

import dist_workers
import pytest
import torch.distributed as dist

from tierckpt import Checkpointer, MemoryTier
from tierckpt import distributed as tdist
from tierckpt.errors import CheckpointFailed


def w_last_rank_skips(rank: int, world: int, rank0_late_s: float = 0.0) -> dict[str, Any]:
    """Every rank on one node; the last rank does not save step 2 (a bug in the caller).
    ``rank0_late_s``: rank 0 starts its save of step 2 that much after the others (a busy
    node), so its commit's wait ends that much later than theirs would."""
    os.environ["TIERCKPT_NODE"] = "one-node"
    out: dict[str, Any] = {"error": None}
    with tdist.knobs(commit_timeout=4, poll_max=0.2):
        ck = Checkpointer([MemoryTier(namespace=f"mem-{os.getpid()}", keep_last=None)])
        ck.save({"step": 1}, 1).wait(timeout=60)
        if rank != world - 1:
            if rank == 0:
                time.sleep(rank0_late_s)
            try:
                ck.save({"step": 2}, 2).wait(timeout=60)
            except CheckpointFailed as exc:
                out["error"] = str(exc)
        dist.barrier()
        ck.close()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("rank0_late_s", [0.0, 2.0])
def test_the_commit_timeout_names_only_the_missing_rank_of_rank_0s_node(
    rank0_late_s: float,
) -> None:
    """Rank 1 waits for rank 0's word (through its node's leader): it hears rank 0's verdict
    even where rank 0's commit started seconds after its own (CI saw rank 1 time out first,
    with "the node's leader published no manifest in time", which names nobody)."""
    res = dist_workers.run(
        "test_private_missing_ranks:w_last_rank_skips", 3, timeout=120, rank0_late_s=rank0_late_s
    )
    assert "none from ranks 2 (of 3)" in res[0]["error"], res[0]
    assert "none from ranks 2 (of 3)" in res[1]["error"], res[1]  # rank 0's word, passed on
