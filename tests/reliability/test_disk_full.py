"""Disk full on the local tier: that copy fails with a clear error, nothing else does.

Two ways to fill the disk: a real 8 MiB tmpfs mounted for the test (needs root and mount
permission; skipped otherwise, with the reason), and a backend-level quota (a LocalBackend whose
writes raise ``OSError(ENOSPC)`` past a byte budget), which runs everywhere. In both, the save
that runs out of space fails on the local tier only, with an error that says the disk is full;
the checkpoints already there stay readable; training goes on; the S3 tier still commits every
step; no temporary files stay behind; and once space is freed the next save commits locally.
"""

from __future__ import annotations

import errno
import os
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same
from rel_util import Recorder, local_leftovers, s3_leftovers

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.retention import delete_step, gc_tier

pytestmark = pytest.mark.s3


def _state(step: int, n: int = 300_000) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "step": step, "note": f"step {step}"}


def _s3(server: Any, bucket: str) -> S3Tier:
    # keep_last=None: the tests check every step reached S3 (the default keeps the 5 newest)
    return S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=server.endpoint_url,
        codec="raw",
        max_attempts=2,
        keep_last=None,
    )


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the quota test covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill_until_full(
    ck: Checkpointer, saved: dict[int, dict[str, Any]], first: int, last: int
) -> tuple[int, CheckpointFailed]:
    """Save steps until the local copy of one fails; every save must commit on S3."""
    for step in range(first, last):
        saved[step] = _state(step)
        h = ck.save(saved[step], step)
        try:
            h.wait(timeout=120)
        except CheckpointFailed as exc:
            assert set(exc.errors) == {"local"}, exc.errors
            assert h.committed("s3"), "the S3 copy must commit although the disk is full"
            return step, exc
    raise AssertionError("the disk never filled up")


def _check_disk_full(
    ck: Checkpointer,
    root: Path,
    backend: Any,
    saved: dict[int, dict[str, Any]],
    record: Recorder,
    case: str,
    server: Any,
    bucket: str,
) -> None:
    full, exc = _fill_until_full(ck, saved, 1, 40)
    cause = exc.errors["local"]
    msg = str(exc)
    clear = isinstance(cause, OSError) and cause.errno == errno.ENOSPC
    assert clear, f"not an ENOSPC error: {cause!r}"
    assert "No space left" in msg or "disk full" in msg, msg
    local_steps = ck.steps(tier="local")
    assert full not in local_steps
    # earlier checkpoints intact, on the full disk
    for s in local_steps:
        assert_same(saved[s], ck.load(step=s, tier="local"))
    assert not local_leftovers(root)["tmp_files"], local_leftovers(root)
    # training goes on: more saves while the disk is full fail locally and commit on S3
    more, _ = _fill_until_full(ck, saved, full + 1, full + 2)
    assert ck.steps(tier="s3") == sorted(saved)
    # free space (what an operator or a lower keep_last does), then the next save works
    for s in local_steps[:-1]:
        delete_step(backend, s)
    step = more + 1
    saved[step] = _state(step)
    ck.save(saved[step], step).wait(timeout=120)
    assert ck.steps(tier="local")[-1] == step
    assert_same(saved[step], ck.load(tier="local"))
    # failed saves left data folders without manifests: gc removes them
    gc_tier(backend, None)
    left = local_leftovers(root)
    assert left["tmp_files"] == left["uncommitted_data"] == [], left
    empty = left["empty_folders"]  # aborted writers leave their (empty) step folder
    backend.cleanup_incomplete("")
    assert local_leftovers(root)["empty_folders"] == []
    # every step is on S3, bit-exact
    with Checkpointer([_s3(server, bucket)]) as ck2:
        for s, st in saved.items():
            assert_same(st, ck2.load(step=s))
    assert s3_leftovers(server.admin, bucket, "run/") == {
        "open_uploads": [],
        "uncommitted_data": [],
    }
    record(
        "disk_full",
        case,
        f"step {full} failed on local with {type(cause).__name__}(ENOSPC), steps {local_steps} "
        f"intact, S3 committed all {len(saved)} steps, step {step} committed after freeing space"
        f" ({len(empty)} empty step folders left for cleanup_incomplete)",
        ok=clear,
    )


def test_real_tmpfs_full(tmpfs: Path, moto_server: Any, s3_bucket: Any, record: Recorder) -> None:
    bucket = s3_bucket(moto_server)
    saved: dict[int, dict[str, Any]] = {}
    tiers = [LocalTier(tmpfs, keep_last=None), _s3(moto_server, bucket)]
    with Checkpointer(tiers, chunk_bytes=256 << 10) as ck:
        _check_disk_full(
            ck, tmpfs, ck.backend("local"), saved, record, "tmpfs 8 MiB", moto_server, bucket
        )
    # the error a user sees names the path and says what to do
    with Checkpointer([LocalTier(tmpfs, keep_last=None)], chunk_bytes=256 << 10) as ck:
        big = {"w": torch.zeros(4 << 20)}  # 16 MiB: never fits
        with pytest.raises(CheckpointFailed, match=r"disk full: free space or lower keep_last"):
            ck.save(big, 1000).wait(timeout=60)
        assert ck.steps() == sorted(ck.steps(tier="local"))


class QuotaBackend(LocalBackend):
    """A local folder that behaves like a disk of ``capacity`` bytes (shared by instances)."""

    capacity = 0
    lock = threading.Lock()

    def _used(self) -> int:
        return sum(p.stat().st_size for p in Path(self.root).rglob("*") if p.is_file())

    def _charge(self, n: int) -> None:
        with self.lock:
            if self._used() + n > self.capacity:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_writer(self, name: str):  # type: ignore[no-untyped-def]
        w = super().open_writer(name)
        real = w.write

        def write(offset: int, data: Any) -> None:
            self._charge(len(memoryview(data).cast("B")))
            real(offset, data)

        w.write = write  # type: ignore[method-assign]
        return w

    def put_atomic(self, name: str, data: Any, *, overwrite: bool = False) -> None:
        self._charge(len(memoryview(data).cast("B")))
        super().put_atomic(name, data, overwrite=overwrite)


class QuotaTier(LocalTier):
    def make_backend(self):  # type: ignore[no-untyped-def]
        return QuotaBackend(self.path)


@pytest.mark.parametrize("capacity_mib", [5, 7])
def test_quota_full(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder, capacity_mib: int
) -> None:
    bucket = s3_bucket(moto_server)
    QuotaBackend.capacity = capacity_mib << 20
    root = tmp_path / f"quota-{uuid.uuid4().hex[:6]}"
    saved: dict[int, dict[str, Any]] = {}
    tiers = [QuotaTier(root, keep_last=None), _s3(moto_server, bucket)]
    with Checkpointer(tiers, chunk_bytes=256 << 10) as ck:
        _check_disk_full(
            ck,
            root,
            ck.backend("local"),
            saved,
            record,
            f"LocalBackend quota {capacity_mib} MiB (ENOSPC past the budget)",
            moto_server,
            bucket,
        )


@pytest.mark.parametrize("where", ["tmpfs", "quota"])
def test_restore_from_s3_onto_a_full_local_disk(
    tmp_path: Path,
    moto_server: Any,
    s3_bucket: Any,
    record: Recorder,
    where: str,
    request: pytest.FixtureRequest,
) -> None:
    """A new node restores from S3 and repopulates its local tier; that disk is too small for
    the checkpoint. The restore must still succeed (repopulation is best effort), leaving no
    temp file and no local manifest."""
    bucket = s3_bucket(moto_server)
    state = _state(5, n=2_300_000)  # 9.2 MB: more than the 8 MiB tmpfs and the 5 MiB quota
    with Checkpointer([_s3(moto_server, bucket)]) as ck:
        ck.save(state, 5).wait(timeout=120)
    if where == "tmpfs":
        root = request.getfixturevalue("tmpfs")
        local: LocalTier = LocalTier(root)
    else:
        QuotaBackend.capacity = 5 << 20
        root = tmp_path / "quota"
        local = QuotaTier(root)
    with Checkpointer([local, _s3(moto_server, bucket)]) as ck:
        assert_same(state, ck.load())
        assert ck.tier_steps() == {"local": [], "s3": [5]}
    assert local_leftovers(root)["tmp_files"] == []
    record(
        "disk_full",
        f"restore from S3 repopulating a full local tier ({where})",
        "restored bit-exact from S3; repopulation dropped with a warning, no temp file left",
    )


def test_a_dcp_save_on_a_full_disk_says_why_and_the_disk_frees_itself(
    tmpfs: Path, record: Recorder
) -> None:
    """``tierckpt.dcp`` on an 8 MiB tmpfs filled by a run that kept every step: the save that
    finds the disk full raises naming ENOSPC (before: only "committed on no tier"), runs
    retention anyway, and a writer with ``keep_last=2`` commits its next save."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter

    def save(tiers: list[Any], step: int) -> str | None:
        with TierWriter(tiers, step) as w:
            try:
                dcp.save({"w": _state(step)["w"]}, storage_writer=w, no_dist=True)
            except BaseException as exc:  # DCP wraps it in CheckpointException
                return str(exc)
        return None

    step = 1
    while save([LocalTier(tmpfs, keep_last=None)], step) is None:
        step += 1
        assert step < 40, "the disk never filled up"
    full = step
    with Checkpointer([LocalTier(tmpfs)]) as ck:
        kept = ck.steps()
    assert kept == list(range(1, full)), kept
    err = save([LocalTier(tmpfs, keep_last=2)], full + 1)  # the disk is still full
    assert err is not None and "No space left" in err, err
    assert save([LocalTier(tmpfs, keep_last=2)], full + 2) is None  # retention freed it
    with Checkpointer([LocalTier(tmpfs)]) as ck:
        after = ck.steps()
    assert after[-1] == full + 2, after
    got = {"w": torch.empty_like(_state(full + 2)["w"])}
    dcp.load(got, storage_reader=TierReader([LocalTier(tmpfs)]), no_dist=True)
    assert torch.equal(got["w"], _state(full + 2)["w"])
    record(
        "disk_full",
        "tierckpt.dcp: a local disk (8 MiB tmpfs) full of steps 1-"
        f"{full - 1}; a writer with keep_last=2 saves",
        f"step {full + 1} raised naming ENOSPC and ran retention; step {full + 2} committed "
        f"(steps {after} on the disk)",
    )
