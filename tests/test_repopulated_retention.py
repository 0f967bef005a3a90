"""A process that only loads (an evaluator with a local cache tier in front of S3) copies each
checkpoint it loads onto the local tier (``repopulate``), where it commits. Its saves would
apply the local tier's ``keep_last`` after their commits, but it never saves: the local folder
kept every checkpoint it ever loaded (148 after 150 loads in the field), until the disk filled.
Now a load applies the rules of the tiers its copies committed on, unless a live writer holds
that tier (its own retention runs after its next commit)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, LocalTier, S3Tier


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((2048,), float(step)), "step": step}


def test_an_evaluators_local_cache_keeps_only_its_keep_last(
    tmp_path: Path, moto_server: Any, s3_bucket: Callable[[Any], str]
) -> None:
    url = f"s3://{s3_bucket(moto_server)}/run"
    cache = tmp_path / "eval-cache"

    def s3(**kw: Any) -> S3Tier:
        return S3Tier(url, endpoint_url=moto_server.endpoint_url, **kw)

    with Checkpointer([s3(keep_last=None)]) as trainer:
        for step in range(1, 7):
            trainer.save(_state(step), step).wait()
            with Checkpointer([LocalTier(cache, keep_last=2), s3()]) as evaluator:
                assert evaluator.load()["step"] == step
                assert evaluator.steps(tier="s3")[-1] == step
        with Checkpointer([LocalTier(cache, keep_last=2), s3()]) as evaluator:
            assert evaluator.steps(tier="local") == [5, 6]
            # an older step loaded explicitly is copied, and kept while it is the loaded one
            assert evaluator.load(2)["step"] == 2
            assert evaluator.steps(tier="local") == [2, 5, 6]
            assert evaluator.load(3)["step"] == 3  # the next load's rules remove step 2
            assert evaluator.steps(tier="local") == [3, 5, 6]


def test_a_cache_a_live_writer_holds_is_left_to_its_retention(
    tmp_path: Path, moto_server: Any, s3_bucket: Callable[[Any], str]
) -> None:
    url = f"s3://{s3_bucket(moto_server)}/run"
    folder = tmp_path / "shared"
    s3 = S3Tier(url, endpoint_url=moto_server.endpoint_url, keep_last=None)
    with Checkpointer([s3]) as other:
        for step in range(1, 5):
            other.save(_state(step), step).wait()
    # a live job writes the local folder (keep_last=None there): its checkpoints are its own
    with Checkpointer([LocalTier(folder, keep_last=None)]) as live:
        live.save(_state(10), 10).wait()
        live.save(_state(11), 11).wait()
        with Checkpointer(
            [LocalTier(folder, keep_last=1), S3Tier(url, endpoint_url=moto_server.endpoint_url)]
        ) as reader:
            assert reader.load(3, tier=None)["step"] == 3
            assert reader.steps(tier="local") == [3, 10, 11]  # nothing of the live job's gone
