"""The obstore driver sizes each upload's parts and parts in flight from the shard's size and
the host budget, as the boto3 backend does (tierckpt/backends/sizing.py, docs/scale.md
section 6): its writer against moto behind the fault proxy (which counts the parts and the most
requests in flight), the tier's own settings, and the pipeline's hint on an obstore S3 tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip(
    "obstore", reason="the object-store backend needs obstore (pip install obstore)"
)

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends import sizing
from tierckpt.backends.objstore import ObjectStoreBackend, ObjectStoreError
from tierckpt.backends.objstore import _writer as obs_writer
from tierckpt.backends.sizing import MiB, UploadSizing, shard_size_bound
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

pytestmark = pytest.mark.s3


def _write(w: Any, data: bytes, step: int = 3 * MiB) -> None:
    for off in range(0, len(data), step):
        w.write(off, data[off : off + step])


def test_obstore_writer_sizes_its_parts_from_the_hint(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], monkeypatch: Any
) -> None:
    """With S3's limit at 4 parts (patched; 10,000 would need an 80 GB object), a 40 MiB
    shard (bound 109 MiB) goes up in 2 parts of 28 MiB instead of failing at part 5 of 8 MiB;
    with a 64 MiB host budget 1 part is in flight (a quarter of it is less than 2 parts)."""
    monkeypatch.setattr(sizing, "MAX_PARTS", 4)
    bucket = s3_bucket(moto_server)
    data = torch.randint(0, 256, (40 * MiB,), dtype=torch.uint8).numpy().tobytes()
    slow = [Fault("delay", method="PUT", path_contains="partNumber=", seconds=0.3)]
    with FaultProxy(moto_server.endpoint_url, slow) as proxy:
        b = ObjectStoreBackend(f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url)
        try:
            w = b.open_writer("hinted.tck")
            w.size_hint(40 * MiB, 64 * MiB)
            _write(w, data)
            w.commit()
            assert b.get("hinted.tck") == data
            part = -(-shard_size_bound(40 * MiB) // 4 // MiB) * MiB
            parts = [r for r in proxy.requests if "partNumber=" in r.target]
            assert len(parts) == -(-len(data) // part) == 2  # not 5 of 8 MiB
            assert proxy.max_in_flight == 1
            assert w.sizing == UploadSizing(28 * MiB, 1)  # type: ignore[attr-defined]

            # without the hint: 8 MiB parts, refused before part 5 is sent, nothing left behind
            proxy.requests.clear()
            w = b.open_writer("unhinted.tck")
            with pytest.raises(ObjectStoreError, match="more than 4 parts of 8388608 bytes"):
                _write(w, data)
                w.commit()
            parts = [r for r in proxy.requests if "partNumber=" in r.target]
            assert len(parts) <= 4
            assert b.list() == ["hinted.tck"]
            assert b.incomplete() == []
        finally:
            b.close()


def test_obstore_writer_keeps_the_tiers_settings_unless_the_shard_would_not_fit(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], monkeypatch: Any
) -> None:
    bucket = s3_bucket(moto_server)
    b = ObjectStoreBackend(
        f"s3://{bucket}/run",
        endpoint_url=moto_server.endpoint_url,
        part_size=16 * MiB,
        max_concurrency=3,
    )
    try:
        w = b.open_writer("set.tck")
        w.size_hint(100 * MiB, 8 * MiB)  # a tiny budget does not override a set concurrency
        assert w.sizing == UploadSizing(16 * MiB, 3)  # type: ignore[attr-defined]
        w.abort()

        # a set part size too small for the shard is raised to fit (S3's limit patched to 4)
        monkeypatch.setattr(sizing, "MAX_PARTS", 4)
        w = b.open_writer("raised.tck")
        w.size_hint(40 * MiB, None)
        assert w.sizing == UploadSizing(28 * MiB, 3)  # type: ignore[attr-defined]
        data = bytes(range(256)) * (20 * MiB // 256)
        _write(w, data)
        w.size_hint(400 * MiB, None)  # too late: obstore's writer is open
        assert w.sizing == UploadSizing(28 * MiB, 3)  # type: ignore[attr-defined]
        w.commit()
        assert b.get("raised.tck") == data
    finally:
        b.close()


def test_a_lost_multipart_start_is_asked_again_with_the_hinted_parts(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], monkeypatch: Any
) -> None:
    """The writer keeps its bytes until the (hinted, larger) multipart upload exists, so a
    CreateMultipartUpload whose answer was lost is done again with all of them."""
    monkeypatch.setattr(sizing, "MAX_PARTS", 4)
    bucket = s3_bucket(moto_server)
    faults = [Fault("reset_response", method="POST", path_contains="?uploads", times=1)]
    data = torch.randint(0, 256, (40 * MiB,), dtype=torch.uint8).numpy().tobytes()
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        b = ObjectStoreBackend(
            f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, part_size=5 * MiB
        )
        try:
            w = b.open_writer("lost.tck")
            w.size_hint(40 * MiB, None)
            assert w.sizing.part_size == 28 * MiB  # type: ignore[attr-defined]
            _write(w, data, MiB)
            w.commit()
            assert proxy.fired["reset_response"] == 1
            parts = [r for r in proxy.requests if "partNumber=" in r.target]
            assert len(parts) == 2
            assert b.get("lost.tck") == data
            assert b.incomplete() == []
        finally:
            b.close()


def test_a_save_hints_its_obstore_writer_with_the_shard_and_the_host_budget(
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    monkeypatch: Any,
) -> None:
    bucket = s3_bucket(moto_server)
    seen: list[tuple[int, int | None, UploadSizing]] = []
    real = obs_writer._Writer.size_hint

    def spy(self: Any, data_bytes: int, host_budget: int | None = None) -> None:
        real(self, data_bytes, host_budget)
        seen.append((data_bytes, host_budget, self.sizing))

    monkeypatch.setattr(obs_writer._Writer, "size_hint", spy)
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB
    tier = S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=moto_server.endpoint_url,
        codec="raw",
        driver="obstore",
    )
    with Checkpointer([tier], host_buffer_bytes=48 * MiB) as ck:
        ck.save(state, 1).wait(timeout=60)
        assert torch.equal(ck.load()["w"], state["w"])
    assert [(d, h) for d, h, _s in seen] == [(12 * MiB, 48 * MiB)]
    assert seen[0][2] == UploadSizing(8 * MiB, 1)  # a quarter of 48 MiB holds one part
