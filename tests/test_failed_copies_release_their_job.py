"""A save whose copy failed on one tier is not kept in memory by the checkpointer.

The commit statistics keep the last ``stats_history`` (1,000) commits, and kept each save's
handle; a handle keeps its tiers' errors, and an error's traceback kept the frames that
held the whole save job (its plan, encoded tree and chunk records: ~350 KB a save of 1,000
tensors). While a tier failed (an S3 outage behind the local tier) or skipped copies (a
follower tier), every such save stayed alive: +210 MB over 600 saves in a field test. Now
the statistics hold the handle weakly, and a handle's errors keep no frame's locals.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.pipeline import SaveJob


class _Broken(LocalBackend):
    def open_writer(self, name: str) -> Any:
        if "/steps/" in f"/{name}":
            raise OSError(5, "I/O error (injected)")
        return super().open_writer(name)


class _BrokenTier(LocalTier):
    def make_backend(self) -> LocalBackend:
        return _Broken(self.path)


def _jobs() -> int:
    """Save jobs alive, once the pipeline's threads had a moment to drop the last ones."""
    for _ in range(50):
        gc.collect()
        n = sum(1 for o in gc.get_objects() if type(o) is SaveJob)
        if n <= 1:
            break
        time.sleep(0.1)
    return n


def test_saves_that_failed_on_one_tier_are_not_kept(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(200)}
    tiers = [LocalTier(tmp_path / "ok", keep_last=2), _BrokenTier(tmp_path / "bad", name="bad")]
    with Checkpointer(tiers) as ck:
        for step in range(1, 41):
            ck.save(state, step).wait_captured()
        ck.wait()  # errors stay on the handles, which nothing here keeps
        counts = ck.tier_counts()
        assert counts["bad"]["failed"] == 40 and counts["local"]["committed"] == 40, counts
        assert len(ck.stats()) == 40  # the statistics still say what happened
        # the last ones may still be referenced by the pipeline's threads (before: all 40)
        assert _jobs() <= 3, _jobs()
