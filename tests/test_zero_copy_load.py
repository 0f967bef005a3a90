"""Zero-copy load: a chunk that spans several storages lands straight in them (a scatter read
on a local tier, a reused per-thread buffer elsewhere), never in a fresh chunk-sized scratch;
views, dtypes, strides and errors stay what they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, zoo_state

import tierckpt.restore as restore_mod
from tierckpt import (
    Checkpointer,
    CorruptCheckpoint,
    CorruptChunk,
    LocalTier,
    MemoryTier,
    StateMismatch,
)
from tierckpt.format import shard_name

CHUNK = 64 << 10


def many_small_state() -> dict[str, Any]:
    """Many tensors per chunk: storages of every size, views, a transposed and a strided view,
    two dtypes sharing one storage, empties."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(64, 128, generator=gen)
    shared = torch.randn(4096, generator=gen)
    state: dict[str, Any] = {
        f"p{i}": torch.randn(97 + 31 * i, generator=gen).to(
            torch.bfloat16 if i % 2 else torch.float32
        )
        for i in range(60)
    }
    state.update(
        base=base,
        rows=base[3:9],
        transposed=base.t(),
        strided=base[::3, 1::5],
        shared_f32=shared[:2048],
        shared_i32=shared[2048:].view(torch.int32),
        empty=torch.empty(0, 4),
        scalar=torch.tensor(3.5, dtype=torch.float64),
        big=torch.randn(70_000, generator=gen),  # spans two chunks
    )
    return state


def _roundtrip(tiers: list[Any], state: dict[str, Any], **kw: Any) -> dict[str, Any]:
    with Checkpointer(tiers, chunk_bytes=CHUNK, **kw) as ck:
        ck.save(state, step=1).wait()
        loaded = ck.load()
    assert isinstance(loaded, dict)
    return loaded


def _check_aliasing(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    assert_same(state, loaded)

    def sid(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    # views of one storage stay views of one storage, separate storages stay separate
    assert sid(loaded["rows"]) == sid(loaded["base"]) == sid(loaded["transposed"])
    assert sid(loaded["strided"]) == sid(loaded["base"])
    assert sid(loaded["shared_f32"]) == sid(loaded["shared_i32"])
    ptrs = [sid(loaded[f"p{i}"]) for i in range(60)]
    assert len(set(ptrs)) == 60 and sid(loaded["base"]) not in ptrs
    assert loaded["p3"].untyped_storage().nbytes() == state["p3"].untyped_storage().nbytes()
    assert loaded["transposed"].stride() == state["transposed"].stride()
    assert loaded["strided"].stride() == state["strided"].stride()
    loaded["rows"][0, 0] = 42.0
    assert loaded["base"][3, 0].item() == 42.0


@pytest.mark.parametrize("codec", ["raw", "zstd", "auto"])
def test_local_views_dtypes_strides_preserved(tmp_path: Path, codec: str) -> None:
    state = many_small_state()
    loaded = _roundtrip([LocalTier(tmp_path, codec=codec)], state)
    _check_aliasing(state, loaded)


def test_memory_tier_views_preserved() -> None:
    state = many_small_state()
    loaded = _roundtrip([MemoryTier(namespace="zc-mem")], state)
    _check_aliasing(state, loaded)


def test_remote_backend_path_preserves_views(tmp_path: Path, monkeypatch: Any) -> None:
    """A remote tier reads one range per chunk into a reused buffer, then copies it out."""
    from tierckpt.backends.local import LocalBackend

    monkeypatch.setattr(LocalBackend, "is_remote", property(lambda self: True))
    state = many_small_state()
    loaded = _roundtrip([LocalTier(tmp_path, codec="raw")], state)
    _check_aliasing(state, loaded)


def test_zoo_round_trip_small_chunks(tmp_path: Path) -> None:
    state = zoo_state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=4096) as ck:
        ck.save(state, step=1).wait()
        assert_same(state, ck.load())


def test_no_chunk_sized_scratch_from_a_local_tier(tmp_path: Path, monkeypatch: Any) -> None:
    """Chunks spanning several storages are read into the storages, not into a fresh buffer
    of the chunk's size that is then copied (the old path: every byte first-touched twice)."""
    state = {f"t{i}": torch.randn(1000 + i) for i in range(200)}  # ~800 KB, ~13 chunks
    with Checkpointer([LocalTier(tmp_path, codec="raw")], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).wait()
    sizes: list[int] = []
    real_empty = torch.empty

    def spy(*args: Any, **kw: Any) -> torch.Tensor:
        t = real_empty(*args, **kw)
        if t.dtype == torch.uint8:
            sizes.append(t.numel())
        return t

    monkeypatch.setattr(restore_mod.torch, "empty", spy)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        loaded = ck.load()
    monkeypatch.undo()
    assert_same(state, loaded)
    spans = {v.untyped_storage().nbytes() for v in state.values()}
    extra = [n for n in sizes if n not in spans]
    assert not extra, f"scratch buffers allocated while loading: {extra}"


def test_into_reads_into_callers_tensors_and_refuses_wrong_shapes(tmp_path: Path) -> None:
    state = many_small_state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).wait()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ptrs = {k: v.data_ptr() for k, v in target.items()}
        ck.load(into=target)
        assert {k: v.data_ptr() for k, v in target.items()} == ptrs
        for k in state:
            assert torch.equal(target[k], state[k]), k
        bad = dict(target, p0=torch.zeros(5))
        before = bad["p1"].clone()
        with pytest.raises(StateMismatch, match=r"\['p0'\].*torch.float32 \(97,\).*\(5,\)"):
            ck.load(into=bad)
        assert torch.equal(bad["p1"], before)  # nothing written on refusal


def _save_small(root: Path) -> None:
    state = {f"t{i}": torch.arange(3000, dtype=torch.float32) + i for i in range(40)}
    with Checkpointer([LocalTier(root, codec="raw")], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=7).wait()


def test_corrupt_chunk_across_storages_detected(tmp_path: Path) -> None:
    _save_small(tmp_path)
    f = tmp_path / shard_name(7, 0)
    data = bytearray(f.read_bytes())
    data[CHUNK + 12_345] ^= 0x01  # inside chunk 1, which spans several tensors
    f.write_bytes(data)
    ck = Checkpointer([LocalTier(tmp_path)])
    with ck, pytest.raises(CorruptCheckpoint, match=r"tier 'local'.*chunk 1 .*checksum") as ei:
        ck.load()
    assert isinstance(ei.value.__cause__, CorruptChunk)
    assert ei.value.__cause__.chunk == 1


def test_truncated_file_detected(tmp_path: Path) -> None:
    _save_small(tmp_path)
    f = tmp_path / shard_name(7, 0)
    os.truncate(f, f.stat().st_size - 100)
    ck = Checkpointer([LocalTier(tmp_path)])
    with ck, pytest.raises(CorruptCheckpoint, match=r"rank-000000\.tck.*truncated"):
        ck.load()


def test_scatter_read_short_file_is_an_error(tmp_path: Path) -> None:
    from tierckpt.backends.local import LocalBackend
    from tierckpt.errors import FormatError

    (tmp_path / "f").write_bytes(bytes(range(256)) * 4)
    b = LocalBackend(str(tmp_path))
    outs = [memoryview(bytearray(n)) for n in (3, 0, 500, 21)]
    b.read_into_pieces("f", 10, outs)
    assert b"".join(bytes(o) for o in outs) == (bytes(range(256)) * 4)[10:534]
    with pytest.raises(FormatError, match="past its end"):
        b.read_into_pieces("f", 600, [memoryview(bytearray(500))])


def test_span_layout_parts_gaps_and_hostile_layouts() -> None:
    from tierckpt.restore import _SpanLayout

    lay = _SpanLayout([0, 10, 30], [10, 10, 5])
    assert lay.parts(5, 35) == [(0, 5, 10), (1, 10, 20), (-1, 20, 30), (2, 30, 35)]
    assert lay.parts(32, 50) == [(2, 32, 35), (-1, 35, 50)]
    assert lay.parts(0, 0) == []
    overlapping = _SpanLayout([0, 5], [10, 10])
    assert overlapping.parts(0, 10) is None
    assert overlapping.overlaps(0, 10) == [(0, 0, 10), (1, 5, 10)]


def test_peak_memory_of_a_load_is_bounded(tmp_path: Path) -> None:
    """A 64 MiB load with 4 MiB chunks peaks well under state + a chunk per thread + slack
    (RSS high-water mark of a fresh process; generous: interpreter and torch vary)."""
    code = textwrap.dedent(
        f"""
        import json, torch
        from pathlib import Path
        from tierckpt import Checkpointer, LocalTier
        root = {str(tmp_path)!r}
        state = {{f"t{{i}}": torch.randn((16 << 20) // 400) for i in range(400)}}
        with Checkpointer([LocalTier(root, codec="raw")], chunk_bytes=4 << 20) as ck:
            ck.save(state, step=1).wait()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
    probe = textwrap.dedent(
        f"""
        import json, torch
        from pathlib import Path
        from tierckpt import Checkpointer, LocalTier
        def hwm():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        def rss():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        ck = Checkpointer([LocalTier({str(tmp_path)!r})], io_threads=2)
        base = rss()
        state = ck.load()
        n = sum(v.numel() * v.element_size() for v in state.values())
        print(json.dumps({{"base": base, "hwm": hwm(), "bytes": n}}))
        ck.close()
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], check=True, env=env, capture_output=True, text=True
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    extra = got["hwm"] - got["base"] - got["bytes"]
    assert got["bytes"] > 60 << 20
    assert extra < 48 << 20, f"a 64 MiB load peaked {extra / 2**20:.0f} MiB above the state"
