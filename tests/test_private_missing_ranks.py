"""On a private tier rank 0's commit timeout names the ranks whose records are missing, not
every rank of their node: of its own node it sees which ranks published into the node's
store. Real processes with gloo (``dist_workers``); the worker function is in this module."""

from __future__ import annotations

import os
from typing import Any

import dist_workers
import pytest
import torch.distributed as dist

from tierckpt import Checkpointer, MemoryTier
from tierckpt import distributed as tdist
from tierckpt.errors import CheckpointFailed


def w_last_rank_skips(rank: int, world: int) -> dict[str, Any]:
    """Every rank on one node; the last rank does not save step 2 (a bug in the caller)."""
    os.environ["TIERCKPT_NODE"] = "one-node"
    out: dict[str, Any] = {"error": None}
    with tdist.knobs(commit_timeout=4, poll_max=0.2):
        ck = Checkpointer([MemoryTier(namespace=f"mem-{os.getpid()}", keep_last=None)])
        ck.save({"step": 1}, 1).wait(timeout=60)
        if rank != world - 1:
            try:
                ck.save({"step": 2}, 2).wait(timeout=60)
            except CheckpointFailed as exc:
                out["error"] = str(exc)
        dist.barrier()
        ck.close()
    return out


@pytest.mark.distributed
def test_the_commit_timeout_names_only_the_missing_rank_of_rank_0s_node() -> None:
    res = dist_workers.run("test_private_missing_ranks:w_last_rank_skips", 3, timeout=120)
    assert "none from ranks 2 (of 3)" in res[0]["error"], res[0]
    assert "none from ranks 2 (of 3)" in res[1]["error"], res[1]  # rank 0's word, passed on
