"""Retention across ranks: a leftover that one rank's failed save leaves in a tier all ranks
share is swept by the rank that applies retention there (rank 0), which hears of the failure
through the joint commit, not by the rank that failed (it never collects a shared tier)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dist_workers
import pytest


@pytest.fixture
def s3(moto_server: Any, s3_bucket: Callable[[Any], str]) -> dict[str, str]:
    return {"bucket": s3_bucket(moto_server), "endpoint": moto_server.endpoint_url}


@pytest.mark.distributed
@pytest.mark.s3
def test_a_ranks_stranded_upload_is_swept_by_rank_0(s3: dict[str, str]) -> None:
    res = dist_workers.run(
        "retention_dist_workers:w_stranded_upload", 2, s3=s3, victim=1, timeout=240
    )
    r0, r1 = res
    assert r1["error2"] == ["ConnectionResetError"], r1
    assert r0["error2"] == ["RankFailed"], r0
    # the victim's upload of step 2 was left behind (its abort failed) ...
    assert any("rank-000001" in u or "rank-1" in u for u in r0["left_after_2"]), r0
    # ... and is gone once step 3 committed and rank 0 applied retention
    for r in res:
        assert r["left_after_3"] == [], r
        assert r["steps"] == [1, 3] and r["diff3"] == [], r
