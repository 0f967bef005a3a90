"""The load agreement reads the newest candidate's manifest alone when every rank can read
it: with ``fallback="previous"`` a load has several candidates, and reading every one of
their manifests (per node) costs S3 GETs a usual restart never needs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import dist_workers
import pytest

from tierckpt.bench.scale import classify
from tierckpt.testing.faultproxy import FaultProxy
from tierckpt.testing.s3servers import S3Server


@pytest.mark.distributed
@pytest.mark.s3
def test_agreement_reads_only_the_newest_manifest_once_per_node(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    """4 gloo ranks on 2 simulated nodes, 3 committed steps, ``load(fallback="previous")``:
    the manifest is read twice in all (once per node, the newest's), not once per candidate
    and node (6)."""
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        s3 = {"bucket": bucket, "endpoint": proxy.endpoint_url}
        res = dist_workers.run("w_agree_lineage", 4, s3=s3, per_node=2, timeout=180)
        seen = [classify(rec, bucket) for rec in proxy.requests]
    assert all(r["diff"] == [] and r["steps"] == [1, 2, 3] for r in res)
    manifest_gets = [rel for kind, top, rel in seen if kind == "GET" and top == "manifests"]
    assert len(manifest_gets) == 2, manifest_gets
    assert all("000000000003" in rel for rel in manifest_gets), manifest_gets


@pytest.mark.distributed
def test_ranks_whose_newest_readable_differ_agree_on_the_newest_common(tmp_path: Path) -> None:
    """Rank 1's shard of the newest step is gone: the first round of the agreement sees the
    ranks differ (2 and 1), the second finds step 1, the newest both can read."""
    res = dist_workers.run("w_agree_older", 2, root=str(tmp_path / "ck"), timeout=120)
    assert [r["diff"] for r in res] == [[], []]
