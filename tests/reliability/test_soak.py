"""Load and soak: many checkpoints in a row through local + S3 with retention, and saves
requested faster than the tiers can absorb them.

Soak: RSS, thread count and open file descriptors are measured after a warm-up and at the end;
they must stay flat (the numbers go to the report). Backpressure follows the documented policy:
``on_busy="block"`` (default) — every save is taken, its capture waits in the background for
arena space, and all of them commit; ``on_busy="skip"`` — a save requested while another is in
flight is skipped and says so on its handle. Nothing reported committed is ever missing or
different.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import assert_same
from rel_util import Recorder, fd_kinds, library_threads, local_leftovers, s3_leftovers

from tierckpt import Checkpointer, LocalTier, MemoryTier, S3Tier
from tierckpt.backends.memory import MemoryBackend

pytestmark = pytest.mark.s3


def _state(step: int, n: int = 16_384) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(n, generator=g),
        "opt": {"step": step, "lr": 1e-3},
        "ids": torch.arange(step % 7 + 1),
    }


def soak(tmp_path: Path, server: Any, bucket: str, saves: int, record: Recorder) -> dict[str, Any]:
    proc = psutil.Process()
    ns = f"soak-{uuid.uuid4().hex}"
    tiers = [
        MemoryTier(namespace=ns, keep_last=1),
        LocalTier(tmp_path / "nvme", keep_last=2),
        S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url, keep_last=2),
    ]
    warm = min(20, saves // 5)
    samples: list[tuple[int, int, int, int, int]] = []
    t0 = time.monotonic()
    with Checkpointer(tiers, chunk_bytes=32 << 10, host_buffer_bytes=1 << 20) as ck:
        for step in range(saves):
            h = ck.save(_state(step), step)
            h.wait(timeout=60)
            if step >= warm and (step - warm) % max(1, (saves - warm) // 10) == 0:
                # at rest: a retention pass trailing the commit holds a folder open meanwhile
                ck.wait(retention=True)
                samples.append((step, proc.memory_info().rss, library_threads(), *fd_kinds()))
        ck.wait(retention=True)
        samples.append((saves - 1, proc.memory_info().rss, library_threads(), *fd_kinds()))
        assert ck.tier_steps() == {
            "memory": [saves - 1],
            "local": [saves - 2, saves - 1],
            "s3": [saves - 2, saves - 1],
        }
        for t in ("memory", "local", "s3"):
            assert_same(_state(saves - 1), ck.load(tier=t))
    MemoryBackend.clear_namespace(ns)
    rss = [s[1] for s in samples]
    threads = [s[2] for s in samples]
    fds = [s[3] for s in samples]
    socks = [s[4] for s in samples]
    stats = {
        "checkpoints": saves,
        "seconds": round(time.monotonic() - t0, 1),
        "rss_mib_after_warmup": round(rss[0] / 2**20, 1),
        "rss_mib_end": round(rss[-1] / 2**20, 1),
        "rss_growth_mib": round((max(rss) - rss[0]) / 2**20, 1),
        "library_threads": f"{min(threads)}..{max(threads)}",
        "open_files": f"{min(fds)}..{max(fds)}",
        "sockets_and_epoll": f"{min(socks)}..{max(socks)}",
    }
    left = {**local_leftovers(tmp_path / "nvme"), **s3_leftovers(server.admin, bucket, "run/")}
    ok = (
        max(rss) - rss[0] < 48 << 20
        and max(threads) == min(threads)
        and max(fds) == min(fds)
        and max(socks) - min(socks) <= 8
        and not any(left.values())
    )
    record(
        "soak",
        f"{saves} checkpoints, RAM + local + S3, keep_last 1/2/2",
        ", ".join(f"{k} {v}" for k, v in stats.items() if k != "checkpoints"),
        ok=ok,
        stats=stats,
    )
    assert not any(left.values()), left
    assert max(threads) == min(threads), samples
    assert max(fds) == min(fds), samples
    assert max(socks) - min(socks) <= 8, samples  # pooled connections (client and moto ends)
    assert max(rss) - rss[0] < 48 << 20, samples
    return stats


def test_soak_100(tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder) -> None:
    stats = soak(tmp_path, moto_server, s3_bucket(moto_server), 100, record)
    print("soak:", stats)


@pytest.mark.slow
def test_soak_1000(tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder) -> None:
    stats = soak(tmp_path, moto_server, s3_bucket(moto_server), 1000, record)
    print("soak:", stats)


# -- backpressure ------------------------------------------------------------------------


def _burst(
    tmp_path: Path, server: Any, bucket: str, on_busy: str, n: int
) -> tuple[list[Any], dict[int, dict[str, Any]], Checkpointer, float]:
    s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url, codec="raw", keep_last=None)
    ck = Checkpointer(
        [LocalTier(tmp_path / "nvme", keep_last=None), s3],
        chunk_bytes=64 << 10,
        host_buffer_bytes=256 << 10,
        on_busy=on_busy,
    )  # type: ignore[arg-type]
    saved = {s: _state(s, 65_536) for s in range(n)}  # 256 KiB each: the whole arena
    t0 = time.monotonic()
    handles = [ck.save(saved[s], s) for s in range(n)]  # no waiting: faster than S3 absorbs
    requested = time.monotonic() - t0
    for h in handles:
        h.wait(timeout=120) if not h.skipped else None
    return handles, saved, ck, requested


def test_backpressure_block_takes_every_save(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    handles, saved, ck, requested = _burst(tmp_path, moto_server, bucket, "block", 30)
    with ck:
        assert not any(h.skipped for h in handles)
        assert all(set(h.results) == {"local", "s3"} for h in handles)
        arena = ck._pipeline.arena  # type: ignore[union-attr]
        assert arena is not None and arena.nbytes <= 256 << 10
        assert ck.tier_steps() == {"local": list(range(30)), "s3": list(range(30))}
        for s in range(30):
            assert_same(saved[s], ck.load(step=s, tier="s3"))
            assert_same(saved[s], ck.load(step=s, tier="local"))
    last_capture = max(h.captured_at - h.started for h in handles)  # type: ignore[operator]
    record(
        "soak",
        "30 saves requested at once, on_busy='block', arena = 1 state",
        f"save() calls took {requested:.2f} s in all; captures waited up to "
        f"{last_capture:.2f} s for arena space; 30/30 committed on local and S3, bit-exact",
    )


def test_backpressure_skip_reports_skipped_and_loses_nothing(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    handles, saved, ck, _ = _burst(tmp_path, moto_server, bucket, "skip", 30)
    with ck:
        skipped = [h.step for h in handles if h.skipped]
        committed = [h.step for h in handles if not h.skipped]
        assert skipped, "a burst faster than the tiers must skip some saves"
        assert committed and committed[0] == 0
        for h in handles:
            if not h.skipped:
                assert set(h.results) == {"local", "s3"}
        assert ck.tier_steps() == {"local": committed, "s3": committed}
        for s in committed:
            assert_same(saved[s], ck.load(step=s, tier="s3"))
    record(
        "soak",
        "30 saves requested at once, on_busy='skip'",
        f"{len(skipped)} reported skipped on their handle, {len(committed)} committed on "
        "local and S3, bit-exact; no skipped step listed",
    )
