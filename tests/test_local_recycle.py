"""A local tier overwrites the shard files retention retires (tierckpt.backends._spares):
parked under ``.spare/`` after the manifest is gone, taken by the next save, zeroed where the
new file writes nothing and cut to its size; freed when space runs out, at ``close()``, and
by the next backend when their process died."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends import _spares
from tierckpt.backends._spares import SPARE_DIR
from tierckpt.backends.local import LocalBackend

MIB = 1 << 20


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 * MIB, generator=g), "b": torch.randn(1000, generator=g)}


def _spares_of(root: Path) -> list[Path]:
    folder = root / SPARE_DIR
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _shard_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 8 * MIB]


def test_the_next_save_overwrites_the_retired_shard_file(tmp_path: Path) -> None:
    held: list[int] = []
    try:
        with Checkpointer([LocalTier(tmp_path, keep_last=2)]) as ck:
            for step in range(3):
                ck.save(_state(step), step)
                ck.wait(retention=True)
            # step 0 retired: its shard file is parked, not deleted
            (parked,) = _spares_of(tmp_path)
            held.append(os.open(parked, os.O_RDONLY))  # its inode cannot be reused meanwhile
            inode = os.fstat(held[0]).st_ino
            ck.save(_state(3), 3)
            ck.wait(retention=True)
            assert not parked.exists()  # taken by step 3's shard file ...
            assert inode in {p.stat().st_ino for p in _shard_files(tmp_path)}  # ... same file
            assert len(_spares_of(tmp_path)) == 1  # step 1's, for the next save
            assert ck.steps() == [2, 3]
            for step in (2, 3):
                loaded = ck.load(step=step)
                for key, t in _state(step).items():
                    assert torch.equal(loaded[key], t)
        assert not (tmp_path / SPARE_DIR).exists()  # close() frees them
    finally:
        for fd in held:
            os.close(fd)


def test_compressed_saves_of_changing_size_load_bit_exact(tmp_path: Path) -> None:
    """Shard files that shrink and grow between saves (zstd on data of varying entropy)."""

    def state(step: int) -> dict[str, torch.Tensor]:
        w = torch.randn(4 * MIB, generator=torch.Generator().manual_seed(step))
        w[: (step % 3) * MIB // 2] = 0.0  # more or fewer compressible zeros: 11-15 MiB stored
        return {"w": w}

    with Checkpointer([LocalTier(tmp_path, keep_last=1, codec="zstd")]) as ck:
        for step in range(6):
            ck.save(state(step), step)
            ck.wait(retention=True)
            assert torch.equal(ck.load(step=step)["w"], state(step)["w"])
        assert len(_spares_of(tmp_path)) == 1


def test_a_reused_file_holds_what_a_fresh_one_would(tmp_path: Path) -> None:
    b = LocalBackend(tmp_path, recycle=True)
    b._spares.min_size = 1
    w = b.open_writer("old")
    w.write(0, b"\xff" * (3 * MIB))
    w.commit()
    b.delete("old")
    (parked,) = _spares_of(tmp_path)
    fd = os.open(parked, os.O_RDONLY)
    try:
        w = b.open_writer("steps/new")
        w.write(0, b"a" * 1000)
        w.write(8192, b"b" * 1000)  # 7192 bytes never written: zeros, as in a fresh file
        w.commit()
        assert (tmp_path / "steps" / "new").stat().st_ino == os.fstat(fd).st_ino
    finally:
        os.close(fd)
    assert (tmp_path / "steps" / "new").read_bytes() == b"a" * 1000 + bytes(7192) + b"b" * 1000
    assert b.list() == ["steps/new"] and b.incomplete() == []
    b.close()
    assert not (tmp_path / SPARE_DIR).exists()


def test_removals_are_durable_before_a_parked_file_can_be_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash must not bring back a manifest whose shard file was overwritten since."""
    synced: list[str] = []
    real = _spares._fsync_dir
    monkeypatch.setattr(_spares, "_fsync_dir", lambda d: (synced.append(d), real(d)))
    b = LocalBackend(tmp_path, recycle=True)
    b._spares.min_size = 4096  # the manifest is deleted, the shard file parked
    b.put_atomic("manifests/step-1.json", b"{}")
    w = b.open_writer("steps/1/shard")
    w.write(0, b"x" * 4096)
    w.commit()
    b.delete("manifests/step-1.json")  # retention: the manifest first ...
    assert synced == []
    b.delete("steps/1/shard")  # ... then the data, parked
    assert str(tmp_path / "manifests") in synced
    assert str(tmp_path / "steps" / "1") in synced
    assert str(tmp_path / SPARE_DIR) in synced
    assert len(b._spares) == 1
    b.close()


def test_no_space_frees_the_parked_files_and_writes_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = LocalBackend(tmp_path, recycle=True)
    b._spares.min_size = 1
    for name in ("a", "b"):
        w = b.open_writer(name)
        w.write(0, b"z" * 8192)
        w.commit()
    b.delete("a")
    b.delete("b")
    assert len(b._spares) == 2
    w = b.open_writer("c")  # takes one; the other stays parked
    real = os.pwrite
    failed: list[int] = []

    def pwrite(fd: int, data: object, offset: int) -> int:
        if not failed:
            failed.append(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwrite", pwrite)
    w.write(0, b"c" * 100)
    monkeypatch.setattr(os, "pwrite", real)
    w.commit()
    assert failed and len(b._spares) == 0 and _spares_of(tmp_path) == []
    assert (tmp_path / "c").read_bytes() == b"c" * 100


def test_without_recycling_retired_files_are_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_RECYCLE", "0")
    with Checkpointer([LocalTier(tmp_path, keep_last=1)]) as ck:
        for step in range(3):
            ck.save(_state(step), step)
            ck.wait(retention=True)
        assert not (tmp_path / SPARE_DIR).exists()
        assert len(_shard_files(tmp_path)) == 1


def test_parked_files_of_a_killed_writer_are_freed_by_the_next(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, torch
        from tierckpt import Checkpointer, LocalTier
        ck = Checkpointer([LocalTier({str(tmp_path)!r}, keep_last=1)])
        for step in range(2):
            ck.save({{"w": torch.full((3 << 20,), float(step))}}, step)
            ck.wait(retention=True)
        os._exit(0)  # killed: no close()
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert len(_spares_of(tmp_path)) == 1
    # a live process's parked file is left alone (taking it is a rename: it may be in use)
    own = tmp_path / SPARE_DIR / f"{os.getpid()}-0123456789ab.tmp"
    own.write_bytes(b"x")
    with Checkpointer([LocalTier(tmp_path, keep_last=1)]) as ck:
        assert _spares_of(tmp_path) == [own]
        assert torch.equal(ck.load()["w"], torch.full((3 << 20,), 1.0))
    own.unlink()


def test_node_ram_and_plain_backends_do_not_park(tmp_path: Path) -> None:
    """Node RAM counts its bytes in a budget, and a plain backend (the CLI's gc) frees what
    it deletes."""
    b = LocalBackend(tmp_path)
    w = b.open_writer("big")
    w.write(0, bytes(9 * MIB))
    w.commit()
    b.delete("big")
    assert _spares_of(tmp_path) == [] and b.list() == []
    from tierckpt.noderam import NodeRamBackend

    ram = NodeRamBackend(tmp_path / "ram", max_bytes=64 * MIB)
    w = ram.open_writer("big")
    w.write(0, bytes(9 * MIB))
    w.commit()
    ram.delete("big")
    assert _spares_of(tmp_path / "ram") == [] and ram.list() == []
