"""Faults on S3: a fault proxy in front of moto injects delays, 500 InternalError, 503 SlowDown,
connection resets mid-request and mid-response, and stalls longer than the client's read
timeout, at random (seeded) over a run of checkpoints, with storms of heavy faults in which
retries run out and checkpoints must fail cleanly.

Every checkpoint either commits on S3 or is reported failed there (never a silent gap); a
reported commit is listed and restores bit-exact; a failed one is never listed as committed
unless its manifest really landed (then it restores bit-exact too); restores under the same
faults return the right bytes or raise a tierckpt error, never wrong data; no ``h.wait`` needs
more than its bound (so no request hangs past its timeouts); no multipart upload stays open
after ``tierckpt gc --abort-incomplete`` (uploads left open by failed aborts and retried
creates before that are counted and reported; ``test_leftovers.py`` tracks the gap).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from rel_util import Recorder, s3_leftovers

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier, TierCkptError
from tierckpt.testing.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3

READ_TIMEOUT = 2.0
#: the most one save may take under these faults: attempts x (timeouts + backoff) per request
SAVE_BOUND_S = 60.0


def _faults(p: float) -> list[Fault]:
    return [
        Fault("slowdown", probability=p),
        Fault("error500", probability=p * 0.6),
        Fault("reset_request", method="PUT", probability=p * 0.6),
        Fault("reset_response", probability=p * 0.6),
        Fault("delay", probability=p, seconds=0.3),
        Fault("stall", probability=p * 0.2, seconds=READ_TIMEOUT + 1.5),
    ]


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    # every third checkpoint is larger than a part (6 MiB raw): a multipart upload
    n = (6 << 20) // 4 if step % 3 == 0 else 20_000
    return {"w": torch.randn(n, generator=g), "step": step, "tag": ("s", step)}


def run_faulty_s3(
    tmp_path: Path,
    server: Any,
    bucket: str,
    record: Recorder,
    *,
    saves: int,
    p: float,
    seed: int,
    budget_s: float,
) -> dict[str, Any]:
    saved: dict[int, dict[str, Any]] = {}
    outcome: dict[int, str] = {}
    t0 = time.monotonic()
    longest = 0.0
    with FaultProxy(server.endpoint_url, _faults(p), seed=seed, timeout=10) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            codec="raw",
            keep_last=None,  # every committed step must be listed (the default keeps 5)
            part_size=5 << 20,
            max_attempts=4,
            connect_timeout=2,
            read_timeout=READ_TIMEOUT,
        )
        with Checkpointer(
            [LocalTier(tmp_path / "nvme", keep_last=2), s3], chunk_bytes=1 << 20, repopulate=False
        ) as ck:
            for step in range(1, saves + 1):
                if time.monotonic() - t0 > budget_s:
                    break
                saved[step] = _state(step)
                # storms: two checkpoints in ten see heavy faults, so some must fail
                proxy.set_faults(_faults(0.6 if step % 10 in (4, 5) else p))
                ts = time.monotonic()
                h = ck.save(saved[step], step)
                try:
                    h.wait(timeout=SAVE_BOUND_S)
                    outcome[step] = "committed"
                except CheckpointFailed as exc:
                    assert set(exc.errors) == {"s3"}, exc.errors  # the local copy never fails
                    outcome[step] = f"failed: {type(exc.errors['s3']).__name__}"
                    assert "s3" in str(exc)
                longest = max(longest, time.monotonic() - ts)
                assert h.done(), "a save outlived its bound"
            proxy.set_faults(_faults(p))
            listed = set(ck.steps(tier="s3"))
            # restores under the same faults: right bytes or a tierckpt error, never wrong data
            read_ok = read_err = 0
            for step in sorted(listed)[-6:]:
                try:
                    got = ck.load(step=step, tier="s3")
                except TierCkptError:
                    read_err += 1
                    continue
                assert_same(saved[step], got)
                read_ok += 1
        fired = dict(proxy.fired)
        requests = len(proxy.requests)
    # faults off: every step reported committed is there, bit-exact
    committed = {s for s, o in outcome.items() if o == "committed"}
    assert committed <= listed, f"reported committed but not listed: {committed - listed}"
    landed_anyway = listed - committed
    left = s3_leftovers(server.admin, bucket, "run/")
    s3_all = S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url, keep_last=None)
    with Checkpointer([s3_all]) as ck2:
        for step in sorted(listed):
            assert_same(saved[step], ck2.load(step=step))
        # the faults are over: the next save commits, and its retention pass removes the data
        # of failed saves (those older than it; a failed last save's data is newer than every
        # committed step until this one commits)
        nxt = max(saved) + 1
        saved[nxt] = _state(nxt)
        ck2.save(saved[nxt], nxt).wait(timeout=SAVE_BOUND_S)
        assert_same(saved[nxt], ck2.load())
    stats = {
        "checkpoints": len(outcome),
        "outcomes": dict(Counter(outcome.values())),
        "committed": len(committed),
        "failed": len(outcome) - len(committed),
        "failed_but_manifest_landed": sorted(landed_anyway),
        "faults_fired": fired,
        "requests": requests,
        "longest_save_s": round(longest, 2),
        "restores_under_faults": {"exact": read_ok, "clear_error": read_err},
        "open_uploads_after_run": len(left["open_uploads"]),
        "failed_saves_data_after_run": len(left["uncommitted_data"]),
        "seconds": round(time.monotonic() - t0, 1),
    }
    record("s3_faults", "summary", "every checkpoint committed or reported failed", stats=stats)
    # uploads orphaned by failed aborts or by a retried CreateMultipartUpload stay open until
    # an operator's gc (the next saves' retention would also abort them, see test_leftovers.py): it clears
    # every one of them
    from tierckpt.cli import main as cli

    assert (
        cli(
            [
                "gc",
                f"s3://{bucket}/run",
                "--keep-last",
                "1000",
                "--abort-incomplete",
                "--endpoint-url",
                server.endpoint_url,
            ]
        )
        == 0
    )
    assert s3_leftovers(server.admin, bucket, "run/") == {
        "open_uploads": [],
        "uncommitted_data": [],
    }
    return stats


def test_checkpoints_through_s3_faults(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    stats = run_faulty_s3(
        tmp_path, moto_server, bucket, record, saves=32, p=0.06, seed=3, budget_s=55
    )
    print("s3 faults:", stats)
    assert stats["checkpoints"] >= 30, stats
    assert sum(stats["faults_fired"].values()) >= 10, stats
    assert stats["committed"] >= stats["checkpoints"] // 2, stats


@pytest.mark.slow
def test_checkpoints_through_s3_faults_long(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    stats = run_faulty_s3(
        tmp_path, moto_server, bucket, record, saves=200, p=0.08, seed=11, budget_s=420
    )
    print("s3 faults (long):", stats)
    assert stats["checkpoints"] >= 100, stats
