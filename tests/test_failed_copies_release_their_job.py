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
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is SaveJob)


def test_saves_that_failed_on_one_tier_are_not_kept(tmp_path: Path) -> None:
    state = {f"t{i}": torch.full((64,), float(i)) for i in range(200)}
    tiers = [LocalTier(tmp_path / "ok", keep_last=2), _BrokenTier(tmp_path / "bad", name="bad")]
    with Checkpointer(tiers) as ck:
        for step in range(1, 31):
            ck.save(state, step).wait_captured()
        ck.wait()  # errors stay on the handles, which nothing here keeps
        counts = ck.tier_counts()
        assert counts["bad"]["failed"] == 30 and counts["local"]["committed"] == 30, counts
        assert len(ck.stats()) == 30  # the statistics still say what happened
        assert _jobs() <= 1, _jobs()  # at most the last one, still referenced by the pipeline
