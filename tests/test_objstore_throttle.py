"""A store that throttles for a moment (S3's 503 SlowDown) does not fail a new node's restore.

The object-store backend retries a request up to ``max_attempts`` (4) times. Its backoff
after a failure was 0-0.1, 0-0.2, 0-0.4 s: all four attempts fitted in 0.7 s, so a store that
answered SlowDown for one second failed the restore of a node starting afresh (the listing
gave ``TiersUnreadable``). After a throttling answer the backoff is now 0.25-0.5, 0.5-1 and
1-2 s: the fourth attempt comes at least 1.75 s after the first.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.testing.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3


def test_a_restore_rides_out_a_second_of_slowdown(
    tmp_path: Path, moto_server: Any, s3_bucket: Any
) -> None:
    bucket = s3_bucket(moto_server)
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with FaultProxy(moto_server.endpoint_url) as proxy:
        url, endpoint = f"s3://{bucket}/run", proxy.endpoint_url
        with Checkpointer([S3Tier(url, endpoint_url=endpoint)]) as ck:
            ck.save(state, 5).wait(timeout=60)
        proxy.set_faults([Fault("slowdown")])  # every request, until cleared
        timer = threading.Timer(1.0, proxy.set_faults, args=([],))
        timer.start()
        try:
            with Checkpointer(
                [LocalTier(tmp_path / "new-node"), S3Tier(url, endpoint_url=endpoint)]
            ) as ck:
                got = ck.load()
        finally:
            timer.cancel()
        assert proxy.fired["slowdown"] >= 1  # the store did throttle the restore
    assert torch.equal(got["w"], state["w"])
