"""Workers of tests/test_damaged_newest.py (launched by ``dist_workers.run``)."""

from __future__ import annotations

from typing import Any

import torch

from tierckpt import Checkpointer, LocalTier


def w_damaged_newest(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``save``: steps 1 and 2 on every rank. ``load``: what ``load()`` raises, then what
    ``load(fallback="previous")`` returns (the test damaged rank 1's shard of step 2 between)."""
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        if phase == "save":
            for step in (1, 2):
                ck.save({"w": torch.full((256,), float(10 * rank + step)), "step": step}, step)
            ck.wait()
            return {}
        out: dict[str, Any] = {}
        try:
            ck.load()
        except Exception as exc:
            out["error"] = type(exc).__name__
            out["says"] = str(exc)
        got = ck.load(fallback="previous")
        out["previous"] = [int(got["step"]), float(got["w"][0])]
        return out
