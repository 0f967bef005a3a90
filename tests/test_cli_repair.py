"""``tierckpt pull`` / ``push`` check a copy already at the destination before skipping it:
a damaged one (a flipped byte) is replaced by the source's, uncommitted until the new copy is
whole; another run's checkpoint under the same step is neither skipped as "already committed"
nor overwritten."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main
from tierckpt.errors import WriterConflict
from tierckpt.format import CheckpointId, manifest_name, shard_name
from tierckpt.lease import lease_name
from tierckpt.liveness import LeaseRecord
from tierckpt.offline import copy_checkpoint, verify_checkpoint
from tierckpt.offline._repair import destination_copy, replace_copy
from tierckpt.restore import read_index, read_manifest
from tierckpt.testing.s3servers import S3Server

C3 = CheckpointId(3, 0)


def _state(step: int, run: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 10 + (run == "B"))
    return {"w": torch.randn(40_000, generator=g), "step": step}


def _save(root: Path, run: str, steps: tuple[int, ...] = (1, 2, 3), **kw: Any) -> Path:
    with Checkpointer([LocalTier(root, keep_last=None, **kw)], chunk_bytes=16 << 10) as ck:
        for s in steps:
            ck.save(_state(s, run), s).wait(timeout=60)
    return root


def _flip(root: Path, step: int = 3, chunk: int = 1) -> None:
    """One flipped byte in a chunk of ``step``'s rank-0 shard (the manifest untouched)."""
    backend = LocalBackend(root)
    m = read_manifest(backend, step, "t")
    rec = read_index(backend, m.shards[0], "t")[0]["chunks"][chunk]
    f = root / m.shards[0].file
    data = bytearray(f.read_bytes())
    data[rec.file_offset + rec.stored_size // 2] ^= 0x01
    f.write_bytes(bytes(data))


def _loads(root: Path, step: int, run: str) -> bool:
    with Checkpointer([LocalTier(root)], repopulate=False) as ck:
        got = ck.load(step)
    return torch.equal(got["w"], _state(step, run)["w"])


# -- local folder to local folder (the offline functions pull and push use) ---------------------
def test_destination_copy_tells_absent_intact_damaged_and_another_run(tmp_path: Path) -> None:
    src = LocalBackend(_save(tmp_path / "src", "A"))
    empty = LocalBackend(tmp_path / "empty")
    assert destination_copy(src, empty, C3).state == "absent"
    same = LocalBackend(tmp_path / "same")
    copy_checkpoint(src, same, C3)
    assert destination_copy(src, same, C3).state == "intact"
    recoded = LocalBackend(_save(tmp_path / "recoded", "A", (3,), codec="zstd"))
    assert destination_copy(src, recoded, C3).state == "intact"  # same data, other codec
    _flip(Path(same.root))
    got = destination_copy(src, same, C3)
    assert got.state == "damaged" and "checksum" in got.why, got
    other = LocalBackend(_save(tmp_path / "other", "B"))
    got = destination_copy(src, other, C3)
    assert got.state == "other" and "chunk" in got.why, got
    other_z = LocalBackend(_save(tmp_path / "other_z", "B", (3,), codec="zstd"))
    assert destination_copy(src, other_z, C3).state == "other"  # decoded bytes compared


class _Counting(LocalBackend):
    """A local folder that counts the bytes read from it, taken for a remote store."""

    read_bytes = 0

    @property
    def is_remote(self) -> bool:
        return True

    def read(self, name: str, offset: int, length: int) -> Any:
        out = super().read(name, offset, length)
        self.read_bytes += len(out)
        return out


def test_a_remote_copy_is_checked_without_reading_its_data(tmp_path: Path) -> None:
    """Re-running ``push --all`` over a prefix that holds the run read every byte of it back
    (a download of the whole run to skip it); an object store's copy is judged by its files'
    sizes and indexes unless asked to read it whole, and a truncated file is still found."""
    with Checkpointer([LocalTier(tmp_path / "src")], chunk_bytes=1 << 20) as ck:
        ck.save({"w": torch.randn(2_000_000)}, 3).wait(timeout=60)  # 8 MB, 8 chunks
    src = LocalBackend(tmp_path / "src")
    dst = _Counting(tmp_path / "dst")
    copy_checkpoint(src, dst, C3)
    shard = read_manifest(dst, 3, "t").shards[0]
    dst.read_bytes = 0
    assert destination_copy(src, dst, C3).state == "intact"
    assert dst.read_bytes < shard.size // 4, (dst.read_bytes, shard.size)
    dst.read_bytes = 0
    assert destination_copy(src, dst, C3, read_whole=True).state == "intact"
    assert dst.read_bytes >= shard.size - 4096, (dst.read_bytes, shard.size)
    f = tmp_path / "dst" / shard.file
    f.write_bytes(f.read_bytes()[:-100])
    got = destination_copy(src, dst, C3)
    assert got.state == "damaged" and "truncated" in got.why, got


def test_replace_copy_repairs_and_is_uncommitted_while_it_writes(tmp_path: Path) -> None:
    src = LocalBackend(_save(tmp_path / "src", "A"))
    dst_root = tmp_path / "dst"
    dst = LocalBackend(dst_root)
    for s in (1, 2, 3):
        copy_checkpoint(src, dst, CheckpointId(s, 0))
    _flip(dst_root)
    with pytest.raises(Exception, match="checksum"):
        verify_checkpoint(dst, 3)

    def crash() -> int:  # killed after the first bytes of the new copy: nothing committed
        assert not dst.exists(manifest_name(3))
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_copy(dst, C3, crash)
    assert not dst.exists(manifest_name(3))  # uncommitted, never committed-but-broken
    assert destination_copy(src, dst, C3).state == "absent"  # a rerun copies it again
    assert replace_copy(dst, C3, lambda: copy_checkpoint(src, dst, C3)) > 0
    verify_checkpoint(dst, 3)
    assert destination_copy(src, dst, C3).state == "intact"
    assert _loads(dst_root, 3, "A")


def test_replace_copy_refuses_under_a_writer(tmp_path: Path) -> None:
    src = LocalBackend(_save(tmp_path / "src", "A"))
    dst = LocalBackend(tmp_path / "dst")
    copy_checkpoint(src, dst, C3)
    _flip(tmp_path / "dst")
    dst.put_atomic(lease_name(0), LeaseRecord.mine("c" * 32, 60.0).encode())  # this process
    before = dst.get(manifest_name(3))
    with pytest.raises(WriterConflict, match="damaged"):
        replace_copy(dst, C3, lambda: copy_checkpoint(src, dst, C3))
    assert dst.get(manifest_name(3)) == before


# -- the command, against S3 (moto) -------------------------------------------------------------
def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.s3
def test_pull_and_push_replace_a_damaged_copy(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    ep = ["--endpoint-url", moto_server.endpoint_url]
    src = _save(tmp_path / "src", "A")
    assert _run(["push", str(src), url, *ep, "--all"], capsys)[0] == 0
    local = tmp_path / "local"
    assert _run(["pull", url, str(local), *ep, "--all"], capsys)[0] == 0
    rc, out, _ = _run(["pull", url, str(local), *ep, "--step", "3"], capsys)
    assert rc == 0 and "skip step 3: already committed" in out, out

    _flip(local)  # the field test: one flipped byte in the local step-3 shard
    rc, out, err = _run(["pull", url, str(local), *ep, "--step", "3"], capsys)
    assert rc == 0, err
    assert "damaged" in err and "replaced the damaged copy of step 3" in out, (out, err)
    assert _run(["verify", str(local)], capsys)[0] == 0
    assert _loads(local, 3, "A")

    _flip(local, step=2)
    rc, out, err = _run(["pull", url, str(local), *ep, "--all"], capsys)
    assert rc == 0, err
    assert out.count("(verified intact)") == 2 and "replaced the damaged copy of step 2" in out, out
    assert _run(["verify", str(local)], capsys)[0] == 0

    # the S3 copy damaged: push replaces it from the local folder
    key = f"run/{shard_name(3, 0)}"
    body = bytearray(moto_server.admin.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[100] ^= 0x01
    moto_server.admin.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    assert _run(["verify", url, *ep, "--step", "3"], capsys)[0] == 1
    # an object store's copy is checked by its files' sizes and indexes and the chunks its
    # comparison reads (re-running push over a large run read every byte of it back)
    rc, out, err = _run(["push", str(src), url, *ep, "--all"], capsys)
    assert rc == 0 and "replaced the damaged copy of step 3" in out, (out, err)
    assert out.count("sizes and indexes checked; --verify reads it") == 2, (out, err)
    assert _run(["verify", url, *ep], capsys)[0] == 0
    # a truncated object is found without --verify
    key = f"run/{shard_name(2, 0)}"
    body = moto_server.admin.get_object(Bucket=bucket, Key=key)["Body"].read()
    moto_server.admin.put_object(Bucket=bucket, Key=key, Body=body[: len(body) // 2])
    rc, out, err = _run(["push", str(src), url, *ep, "--all"], capsys)
    assert rc == 0 and "replaced the damaged copy of step 2" in out, (out, err)
    assert "truncated" in err, err
    rc, out, err = _run(["push", str(src), url, *ep, "--all", "--verify"], capsys)
    assert rc == 0 and out.count("(verified intact)") == 3, (out, err)
    assert _run(["verify", url, *ep], capsys)[0] == 0


@pytest.mark.s3
def test_pull_does_not_take_another_runs_step_for_a_copy(
    tmp_path: Path,
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    ep = ["--endpoint-url", moto_server.endpoint_url]
    assert _run(["push", str(_save(tmp_path / "a", "A")), url, *ep, "--all"], capsys)[0] == 0
    local = _save(tmp_path / "b", "B")  # another run's steps 1..3 there
    before = (local / manifest_name(3)).read_bytes()
    rc, out, err = _run(["pull", url, str(local), *ep, "--step", "3"], capsys)
    assert rc == 1 and "already committed" not in out, (out, err)
    assert "another checkpoint" in err and "nothing was changed" in err, err
    assert (local / manifest_name(3)).read_bytes() == before and _loads(local, 3, "B")
    rc, out, err = _run(["pull", url, str(local), *ep, "--all"], capsys)
    assert rc == 1 and err.count("not copied") == 3, (out, err)


def test_another_timelines_step_is_not_a_copy(tmp_path: Path) -> None:
    """The source resumed from step 1: its step 3 is on timeline 1; the destination's step 3
    (timeline 0, the abandoned one) does not stand for it."""
    from tierckpt.offline import resolve_id

    root = _save(tmp_path / "src", "A")
    dst = LocalBackend(tmp_path / "dst")
    copy_checkpoint(LocalBackend(root), dst, C3)
    with Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=16 << 10) as ck:
        ck.load(1)
        for s in (2, 3):
            ck.save(_state(s, "B"), s).wait(timeout=60)
    src = LocalBackend(root)
    cid = resolve_id(src, 3, None)
    assert cid.timeline == 1
    assert destination_copy(src, dst, cid).state == "absent"
    copy_checkpoint(src, dst, cid)
    assert destination_copy(src, dst, cid).state == "intact"
    assert destination_copy(src, dst, C3).state == "intact"
