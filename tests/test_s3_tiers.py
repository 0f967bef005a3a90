"""The S3 tier in the tier policy — stream, retention per tier, restore on a new node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch
from helpers import assert_same, trained_state

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, MemoryTier, S3Tier
from tierckpt.format import shard_name
from tierckpt.testing.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3


def _open_uploads(server, bucket: str) -> list:  # type: ignore[no-untyped-def]
    return server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _s3(server, bucket: str, **kw) -> S3Tier:  # type: ignore[no-untyped-def]
    kw.setdefault("part_size", 5 << 20)
    return S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url, **kw)


def _big_state() -> dict:
    s = trained_state()
    g = torch.Generator().manual_seed(3)
    s["embedding"] = torch.randn(3 << 20, generator=g)  # 12 MiB: several S3 parts
    return s


def test_ram_local_s3_then_restore_on_new_node_in_fresh_process(
    tmp_path: Path,
    s3_server,
    s3_bucket,  # type: ignore[no-untyped-def]
) -> None:
    bucket = s3_bucket(s3_server)
    state = _big_state()
    policy = [
        MemoryTier(namespace=uuid.uuid4().hex),
        LocalTier(tmp_path / "nvme"),
        _s3(s3_server, bucket),
    ]
    with Checkpointer(policy, chunk_bytes=4 << 20) as ck:
        h = ck.save(state, step=100)
        h.wait()
        assert set(h.results) == {"memory", "local", "s3"}
    torch.save({k: v for k, v in state.items()}, tmp_path / "expected.pt")
    # a brand-new node: a new process, an empty local folder, only S3 has the checkpoint
    new_local = tmp_path / "new-node-nvme"
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from helpers import assert_same
        from tierckpt import Checkpointer, LocalTier, MemoryTier, S3Tier
        policy = [MemoryTier(namespace="fresh"), LocalTier({str(new_local)!r}),
                  S3Tier("s3://{bucket}/run", endpoint_url={s3_server.endpoint_url!r})]
        with Checkpointer(policy) as ck:
            assert ck.tier_steps() == {{"memory": [], "local": [], "s3": [100]}}, ck.tier_steps()
            loaded = ck.load()
            assert_same(torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True), loaded)
            # the local tier was repopulated while reading: the next restart is local
            assert ck.tier_steps()["local"] == [100], ck.tier_steps()
        with Checkpointer([LocalTier({str(new_local)!r})]) as ck:
            assert_same(loaded, ck.load())
        print("RESTORED-OK")
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert "RESTORED-OK" in out.stdout, out.stderr[-3000:]
    assert _open_uploads(s3_server, bucket) == []


def test_ram_plus_s3_only(tmp_path: Path, moto_server, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    bucket = s3_bucket(moto_server)
    state = _big_state()
    ns = uuid.uuid4().hex
    with Checkpointer(
        [MemoryTier(namespace=ns, keep_last=1), _s3(moto_server, bucket, keep_last=2)],
        chunk_bytes=4 << 20,
    ) as ck:
        for s in (1, 2, 3):
            ck.save(state, step=s).wait()
        assert ck.tier_steps() == {"memory": [3], "s3": [2, 3]}
    with Checkpointer([_s3(moto_server, bucket)]) as ck:
        assert_same(state, ck.load())
    keys = [o["Key"] for o in moto_server.admin.list_objects_v2(Bucket=bucket)["Contents"]]
    assert not any("000000000001" in k for k in keys), keys  # retention removed step 1's data
    assert _open_uploads(moto_server, bucket) == []


def test_every_n_and_retention_per_tier(tmp_path: Path, moto_server, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    bucket = s3_bucket(moto_server)
    with Checkpointer(
        [LocalTier(tmp_path, keep_last=2), _s3(moto_server, bucket, every=3, keep_last=2)]
    ) as ck:
        for s in range(0, 80, 10):  # 8 saves: S3 gets the 1st, 4th and 7th
            ck.save({"x": torch.full((1000,), float(s))}, step=s).wait()
        assert ck.tier_steps() == {"local": [60, 70], "s3": [30, 60]}
        assert ck.load(step=30)["x"][0].item() == 30.0  # only on S3
        assert ck.load()["x"][0].item() == 70.0  # newest, from local
    assert _open_uploads(moto_server, bucket) == []


def test_s3_failure_mid_upload_fails_only_s3_and_leaves_no_upload(
    tmp_path: Path,
    moto_server,
    s3_bucket,  # type: ignore[no-untyped-def]
) -> None:
    bucket = s3_bucket(moto_server)
    state = _big_state()
    with FaultProxy(moto_server.endpoint_url) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            part_size=5 << 20,
            max_attempts=2,
            read_timeout=5,
        )
        with Checkpointer([LocalTier(tmp_path), s3], chunk_bytes=4 << 20) as ck:
            ck.save(state, step=1).wait()
            # every part upload now fails: retries are exhausted, the S3 copy fails
            proxy.set_faults([Fault("error500", method="PUT", path_contains="partNumber=")])
            h = ck.save(state, step=2)
            with pytest.raises(CheckpointFailed) as ei:
                h.wait()
            assert set(ei.value.errors) == {"s3"}
            assert h.committed("local")
            assert ck.tier_steps() == {"local": [1, 2], "s3": [1]}
            assert _open_uploads(moto_server, bucket) == []
            # transient faults (a few 503 SlowDown) are retried through
            proxy.set_faults(
                [Fault("slowdown", method="PUT", path_contains="partNumber=", times=2)]
            )
            ck.save(state, step=3).wait()
            assert ck.tier_steps()["s3"] == [1, 3]
            proxy.set_faults([])
        with Checkpointer([_s3(moto_server, bucket)]) as ck2:
            assert_same(state, ck2.load())
    assert _open_uploads(moto_server, bucket) == []


def test_manifest_written_last_and_create_only(tmp_path: Path, moto_server, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    bucket = s3_bucket(moto_server)
    with Checkpointer([_s3(moto_server, bucket)]) as ck:
        ck.save({"x": torch.ones(10)}, step=5).wait()
        h = ck.save({"x": torch.zeros(10)}, step=5)
        with pytest.raises(CheckpointFailed, match="already committed"):
            h.wait()
        assert torch.equal(ck.load()["x"], torch.ones(10))
    body = json.loads(
        moto_server.admin.get_object(Bucket=bucket, Key="run/manifests/step-000000000005.json")[
            "Body"
        ].read()
    )
    # format v2 on S3: the shard under one of 256 hashed prefixes, the manifest says so
    assert body["version"] == 2 and body["shards"][0]["file"] == shard_name(5, 0, prefixes=256)
    assert body["shards"][0]["file"].endswith("/steps/000000000005/rank-000000.tck")
