"""What retention after a save sends to an object store (a real S3 server on 127.0.0.1 behind
the counting proxy): the leftovers of killed writers are swept once, at this writer's first
retention on the tier, and again only after one of its own saves there failed; otherwise a
pass lists what its rules need (the manifests, the pins and the objects only when a checkpoint
goes) and never the unfinished multipart uploads. With ``keep_last=None`` a steady save sends
no listing at all."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.s3 import S3Backend
from tierckpt.format import CheckpointId, shard_name
from tierckpt.retention import gc_tier, note_failed_save
from tierckpt.testing.faultproxy import FaultProxy, RequestRecord
from tierckpt.testing.s3servers import S3Server

ROOT = Path(__file__).resolve().parents[1]


def _kind(rec: RequestRecord) -> str:
    """``list``: a listing of objects; ``uploads``: a listing of unfinished multipart uploads;
    ``DELETE``: a delete (one object or a batch); else the method."""
    query = urlsplit(rec.target).query
    params = {p.split("=", 1)[0] for p in query.split("&") if p}
    if rec.method == "GET" and "uploads" in params:
        return "uploads"
    if rec.method == "GET" and ("list-type" in params or "prefix" in params):
        return "list"
    if rec.method == "POST" and "delete" in params:
        return "DELETE"  # obstore deletes through the batch call
    return rec.method


def _per_save(
    proxy: FaultProxy, bucket: str, driver: str, keep_last: int | None, steps: range
) -> list[dict[str, int]]:
    """The listings each save (its commit and retention: ``wait(retention=True)`` covers
    both) sent."""
    tier = S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=proxy.endpoint_url,
        codec="raw",
        keep_last=keep_last,
        driver=driver,
    )
    out = []
    with Checkpointer([tier], chunk_bytes=1 << 20) as ck:
        for s in steps:
            before = len(proxy.requests)
            ck.save({"w": torch.full((20_000,), float(s))}, s).wait(timeout=120)
            ck.wait(timeout=120, retention=True)
            kinds = [_kind(r) for r in list(proxy.requests)[before:]]
            out.append({k: kinds.count(k) for k in ("list", "uploads", "DELETE")})
    return out


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_steady_saves_with_keep_last_list_no_unfinished_uploads(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], driver: str
) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        counts = _per_save(proxy, bucket, driver, 2, range(1, 7))
    # the first pass sweeps (leftovers of writers killed before this one): uploads listed
    assert counts[0]["uploads"] >= 1, counts
    for c in counts[1:]:
        # before: 5 listings of unfinished uploads and about 4 of objects per save
        assert c["uploads"] == 0, counts
        assert c["list"] <= 3, counts  # manifests, pins, the objects of the one that goes
    # from step 3 on each save retires one checkpoint: its manifest and shard go
    assert all(c["DELETE"] >= 2 for c in counts[2:]), counts


def test_steady_saves_keeping_everything_list_nothing(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        counts = _per_save(proxy, bucket, "obstore", None, range(1, 5))
    # a rule that removes nothing: the first pass sweeps killed writers' leftovers (unfinished
    # uploads included: billed storage nothing else would remove), later passes list nothing
    assert counts[0]["uploads"] >= 1, counts
    assert sum(c["uploads"] for c in counts[1:]) == 0, counts
    assert all(c["list"] == 0 and c["DELETE"] == 0 for c in counts[1:]), counts


def _upload(server: S3Server, bucket: str, step: int) -> str:
    """An unfinished multipart upload of ``step``'s shard (a killed or failed writer's)."""
    key = f"run/{shard_name(step, 0)}"
    c = server.admin
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * 1024)
    return key


def _open_uploads(server: S3Server, bucket: str) -> list[str]:
    got = server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    return sorted(str(u["Key"]) for u in got)


def test_a_failed_save_makes_the_next_pass_sweep_again(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    """The pipeline's pass (``sweep=None``) sweeps at its first run; a leftover that appears
    later (this process's failed save whose abort failed) is swept once the failure is noted."""
    bucket = s3_bucket(moto_server)
    b = S3Backend(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    for s in (1, 2, 3):
        b.put_atomic(shard_name(s, 0), b"data")
        b.put_atomic(f"manifests/step-{s:012d}.json", b"{}")
    first = _upload(moto_server, bucket, 1)  # under a committed step: goes with it
    killed = _upload(moto_server, bucket, 2)
    b.delete(f"manifests/step-{2:012d}.json")  # step 2 never committed
    gc_tier(b, 5, sweep=None)
    assert _open_uploads(moto_server, bucket) == [first]
    failed = _upload(moto_server, bucket, 2)
    gc_tier(b, 5, sweep=None)  # nothing failed here since the sweep: not looked for
    assert _open_uploads(moto_server, bucket) == sorted([first, failed])
    note_failed_save(b)
    gc_tier(b, 5, sweep=None)
    assert _open_uploads(moto_server, bucket) == [first]
    assert killed == failed
    # retiring step 1 (seen with an open upload by a sweep) aborts that upload too
    b.put_atomic(shard_name(4, 0), b"data")
    b.put_atomic(f"manifests/step-{4:012d}.json", b"{}")
    assert gc_tier(b, 2, sweep=None) == [CheckpointId(1, 0)]
    assert _open_uploads(moto_server, bucket) == []
    b.close()


def test_explicit_gc_always_sweeps(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    bucket = s3_bucket(moto_server)
    b = S3Backend(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    for s in (1, 2):
        b.put_atomic(shard_name(s, 0), b"data")
        b.put_atomic(f"manifests/step-{s:012d}.json", b"{}")
    gc_tier(b, 5, sweep=None)
    _upload(moto_server, bucket, 0)
    gc_tier(b, 5)  # tierckpt gc, explicit calls: sweep=True
    assert _open_uploads(moto_server, bucket) == []
    b.close()
