"""Load paths hand out (or copy elsewhere) only bytes that have arrived.

The class of bug: something consumes a tensor's bytes (copies them, writes them to another
tier, hands them to the caller) before the thread that fills them is done; it only shows when
the reads are slower than the consumer. Each test holds the producer back on purpose (a sleep
in the backend's reads, on the fetch/reader threads) and checks the consumer saw the right
bytes, so a wrong order fails every time rather than now and then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, tensors_in, trained_state

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.objstore._backend import ObjectStoreBackend
from tierckpt.format import shard_name

HOLD = 0.15  # seconds each held-back read waits before it fills its memory


def _state() -> dict[str, Any]:
    s = trained_state()
    g = torch.Generator().manual_seed(5)
    # several chunks, some spanning storages, and a tensor larger than a fetch segment
    s["embedding"] = torch.randn(3 << 20, generator=g)  # 12 MiB
    s["small"] = [torch.randn(1000 + i, generator=g) for i in range(8)]
    return s


def _hold_reads(monkeypatch: pytest.MonkeyPatch, cls: type, hold: float = HOLD) -> list[int]:
    """Every ``read_into``/``read_into_pieces`` of ``cls`` waits ``hold`` s before reading;
    returns a list counting the held reads (so a test can check it held anything)."""
    held: list[int] = []
    lock = threading.Lock()
    for meth in ("read_into", "read_into_pieces"):
        original = getattr(cls, meth)

        def slow(self: Any, *a: Any, _orig: Any = original, **kw: Any) -> Any:
            time.sleep(hold)
            with lock:
                held.append(1)
            return _orig(self, *a, **kw)

        monkeypatch.setattr(cls, meth, slow)
    return held


@pytest.fixture
def bucket(moto_server: Any, s3_bucket: Any) -> Iterator[tuple[Any, str]]:
    yield moto_server, s3_bucket(moto_server)


@pytest.mark.s3
@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_repopulated_copy_is_written_from_bytes_that_arrived(
    tmp_path: Path, bucket: tuple[Any, str], monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """A load from S3 copies the shard to the (empty) local tier while it reads. With every
    ranged GET held back, the local copy must still be the S3 object byte for byte (written
    after each piece arrived and verified), and a load from it alone gives the state."""
    server, name = bucket
    state = _state()

    def s3() -> S3Tier:
        return S3Tier(
            f"s3://{name}/run", endpoint_url=server.endpoint_url, part_size=5 << 20, codec=codec
        )

    with Checkpointer([s3()], chunk_bytes=3 << 20) as ck:
        ck.save(state, step=7).wait(timeout=120)
    held = _hold_reads(monkeypatch, ObjectStoreBackend)
    local = tmp_path / "nvme"
    with Checkpointer([LocalTier(local, keep_last=None), s3()]) as ck:
        assert_same(state, ck.load(step=7))
        assert ck.tier_steps()["local"] == [7], "the local tier was not repopulated"
    assert held, "the reads were not held back: the test checks nothing"
    monkeypatch.undo()
    key = f"run/{shard_name(7, 0)}"
    remote = server.admin.get_object(Bucket=name, Key=key)["Body"].read()
    copies = [p for p in local.rglob("*") if p.is_file() and p.name == Path(key).name]
    assert len(copies) == 1, sorted(str(p) for p in local.rglob("*"))
    assert copies[0].read_bytes() == remote
    with Checkpointer([LocalTier(local, keep_last=None)]) as ck:
        assert_same(state, ck.load(step=7))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_load_into_copies_only_after_every_chunk_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """``load(into=)`` copies into the caller's tensors; with the reads held back, the caller's
    tensors must end up exactly the saved ones (not the fresh storages' garbage)."""
    state = _state()
    with Checkpointer(
        [LocalTier(tmp_path, keep_last=None, codec=codec)], chunk_bytes=1 << 20
    ) as ck:
        ck.save(state, step=1).wait(timeout=120)
    target = _state()
    for t in tensors_in(target):
        t.fill_(7)  # the caller's memory: anything that is not the checkpoint's bytes
    held = _hold_reads(monkeypatch, LocalBackend)
    with Checkpointer([LocalTier(tmp_path, keep_last=None, codec=codec)]) as ck:
        out = ck.load(step=1, into=target)
    assert held, "the reads were not held back: the test checks nothing"
    assert out is target
    assert_same(state, target)


def test_export_writes_the_bytes_after_they_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tierckpt export`` (safetensors) writes the tensors of a shard it read on a pool:
    with the reads held back, every exported tensor must be the saved one."""
    pytest.importorskip("safetensors")
    from huggingface_hub import save_torch_state_dict  # noqa: F401  (imported: not timed)
    from safetensors.torch import load_file

    from tierckpt.export import export_safetensors

    g = torch.Generator().manual_seed(9)
    model = {"w": torch.randn(1 << 20, generator=g), "b": torch.randn(333, generator=g)}
    src = tmp_path / "ck"
    with Checkpointer([LocalTier(src, keep_last=None)], chunk_bytes=256 << 10) as ck:
        ck.save({"model": model}, step=3).wait(timeout=120)
    held = _hold_reads(monkeypatch, LocalBackend, hold=0.5)
    export_safetensors(LocalBackend(str(src)), 3, str(tmp_path / "out"))
    assert held, "the reads were not held back: the test checks nothing"
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(model)
    for k, v in model.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_dcp_load_copies_only_bytes_that_arrived(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str
) -> None:
    """``TierReader`` fetches each rank's shard on its own pool and copies (or reads straight)
    into the caller's tensors: with the reads held back, they must end up the saved ones."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter

    g = torch.Generator().manual_seed(4)
    saved = {f"t{i}": torch.randn(20_000 + 37 * i, generator=g) for i in range(6)}
    saved["m"] = torch.randn(400, 300, generator=g)
    tiers = [LocalTier(tmp_path, codec=codec, keep_last=None)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TierWriter(tiers, 1, chunk_bytes=64 << 10) as w:
            dcp.save(saved, storage_writer=w, no_dist=True)
        held = _hold_reads(monkeypatch, LocalBackend)
        target = {k: torch.full_like(v, 7.0) for k, v in saved.items()}
        dcp.load(target, storage_reader=TierReader(tiers, 1), no_dist=True)
    assert held, "the reads were not held back: the test checks nothing"
    for k, v in saved.items():
        assert torch.equal(target[k], v), k


def test_mapped_load_hands_out_the_state_only_after_every_checksum(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node-RAM load maps the shard and verifies its chunks on the read pool while it builds
    the tensors. With the checksums held back and one chunk corrupt, the mapped state must not
    be handed out: the disk tier serves the load."""
    from test_noderam_map import _equal, _save_and_die, _shard_path, _tiers, make_state

    from tierckpt import noderam_map
    from tierckpt.restore import read_index, read_manifest

    _save_and_die(shm, tmp_path / "disk", (1,))
    verified: list[int] = []
    original = noderam_map._verify

    def slow_verify(*a: Any, **kw: Any) -> None:
        time.sleep(HOLD)
        original(*a, **kw)
        verified.append(1)

    monkeypatch.setattr(noderam_map, "_verify", slow_verify)
    with Checkpointer(_tiers(shm, tmp_path / "disk")) as ck:
        path = _shard_path(ck, 1)
        b: Any = ck.backend("noderam")
        ref = read_manifest(b, 1, "noderam").shard_for(0)
        chunk = read_index(b, ref, "noderam")[0]["chunks"][-1]
        with open(path, "r+b") as f:  # one flipped byte in the last chunk
            f.seek(chunk.file_offset + chunk.stored_size // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        got = ck.load(step=1)
        assert verified, "the checksums were not held back: the test checks nothing"
        assert _equal(got, make_state(1)) == []


@pytest.mark.s3
def test_the_link_probe_reads_into_fresh_memory_never_the_loaded_state(
    bucket: tuple[Any, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a compressed load from a tier whose codec is ``auto``, the link probe reads a
    slice of the shard again, raw, on the read pool. Its reads must land in memory of its own:
    never in the storages of the state the load returns (nor the caller's ``into``)."""
    from tierckpt.checkpointer import _auto_feedback

    server, name = bucket
    # a probe of this small load (a real one skips loads under 4 x PROBE_MIN), all of it
    monkeypatch.setattr(_auto_feedback, "PROBE_MIN", 1 << 20)
    monkeypatch.setattr(_auto_feedback, "PROBE_FRACTION", 1)
    g = torch.Generator().manual_seed(2)
    state = {"w": (torch.randn(4 << 20, generator=g) * 4).round()}  # 16 MiB, compressible

    def s3(codec: str) -> S3Tier:
        return S3Tier(f"s3://{name}/run", endpoint_url=server.endpoint_url, codec=codec)

    with Checkpointer([s3("zstd")]) as ck:
        ck.save(state, step=1).wait(timeout=120)
    probing = threading.Event()
    dests: list[tuple[int, int]] = []
    original_probe = _auto_feedback.read_probe

    def probe(*a: Any, **kw: Any) -> float:
        probing.set()
        try:
            return original_probe(*a, **kw)
        finally:
            probing.clear()

    original_read = ObjectStoreBackend.read_into

    def read_into(self: Any, file: str, offset: int, out: memoryview) -> None:
        if probing.is_set():
            import numpy as np

            ptr = np.frombuffer(out, dtype=np.uint8).ctypes.data
            dests.append((ptr, ptr + len(out)))
        original_read(self, file, offset, out)

    monkeypatch.setattr(_auto_feedback, "read_probe", probe)
    monkeypatch.setattr(ObjectStoreBackend, "read_into", read_into)
    into = {"w": torch.zeros_like(state["w"])}
    with Checkpointer([s3("auto")]) as ck:
        ck.load(step=1, into=into)
    assert dests, "no link probe ran: the test checks nothing"
    assert torch.equal(into["w"], state["w"])
    a = into["w"].data_ptr()
    b = a + into["w"].numel() * into["w"].element_size()
    assert all(hi <= a or lo >= b for lo, hi in dests), "the probe read into the caller's tensor"
