"""Part size and parts in flight chosen from the shard's size and the host budget
(tierckpt/backends/sizing.py, docs/scale.md section 6): the rule, then the S3 writer
against a real S3 server (moto behind the fault proxy, which counts the parts and the most
requests in flight), then the pipeline's hint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends import sizing
from tierckpt.backends.s3 import S3Backend, _client, _writer
from tierckpt.backends.s3._sizing import (
    AUTO_CONCURRENCY,
    AUTO_PART_SIZE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MiB,
    UploadSizing,
    choose_upload,
    shard_size_bound,
)
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

GiB = 2**30


def test_small_shards_keep_8_mib_parts_and_8_in_flight() -> None:
    assert choose_upload(100 * MiB, None) == UploadSizing(AUTO_PART_SIZE, AUTO_CONCURRENCY)
    assert choose_upload(None, None) == UploadSizing(8 * MiB, 8)
    # 8 MiB parts fit up to 10,000 x 8 MiB = 80 GiB
    assert choose_upload(MAX_PARTS * 8 * MiB, None).part_size == 8 * MiB


@pytest.mark.parametrize("size", [80 * GiB + 1, 200 * GiB, 1_750 * GiB, 40_000 * GiB])
def test_large_shards_get_whole_mib_parts_within_10000(size: int) -> None:
    s = choose_upload(size, None)
    assert s.part_size % MiB == 0 and s.part_size >= 8 * MiB
    assert -(-size // s.part_size) <= MAX_PARTS  # fits
    assert -(-size // (s.part_size - MiB)) > MAX_PARTS  # and is the smallest that does


def test_part_size_stops_at_s3s_5_gib() -> None:
    assert choose_upload(60_000 * GiB, None).part_size == MAX_PART_SIZE


def test_parts_in_flight_fit_a_quarter_of_the_host_budget() -> None:
    assert choose_upload(GiB, 64 * MiB).concurrency == 2  # 16 MiB / 8 MiB
    assert choose_upload(GiB, 4 * GiB).concurrency == 8  # the pool bounds it
    assert choose_upload(GiB, 4 * GiB, pool=16).concurrency == 16
    assert choose_upload(GiB, 1 * MiB).concurrency == 1  # never 0
    # larger parts (a 400 GiB shard: 41 MiB) mean fewer in flight on the same budget
    big = choose_upload(400 * GiB, 1 * GiB)
    assert big.part_size == 41 * MiB and big.concurrency == 256 // 41
    assert big.buffer_bytes <= GiB // 4


def test_the_tiers_settings_override_except_where_the_shard_would_not_fit() -> None:
    assert choose_upload(GiB, 64 * MiB, part_size=64 * MiB, max_concurrency=8) == (
        UploadSizing(64 * MiB, 8)
    )
    # a set part size too small for the shard is raised to fit: better than failing at part
    # 10,001 after uploading 10,000
    s = choose_upload(200 * GiB, None, part_size=5 * MiB)
    assert s.part_size == 21 * MiB


def test_the_bound_covers_the_codecs_worst_case_and_the_index() -> None:
    assert shard_size_bound(0) >= 64 * MiB
    assert shard_size_bound(GiB) >= GiB * 1.1


@pytest.mark.s3
def test_writer_sizes_its_parts_from_the_hint(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str], monkeypatch: Any
) -> None:
    """With S3's limit at 4 parts (patched; 10,000 would need an 80 GB object), a 40 MiB
    shard (bound 109 MiB) goes up in 2 parts of 28 MiB instead of failing at part 5 of 8 MiB;
    with a 64 MiB host budget 1 part is in flight (a quarter of it is less than 2 parts)."""
    monkeypatch.setattr(sizing, "MAX_PARTS", 4)
    monkeypatch.setattr(_client, "MAX_PARTS", 4)
    monkeypatch.setattr(_writer, "MAX_PARTS", 4)
    bucket = s3_bucket(moto_server)
    data = torch.randint(0, 256, (40 * MiB,), dtype=torch.uint8).numpy().tobytes()
    slow = [Fault("delay", method="PUT", path_contains="partNumber=", seconds=0.3)]
    with FaultProxy(moto_server.endpoint_url, slow) as proxy:
        b = S3Backend(f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url)
        try:
            w = b.open_writer("hinted.tck")
            w.size_hint(40 * MiB, 64 * MiB)
            part = w.sizing.part_size  # type: ignore[attr-defined]
            assert part == -(-shard_size_bound(40 * MiB) // 4 // MiB) * MiB
            assert w.sizing.concurrency == 1  # type: ignore[attr-defined]
            for off in range(0, len(data), 3 * MiB):
                w.write(off, data[off : off + 3 * MiB])
            w.commit()
            assert b.get("hinted.tck") == data
            parts = [r for r in proxy.requests if "partNumber=" in r.target]
            assert len(parts) == -(-len(data) // part) == 2
            assert proxy.max_in_flight == 1

            # without the hint: 8 MiB parts, and S3's (patched) limit ends the upload
            proxy.requests.clear()
            w = b.open_writer("unhinted.tck")
            with pytest.raises(Exception, match="more than 4 parts"):
                for off in range(0, len(data), 3 * MiB):
                    w.write(off, data[off : off + 3 * MiB])
                w.commit()
        finally:
            b.close()


@pytest.mark.s3
def test_writer_keeps_the_tiers_settings(
    moto_server: S3Server, s3_bucket: Callable[[S3Server], str]
) -> None:
    bucket = s3_bucket(moto_server)
    b = S3Backend(
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
    finally:
        b.close()


@pytest.mark.s3
def test_a_save_hints_its_s3_writer_with_the_shard_and_the_host_budget(
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    monkeypatch: Any,
) -> None:
    bucket = s3_bucket(moto_server)
    seen: list[tuple[int, int | None, UploadSizing]] = []
    real = _writer._S3Writer.size_hint

    def spy(self: Any, data_bytes: int, host_budget: int | None = None) -> None:
        real(self, data_bytes, host_budget)
        seen.append((data_bytes, host_budget, self.sizing))

    monkeypatch.setattr(_writer._S3Writer, "size_hint", spy)
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB
    # the boto3 writer is spied on (obstore's: tests/test_objstore_sizing.py)
    tier = S3Tier(
        f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, codec="raw", driver="boto3"
    )
    with Checkpointer([tier], host_buffer_bytes=48 * MiB) as ck:
        ck.save(state, 1).wait(timeout=60)
        assert torch.equal(ck.load()["w"], state["w"])
    assert [(d, h) for d, h, _s in seen] == [(12 * MiB, 48 * MiB)]
    assert seen[0][2] == UploadSizing(8 * MiB, 1)  # a quarter of 48 MiB holds one part
