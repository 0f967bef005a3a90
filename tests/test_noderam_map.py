"""A node-RAM restore maps the shard copy-on-write instead of copying it
(:mod:`tierckpt.noderam_map`).

Each test saves in a process that SIGKILLs itself (a crashed worker), then restores in this
one: the loaded tensors must lie inside a mapping of the shard file (``/proc/self/maps``;
storages under ``MAP_MIN_BYTES`` are copies), writes to them must never reach the committed
segment, a corrupt segment must still fail the load (the next tier serves it), and a segment
retention deleted while it is mapped must count against the node-RAM budget until the state
is dropped.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, NodeRamTier
from tierckpt.noderam_map import MAP_MIN_BYTES, live_mappings, unlinked_mapped_bytes
from tierckpt.restore import read_index, read_manifest

ROOT = Path(__file__).resolve().parents[1]

#: the saved state: several dtypes, a view sharing its base's storage, odd sizes, a scalar
STATE_CODE = """
import torch
def make_state(step):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(300, 257, generator=g)
    return {
        "w": w, "wt": w.t(),
        "b16": torch.randn(1001, generator=g).to(torch.bfloat16),
        "i16": torch.randint(-999, 999, (4097,), dtype=torch.int16, generator=g),
        "f64": torch.randn(33, generator=g, dtype=torch.float64),
        "c128": torch.randn(5, generator=g, dtype=torch.complex128),
        "u8": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "big": torch.randn(200_000, generator=g),
        "p": torch.nn.Parameter(torch.randn(64, generator=g)),
        "step": step,
    }
"""
_ns: dict[str, Any] = {}
exec(STATE_CODE, _ns)
make_state = _ns["make_state"]


def _save_and_die(shm: Path, disk: Path, steps: tuple[int, ...], codec: str = "raw") -> None:
    """Save ``steps`` to node RAM and disk in a fresh interpreter that SIGKILLs itself."""
    body = textwrap.dedent(STATE_CODE) + textwrap.dedent(
        f"""
        from tierckpt import Checkpointer, LocalTier, NodeRamTier
        ck = Checkpointer([NodeRamTier(path={str(shm)!r}, namespace="run", codec={codec!r},
                                       keep_last=None),
                           LocalTier({str(disk)!r})], chunk_bytes=256 << 10)
        for step in {steps!r}:
            ck.save(make_state(step), step).wait(timeout=60)
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def _tiers(shm: Path, disk: Path, **kw: Any) -> list[Any]:
    return [
        NodeRamTier(path=shm, namespace="run", stale_after_s=None, **kw),
        LocalTier(disk),
    ]


def _shard_path(ck: Checkpointer, step: int) -> str:
    b: Any = ck.backend("noderam")
    return str(b._path(read_manifest(b, step, "noderam").shard_for(0).file))


def _maps_of(path: str) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of ``path`` (deleted ones too)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip().removesuffix(" (deleted)") == path:
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b))
    return out


def _tensors(state: Any) -> list[torch.Tensor]:
    return [v for v in state.values() if isinstance(v, torch.Tensor) and v.numel()]


def _mapped(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    p = t.data_ptr()
    return any(a <= p < b for a, b in ranges)


def _equal(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    bad = []
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            if g.dtype != v.dtype or g.shape != v.shape or not torch.equal(g, v):
                bad.append(k)
        elif g != v:
            bad.append(k)
    return bad


def test_restore_maps_the_segment_and_writes_stay_private(shm: Path, tmp_path: Path) -> None:
    _save_and_die(shm, tmp_path / "disk", (1, 2))
    with Checkpointer(_tiers(shm, tmp_path / "disk")) as ck:
        path = _shard_path(ck, 2)
        got = ck.load()
        assert _equal(got, make_state(2)) == []
        ranges = _maps_of(path)
        assert ranges, "the load did not map the node-RAM segment"
        big = [t for t in _tensors(got) if t.untyped_storage().nbytes() >= MAP_MIN_BYTES]
        small = [t for t in _tensors(got) if t.untyped_storage().nbytes() < MAP_MIN_BYTES]
        assert big and all(_mapped(t, ranges) for t in big), "a tensor is a copy"
        # a small storage is a copy: kept alone, it would hold the whole segment
        assert small and not any(_mapped(t, ranges) for t in small), "a small one is mapped"
        assert got["wt"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()
        assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
        before = Path(path).read_bytes()
        # training writes into the restored tensors in place
        with torch.no_grad():
            for t in _tensors(got):
                t.zero_() if t.dtype == torch.uint8 else t.add_(1)
        assert Path(path).read_bytes() == before  # the committed segment never changes
        again = ck.load(step=2)
        assert _equal(again, make_state(2)) == []
        # and it still verifies chunk by chunk, also through the copying read path
        with Checkpointer(_tiers(shm, tmp_path / "disk", map=False)) as plain:
            copy = plain.load(step=2, tier="noderam")
            assert _equal(copy, make_state(2)) == []
            assert not any(_mapped(t, ranges) for t in _tensors(copy))
    del got, again, t, big, small
    gc.collect()
    assert not _maps_of(path)  # dropping the state unmaps it


def test_a_corrupt_segment_fails_the_mapped_load_and_the_disk_serves_it(
    shm: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save_and_die(shm, tmp_path / "disk", (1,))
    with Checkpointer(_tiers(shm, tmp_path / "disk")) as ck:
        path = _shard_path(ck, 1)
        b: Any = ck.backend("noderam")
        chunk = read_index(b, read_manifest(b, 1, "noderam").shard_for(0), "noderam")[0]["chunks"][
            -1
        ]
        with open(path, "r+b") as f:  # one flipped byte in the last chunk's data
            f.seek(chunk.file_offset + chunk.stored_size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        with caplog.at_level("WARNING", logger="tierckpt"):
            got = ck.load()
        assert _equal(got, make_state(1)) == []
        assert any("noderam" in r.message and "checksum" in r.message for r in caplog.records)
        assert not _maps_of(path) or not any(_mapped(t, _maps_of(path)) for t in _tensors(got))


def test_a_mapped_segment_deleted_by_retention_counts_against_the_budget(
    shm: Path, tmp_path: Path
) -> None:
    _save_and_die(shm, tmp_path / "disk", (1,))
    tiers = [
        NodeRamTier(path=shm, namespace="run", stale_after_s=None, keep_last=1),
        LocalTier(tmp_path / "disk"),
    ]
    with Checkpointer(tiers, chunk_bytes=256 << 10) as ck:
        b: Any = ck.backend("noderam")
        path = _shard_path(ck, 1)
        held = ck.load()  # kept alive, as a training script keeps its restored state
        size = os.stat(path).st_blocks * 512
        assert unlinked_mapped_bytes([b.root]) == 0
        ck.save(make_state(2), 2).wait(timeout=60)  # keep_last=1: step 1's file goes
        assert ck.tier_steps()["noderam"] == [2] and not os.path.exists(path)
        assert _maps_of(path), "the deleted segment is still mapped"
        gone = [m for m in live_mappings([b.root]) if m[0] == path]
        assert gone == [(path, size, True)]
        files_only = b.usage() - unlinked_mapped_bytes([b.root])
        assert unlinked_mapped_bytes([b.root]) == size and b.usage() == files_only + size
        assert _equal(held, make_state(1)) == []  # the state is intact meanwhile
        del held
        gc.collect()
        assert unlinked_mapped_bytes([b.root]) == 0 and not _maps_of(path)


def test_compressed_chunks_are_read_as_before(shm: Path, tmp_path: Path) -> None:
    _save_and_die(shm, tmp_path / "disk", (1,), codec="zstd")
    with Checkpointer(_tiers(shm, tmp_path / "disk", codec="zstd")) as ck:
        path = _shard_path(ck, 1)
        got = ck.load()
        assert _equal(got, make_state(1)) == []
        ranges = _maps_of(path)
        assert not any(_mapped(t, ranges) for t in _tensors(got))


def test_map_false_copies(shm: Path, tmp_path: Path) -> None:
    _save_and_die(shm, tmp_path / "disk", (1,))
    with Checkpointer(_tiers(shm, tmp_path / "disk", map=False)) as ck:
        assert ck.backend("noderam").map_reads is False  # type: ignore[attr-defined]
        path = _shard_path(ck, 1)
        got = ck.load()
        assert _equal(got, make_state(1)) == []
        assert not _maps_of(path)


@pytest.mark.gpu
def test_map_location_cuda_copies_from_the_mapping(shm: Path, tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _save_and_die(shm, tmp_path / "disk", (1,))
    with Checkpointer(_tiers(shm, tmp_path / "disk")) as ck:
        got = ck.load(map_location="cuda")
        assert all(t.is_cuda for t in _tensors(got))
        want = make_state(1)
        assert (
            _equal({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in got.items()}, want)
            == []
        )
        assert isinstance(got["p"], torch.nn.Parameter)
        assert got["wt"].untyped_storage().data_ptr() == got["w"].untyped_storage().data_ptr()


def test_a_device_target_copies_from_the_mapping_not_through_staging(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU: ``meta`` plays the device (the way the GPU-restore tests widen
    ``is_gpu``). A load onto the device takes the mapped shard and moves it there, storage by
    storage; the staging path (``read_shard_to_device``) is not used."""
    from tierckpt import restore_gpu
    from tierckpt.checkpointer import _loading

    _save_and_die(shm, tmp_path / "disk", (1,))
    monkeypatch.setattr(restore_gpu, "is_gpu", lambda d: d.type in ("cuda", "meta"))

    def staged(*a: Any, **k: Any) -> Any:
        raise AssertionError("read through the staging path")

    monkeypatch.setattr(_loading, "read_shard_to_device", staged)
    with Checkpointer(_tiers(shm, tmp_path / "disk")) as ck:
        got = ck.load(map_location="meta")
    want = make_state(1)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].device.type == "meta", k
            assert (got[k].dtype, got[k].shape, got[k].stride()) == (v.dtype, v.shape, v.stride())
    assert isinstance(got["p"], torch.nn.Parameter) and got["step"] == 1
