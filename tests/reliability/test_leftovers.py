"""Leftovers of killed or failed saves: who removes them, and when.

A killed process leaves what its writers had in flight: ``*.tmp`` files on a local tier, open
multipart uploads on S3, a data folder whose manifest never came. They must never block the
next save, and the next saves (their retention pass, ``gc_tier``) or an explicit gc must remove
them. The crash tests produce these leftovers by real SIGKILLs; here each kind is reproduced
exactly (the same names a dead writer leaves) so every cleanup path is checked on its own.

The last tests are gaps this suite found and that are fixed: leftovers of a step that has no
committed object on that tier (found through ``Backend.incomplete``), manifest temp files, and
an upload orphaned by a retried CreateMultipartUpload.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from rel_util import Recorder, local_leftovers, s3_leftovers

import tierckpt
from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.format import manifest_name, shard_name
from tierckpt.testing.faultproxy import Fault, FaultProxy


def _state(step: int, n: int = 50_000) -> dict[str, Any]:
    return {"w": torch.full((n,), float(step)), "step": step}


def _save_steps(tiers: list[Any], steps: range, n: int = 50_000) -> None:
    with Checkpointer(tiers, chunk_bytes=1 << 20) as ck:
        for s in steps:
            ck.save(_state(s, n), s).wait(timeout=60)


def _dead_local_writer(root: Path, step: int) -> Path:
    """What a process killed mid-write leaves: a temp file under the step's folder."""
    final = root / shard_name(step, 0)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{final}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.write_bytes(b"x" * 10_000)
    return tmp


def _dead_manifest_put(root: Path, step: int) -> Path:
    """A process killed inside put_atomic: the manifest's temp file, written, not linked."""
    final = root / manifest_name(step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{final}.{uuid.uuid4().hex[:12]}.tmp")
    tmp.write_bytes(b"{}")
    return tmp


def _dead_upload(server: Any, bucket: str, step: int) -> str:
    """A process killed mid-upload: a multipart upload with one part, never completed."""
    key = f"run/{shard_name(step, 0)}"
    c = server.admin
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * (5 << 20))
    return key


def _s3(server: Any, bucket: str, **kw: Any) -> S3Tier:
    return S3Tier(f"s3://{bucket}/run", endpoint_url=server.endpoint_url, codec="raw", **kw)


def _cli_gc(url: str, server: Any | None = None) -> None:
    from tierckpt.cli import main

    extra = ["--endpoint-url", server.endpoint_url] if server is not None else []
    assert main(["gc", url, "--keep-last", "2", "--abort-incomplete", *extra]) == 0


# -- what works -------------------------------------------------------------------------------


def test_leftovers_never_block_the_next_save_of_the_same_step(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    tmp = _dead_local_writer(tmp_path, 5)
    _dead_upload(moto_server, bucket, 5)
    (tmp_path / shard_name(5, 0)).write_bytes(b"a shard whose manifest never came")
    _save_steps(
        [LocalTier(tmp_path, keep_last=2), _s3(moto_server, bucket, keep_last=2)],
        range(5, 6),
        n=(6 << 20) // 4,
    )
    with Checkpointer([LocalTier(tmp_path), _s3(moto_server, bucket)]) as ck:
        assert ck.tier_steps() == {"local": [5], "s3": [5]}
        assert torch.equal(ck.load()["w"], _state(5, (6 << 20) // 4)["w"])
    # the dead writer's temp file under the now committed step goes with the save's sweep
    assert not tmp.exists()
    record(
        "leftovers",
        "temp file + open upload + manifest-less shard of the same step",
        "next save of that step committed on both tiers, the dead temp file removed",
    )


def test_resaved_step_leftovers_go_when_retention_retires_it(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    tmp = _dead_local_writer(tmp_path, 5)
    _dead_upload(moto_server, bucket, 5)
    _save_steps(
        [LocalTier(tmp_path, keep_last=2), _s3(moto_server, bucket, keep_last=2)], range(5, 9)
    )
    assert not tmp.exists()
    assert s3_leftovers(moto_server.admin, bucket, "run/")["open_uploads"] == []
    record(
        "leftovers",
        "killed save of step 5, step 5 saved again, then retired",
        "temp file and open upload removed by retention",
    )


def test_manifestless_data_of_an_older_step_removed_by_next_save(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    _save_steps([LocalTier(tmp_path / "x"), _s3(moto_server, bucket)], range(5, 6))
    # killed between data and manifest: move step 5's manifests away on both tiers
    (tmp_path / "x" / manifest_name(5)).unlink()
    moto_server.admin.delete_object(Bucket=bucket, Key=f"run/{manifest_name(5)}")
    _save_steps([LocalTier(tmp_path / "x"), _s3(moto_server, bucket)], range(6, 7))
    assert local_leftovers(tmp_path / "x")["uncommitted_data"] == []
    assert s3_leftovers(moto_server.admin, bucket, "run/")["uncommitted_data"] == []
    record(
        "leftovers",
        "data without manifest of an older step (local, S3)",
        "removed by the next save's gc",
    )


def test_cli_gc_abort_incomplete_removes_dead_writers(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)
    _save_steps([LocalTier(tmp_path), _s3(moto_server, bucket)], range(5, 7))
    _dead_local_writer(tmp_path, 9)
    _dead_upload(moto_server, bucket, 9)
    _cli_gc(str(tmp_path))
    _cli_gc(f"s3://{bucket}/run", moto_server)
    assert local_leftovers(tmp_path)["tmp_files"] == []
    assert s3_leftovers(moto_server.admin, bucket, "run/")["open_uploads"] == []
    record("leftovers", "tierckpt gc --abort-incomplete", "temp files and open uploads removed")


# -- gaps this suite found, now fixed: they stay as regression tests -------------------------


def test_next_saves_abort_upload_of_step_never_committed_on_s3(
    moto_server: Any, s3_bucket: Any
) -> None:
    """Killed mid-upload after the local tier committed: the restart resumes after that step,
    so S3 never gets it again; its open upload must still go."""
    bucket = s3_bucket(moto_server)
    _dead_upload(moto_server, bucket, 5)
    _save_steps([_s3(moto_server, bucket, keep_last=2)], range(6, 10))
    assert s3_leftovers(moto_server.admin, bucket, "run/")["open_uploads"] == []


def test_next_saves_remove_temp_file_of_step_never_committed_locally(tmp_path: Path) -> None:
    tmp = _dead_local_writer(tmp_path, 5)
    _save_steps([LocalTier(tmp_path, keep_last=2)], range(6, 10))
    assert not tmp.exists()


@pytest.mark.parametrize("how", ["next saves", "tierckpt gc --abort-incomplete"])
def test_manifest_temp_file_of_killed_put_removed(tmp_path: Path, how: str) -> None:
    _save_steps([LocalTier(tmp_path, keep_last=2)], range(4, 5))
    tmp = _dead_manifest_put(tmp_path, 5)
    _save_steps([LocalTier(tmp_path, keep_last=2)], range(6, 10))
    if how != "next saves":
        _cli_gc(str(tmp_path))
    assert not tmp.exists()


def test_retried_create_multipart_leaves_no_orphan_upload(moto_server: Any, s3_bucket: Any) -> None:
    bucket = s3_bucket(moto_server)
    with FaultProxy(
        moto_server.endpoint_url,
        [Fault("reset_response", method="POST", path_contains="?uploads", times=1)],
    ) as proxy:
        s3 = S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            codec="raw",
            part_size=5 << 20,
            read_timeout=5,
        )
        _save_steps([s3], range(1, 2), n=(6 << 20) // 4)
        assert proxy.fired["reset_response"] == 1
    with Checkpointer([_s3(moto_server, bucket)]) as ck:
        assert ck.steps() == [1]
    assert s3_leftovers(moto_server.admin, bucket, "run/")["open_uploads"] == []


def test_local_backend_lists_no_temp_files(tmp_path: Path) -> None:
    """The premise of the gap above: leftovers are invisible to list(), hence to gc."""
    _dead_local_writer(tmp_path, 5)
    assert [n for n in LocalBackend(tmp_path).list("") if "steps/" in n] == []


# -- unfinished files under a committed checkpoint ----------------------------------------------
_WRITER = """
import os, sys
from tierckpt.backends.local import LocalBackend
from tierckpt.peer._wire import _recv_map
root, name, how = sys.argv[1:4]
if how == "pull":  # a peer pull's receiving file, as the replacement rank makes it
    tmp, fd, mm, t = _recv_map(os.path.join(root, name), 1 << 20)
    t[:4096] = 7
else:
    w = LocalBackend(root).open_writer(name)
    w.write(0, b"x" * 100_000)
print("writing", flush=True)
if sys.stdin.readline().strip() == "commit" and how != "pull":
    w.commit()
    print("committed", flush=True)
    sys.stdin.readline()
os._exit(0)  # killed midway: no abort, no unlink
"""


def _writer(root: Path, name: str, how: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(tierckpt.__file__).parent.parent)}
    p = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), name, how],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "writing"
    return p


def _temps(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.tmp"))


@pytest.mark.parametrize("tier", ["disk", "tmpfs"])
def test_dead_temp_under_a_committed_checkpoint_goes_a_live_one_stays(
    tmp_path: Path, tier: str, record: Recorder
) -> None:
    """A writer killed midway (a shard file, a peer pull) leaves its temporary file inside a
    checkpoint folder that is committed: the next writer's first save removes it, while the
    temporaries of writers still at work there (another process, this one) stay and commit."""
    if tier == "tmpfs":
        shm = Path("/dev/shm")
        if not shm.is_dir():
            pytest.skip("no /dev/shm")
        root = shm / f"tierckpt-test-{uuid.uuid4().hex[:8]}"
    else:
        root = tmp_path / "tier"
    try:
        _save_steps([LocalTier(root, keep_last=None)], range(1, 3))
        killed = [_writer(root, shard_name(1, 0), "shard"), _writer(root, shard_name(1, 1), "pull")]
        for p in killed:
            p.communicate("stop\n", timeout=60)
        _dead_manifest_put(root, 1)  # a second, create-only put of a committed manifest
        live = _writer(root, shard_name(2, 1), "shard")  # another process, still writing
        mine = LocalBackend(root).open_writer(shard_name(2, 2))  # this process, still writing
        mine.write(0, b"y" * 1000)
        assert len(_temps(root)) == 5
        _save_steps(
            [LocalTier(root, keep_last=None)], range(3, 4)
        )  # a new writer: its first pass sweeps
        left = _temps(root)
        assert len(left) == 2 and all(n.startswith(("rank-000001", "rank-000002")) for n in left), (
            left
        )
        assert live.stdin is not None and live.stdout is not None
        live.stdin.write("commit\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == "committed"  # its file was never touched
        live.communicate("\n", timeout=60)
        mine.commit()
        assert _temps(root) == []
        with Checkpointer([LocalTier(root)]) as ck:
            assert ck.tier_steps() == {"local": [1, 2, 3]}
            assert torch.equal(ck.load(step=1)["w"], _state(1)["w"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    record(
        "leftovers",
        f"temp files of killed writers under a committed checkpoint ({tier})",
        "removed by the next writer's first save; live writers' temp files kept and committed",
    )


def test_a_file_system_without_flock_still_saves_and_sweeps_nothing_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where flock fails (Lustre without -o flock: ENOSYS; NFS without its lock service:
    ENOLCK), writers write unlocked and a sweep, which cannot lock either, removes none of
    their files."""
    import errno
    import fcntl

    from tierckpt.backends import _templock

    def no_flock(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(_templock.fcntl, "flock", no_flock)
    b = LocalBackend(tmp_path)
    b.put_atomic("manifests/m.json", b"{}")
    live = b.open_writer("steps/1/shard")
    live.write(0, b"x" * 4096)
    assert b.remove_dead_incomplete("steps/1/shard") == 1  # left: its writer may be alive
    live.commit()
    assert b.read("steps/1/shard", 0, 4096) == b"x" * 4096
    assert b.read("manifests/m.json", 0, 2) == b"{}"
    assert fcntl.flock is no_flock


@pytest.mark.parametrize("tier", ["local", "noderam"])
def test_a_killed_writers_file_of_a_step_after_the_newest_goes(
    tmp_path: Path, tier: str, record: Recorder
) -> None:
    """A writer SIGKILLed while saving step 4 (3 committed) leaves a partial shard file of a
    step newer than the newest commit. Retention spared it (a save of a newer step may still
    be running), so on a node-RAM tier sized, as documented, for keep_last + 1 checkpoints,
    every later save failed the budget and node RAM stayed at step 3 across restarts (a field
    test: 15 restarts in a row). Now a write that would pass the budget first removes the
    temporaries no live writer holds, and a sweep removes them whatever their step; a live
    writer's temporary of a newer step stays."""
    n = 250_000  # 1 MB of float32 per checkpoint
    if tier == "noderam":
        shm = Path("/dev/shm")
        if not shm.is_dir():
            pytest.skip("no /dev/shm")
        base = shm / f"tierckpt-test-{uuid.uuid4().hex[:8]}"
        root = base / "j"

        def spec() -> Any:
            return tierckpt.NodeRamTier(
                path=base, namespace="j", keep_last=2, max_bytes=3 * 4 * n + (256 << 10)
            )
    else:
        base = root = tmp_path / "tier"

        def spec() -> Any:
            return LocalTier(root, keep_last=2)

    try:
        _save_steps([spec()], range(1, 4), n)
        dead = Path(f"{root / shard_name(4, 0)}.{uuid.uuid4().hex[:12]}.tmp")
        dead.parent.mkdir(parents=True, exist_ok=True)
        dead.write_bytes(b"x" * (4 * n))  # as large as a checkpoint: the budget is full
        ahead = _dead_local_writer(root, 9)  # a step no save comes back to
        live = _writer(root, shard_name(5, 1), "shard")  # another process, still writing
        with Checkpointer([spec()], chunk_bytes=1 << 20) as ck:
            ck.save(_state(4, n), 4).wait(timeout=60)  # the restarted job's retry of step 4
            ck.save(_state(5, n), 5).wait(timeout=60)
            assert list(ck.tier_steps().values()) == [[4, 5]]
        assert not dead.exists() and not ahead.exists()
        left = _temps(root)
        assert len(left) == 1 and left[0].startswith("rank-000001"), left
        live.communicate("stop\n", timeout=60)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    record(
        "leftovers",
        f"a killed writer's partial file of a step after the newest commit ({tier})",
        "removed before it fails the next save (node-RAM budget) or by the sweep; a live "
        "writer's kept",
    )
