"""A store that answers the listing and the manifest but never the shard file's GETs: a load
asks for the file at most ``max_attempts`` times and fails after about ``max_attempts x
read_timeout`` (docs/object-stores.md), not that many attempts squared.

Before, the shard's suffix read, once it timed out after its attempts, fell back to a HEAD and
a ranged read (meant for stores that answer a suffix range oddly), and that ranged read was
retried both in Python and inside object_store: 2 + 3 + 2 GETs with ``max_attempts=2`` (14 s
for a 4 s bound), about 317 s with the defaults (15 s x 4)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.errors import TierCkptError
from tierckpt.testing.faultproxy import Fault, FaultProxy


def test_a_load_asks_a_stalled_shard_at_most_max_attempts_times(
    moto_server: Any, s3_bucket: Any
) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url, timeout=120) as proxy:

        def tier() -> S3Tier:
            return S3Tier(
                f"s3://{bucket}/run",
                endpoint_url=proxy.endpoint_url,
                read_timeout=1,
                max_attempts=2,
            )

        with Checkpointer([tier()]) as ck:
            ck.save({"w": torch.arange(1 << 16, dtype=torch.float32)}, 1).wait()
        proxy.set_faults([Fault("stall", method="GET", path_contains=".tck", seconds=600)])
        with Checkpointer([tier()]) as ck:
            start = time.monotonic()
            with pytest.raises(TierCkptError, match="rank-000000.tck"):
                ck.load()
            took = time.monotonic() - start
            proxy.set_faults([])
        asked = [r for r in proxy.requests if ".tck" in r.target and r.method in ("GET", "HEAD")]
        assert len(asked) <= 2, [f"{r.method} {r.target}" for r in asked]
        assert took < 30, took  # 2 x 1 s of timeouts plus backoff; it was 7 requests
