"""The requests of one S3 save (issue 15, S3 save): which, how many, in what order; the
guards of the commit protocol any change to the save's tail must keep.

One save on a tier that holds its lease sends, up to its commit: the HEAD of the step's
manifest (never overwrite a committed step), the multipart upload (create, parts, complete),
one read of the lease before the completion (publish only while the location is ours) and the
create-only PUT of the manifest after the completion. A step found committed publishes
nothing, however late the store answers; two writers on one prefix commit once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

pytest.importorskip("obstore", reason="the S3 tier's default driver needs obstore")

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.errors import CheckpointFailed, TierCkptError
from tierckpt.testing.faultproxy import Fault, FaultProxy, RequestRecord
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]
#: generous: a loaded machine
WAIT_S = 120


def _state(n_bytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n_bytes // 4, generator=g)}


def _tier(endpoint: str, bucket: str, **kw: object) -> S3Tier:
    kw.setdefault("keep_last", None)
    return S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=endpoint,
        codec="raw",
        part_size=PART,
        **kw,  # type: ignore[arg-type]
    )


def _kind(r: RequestRecord) -> str:
    """A request as ``METHOD what``: part, create, complete, manifest, lease, shard..."""
    query = r.target.partition("?")[2]
    path = r.target.partition("?")[0]
    if "partNumber=" in query:
        return f"{r.method} part"
    if any(q.partition("=")[0] == "uploads" for q in query.split("&")):
        return f"{r.method} create" if r.method == "POST" else f"{r.method} uploads"
    if "uploadId=" in query:
        return f"{r.method} complete" if r.method == "POST" else f"{r.method} upload"
    if "list-type=" in query:
        return f"{r.method} list"
    if "/manifests/" in path:
        return f"{r.method} manifest"
    if "/leases/" in path:
        return f"{r.method} lease"
    if path.endswith(".tck"):
        return f"{r.method} shard"
    return f"{r.method} {path}"


def _open_uploads(server: S3Server, bucket: str) -> list[object]:
    return list(server.admin.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


@pytest.mark.s3
def test_one_save_sends_the_parts_and_four_requests_more_manifest_after_completion(
    seaweedfs_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """A second save (the lease is held): the manifest HEAD, the upload's create, its parts and
    completion, one lease read before the completion and the create-only manifest PUT after
    it; nothing else up to the commit (the retention pass trails it)."""
    bucket = s3_bucket(seaweedfs_server)
    with FaultProxy(seaweedfs_server.endpoint_url) as proxy:
        tier = _tier(proxy.endpoint_url, bucket)
        with Checkpointer([tier], host_buffer_bytes=64 * MiB) as ck:
            ck.save(_state(12 * MiB, 1), step=1).result(timeout=WAIT_S)
            ck.wait(retention=True)
            proxy.requests.clear()
            ck.save(_state(12 * MiB, 2), step=2).result(timeout=WAIT_S)
            kinds = [_kind(r) for r in proxy.requests]
    # what follows the commit is the retention pass (it trails the commit, not counted here)
    assert "PUT manifest" in kinds, kinds
    kinds = kinds[: kinds.index("PUT manifest") + 1]
    parts = kinds.count("PUT part")
    assert parts == 3, kinds  # 12 MiB and the index in parts of 5 MiB
    assert sorted(k for k in kinds if k != "PUT part") == sorted(
        ["HEAD manifest", "POST create", "GET lease", "POST complete", "PUT manifest"]
    ), kinds
    assert len(kinds) == parts + 5
    complete = kinds.index("POST complete")
    assert kinds.index("GET lease") < complete < kinds.index("PUT manifest"), kinds
    assert max(i for i, k in enumerate(kinds) if k == "PUT part") < complete, kinds


def _hold_manifest_head(proxy: FaultProxy, seconds: float) -> None:
    proxy.set_faults(
        [Fault("delay", method="HEAD", path_contains="/manifests/", seconds=seconds, times=1)]
    )


@pytest.mark.s3
@pytest.mark.parametrize("n_bytes", [12 * MiB, 1024], ids=["multipart", "one-put"])
def test_a_committed_step_answered_late_still_publishes_nothing(
    moto_server: S3Server, s3_bucket: BucketFactory, n_bytes: int
) -> None:
    """The HEAD's answer (the step is committed) is held back by the proxy: the save still
    fails, the shard is never completed or put, no upload is left open, and the committed
    checkpoint loads unchanged (whatever the order of the check and the upload)."""
    bucket = s3_bucket(moto_server)
    first = _state(n_bytes, 1)
    with FaultProxy(moto_server.endpoint_url) as proxy:
        tier = _tier(proxy.endpoint_url, bucket)
        with Checkpointer([tier], host_buffer_bytes=64 * MiB) as ck:
            ck.save(first, step=5).result(timeout=WAIT_S)
            proxy.requests.clear()
            _hold_manifest_head(proxy, 2.0)
            h = ck.save(_state(n_bytes, 2), step=5)
            with pytest.raises(CheckpointFailed, match="already committed"):
                h.result(timeout=WAIT_S)
            kinds = [_kind(r) for r in proxy.requests]
            got = ck.load(step=5)
    assert "POST complete" not in kinds and "PUT shard" not in kinds, kinds
    assert "PUT manifest" not in kinds, kinds
    assert _open_uploads(moto_server, bucket) == []
    assert torch.equal(got["w"], first["w"])


@pytest.mark.s3
def test_two_writers_on_one_prefix_still_commit_once(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """Two checkpointers on one prefix save the same step at once: exactly one commits it
    (the other is refused by the lease before writing), and the committed one loads."""
    bucket = s3_bucket(moto_server)
    states = [_state(6 * MiB, 10 + i) for i in range(2)]
    outcomes: list[object] = [None, None]
    go = threading.Barrier(2)

    def run(i: int) -> None:
        with Checkpointer([_tier(moto_server.endpoint_url, bucket)]) as ck:
            go.wait()
            try:
                ck.save(states[i], step=7).result(timeout=WAIT_S)
                outcomes[i] = "committed"
            except TierCkptError as exc:  # refused at save() or failed on the tier
                outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert outcomes.count("committed") == 1, outcomes
    winner = outcomes.index("committed")
    with Checkpointer([_tier(moto_server.endpoint_url, bucket)]) as ck:
        assert ck.steps() == [7]
        assert torch.equal(ck.load(step=7)["w"], states[winner]["w"])
    assert _open_uploads(moto_server, bucket) == []
