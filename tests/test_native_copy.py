"""The streaming-store host copy (tierckpt._native): the same bytes as memcpy at every
alignment and length, saves that load back bit-exact with it and without it, a silent
fallback to memmove when it cannot be built, two processes building it at once, and a chunk
whose source changed between its hash and its copy failing its load loudly."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, CorruptCheckpoint, LocalTier, _native, config
from tierckpt import capture as capture_mod
from tierckpt.errors import CorruptChunk

ROOT = Path(__file__).resolve().parent.parent


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC") or "cc")


def _native_or_skip() -> Any:
    """The compiled copy, or a skip saying why it is not there."""
    if _compiler() is None:
        pytest.skip("no C compiler (cc / $CC) to build the streaming-store copy")
    if not _native.wait(120):
        pytest.skip(f"the streaming-store copy is not built here: {_native._state.why_not}")
    return _native.copier()


@pytest.fixture
def fresh_native(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A process that has not looked for the helper yet, with an empty cache folder."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(_native, "_state", _native._State())
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def _state() -> dict[str, Any]:
    """Big tensors (split among copy threads, cut in hash blocks) at odd byte offsets, many
    small ones, odd lengths, several dtypes."""
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 255, (9 << 20,), dtype=torch.uint8, generator=g)
    s: dict[str, Any] = {f"s{i}": torch.randn(1 + i * 37, generator=g) for i in range(40)}
    s.update(
        big=torch.randn(3 << 20, generator=g),
        odd=raw[3 : 3 + (5 << 20) + 7],  # a view at an odd byte offset, odd length
        bf16=torch.randn(1_000_003, generator=g).to(torch.bfloat16),
        ints=torch.arange(70_001, dtype=torch.int64),
        step=11,
    )
    return s


def _save_lazily(ck: Checkpointer, state: Any, step: int) -> None:
    """Save without waiting for the capture (its chunks are hashed as they are copied)."""
    h = ck.save(state, step)
    deadline = time.monotonic() + 60
    while not h.done():
        assert time.monotonic() < deadline, "save did not finish"
        time.sleep(0.005)
    h.wait()


LENGTHS = [0, 1, 15, 16, 17, 31, 33, 63, 64, 65, 127, 129, 4095, 4096, 4097, 65_537, 3 << 20]


@pytest.mark.parametrize("src_off", [0, 1, 7, 16, 31])
@pytest.mark.parametrize("dst_off", [0, 1, 15, 16, 17, 33])
def test_native_copy_gives_the_bytes_memcpy_gives(src_off: int, dst_off: int) -> None:
    fn = _native_or_skip()
    g = torch.Generator().manual_seed(src_off * 64 + dst_off)
    src = torch.randint(0, 255, (max(LENGTHS) + 64,), dtype=torch.uint8, generator=g)
    for gil in (False, True):
        fn = _native.copier(gil=gil)
        for n in LENGTHS:
            dst = torch.full((n + 128,), 0xA5, dtype=torch.uint8)
            fn(dst.data_ptr() + dst_off, src.data_ptr() + src_off, n)
            assert torch.equal(dst[dst_off : dst_off + n], src[src_off : src_off + n]), n
            # nothing written before or after the destination range
            assert bool((dst[:dst_off] == 0xA5).all()) and bool((dst[dst_off + n :] == 0xA5).all())


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("lazy", [True, False])
def test_saves_load_back_bit_exact_with_and_without_the_native_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool, lazy: bool
) -> None:
    if native:
        _native_or_skip()
    else:
        monkeypatch.setattr(_native._state, "nogil", None)
        monkeypatch.setattr(_native._state, "gil", None)
    used: list[int] = []
    real = capture_mod._copy_bytes

    def spy(dst: int, src: int, n: int) -> None:
        used.append(int(_native.copier() is not None))
        real(dst, src, n)

    monkeypatch.setattr(capture_mod, "_copy_bytes", spy)
    state = _state()
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=4 << 20) as ck:
        for step in (1, 2):
            state["step"] = step
            state["big"].add_(1.0)
            if lazy:
                _save_lazily(ck, state, step)
            else:
                ck.save(state, step).wait()
        assert_same(state, ck.load(step=2))
    assert used and set(used) == {int(native)}


@pytest.mark.parametrize("how", ["CC=/bin/false", "no cc on PATH", "TIERCKPT_NATIVE_COPY=0"])
def test_without_a_compiler_saves_use_memmove_and_load_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_native: Path, how: str
) -> None:
    if how == "CC=/bin/false":
        monkeypatch.setenv("CC", "/bin/false")
    elif how == "no cc on PATH":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    else:
        monkeypatch.setenv("TIERCKPT_NATIVE_COPY", "0")
    assert _native.wait(60) is False
    assert _native.copier() is None and _native.copier(gil=True) is None
    assert _native._state.why_not
    state = _state()
    with Checkpointer([LocalTier(tmp_path / "ck")], chunk_bytes=4 << 20) as ck:
        _save_lazily(ck, state, 1)
        ck.save(state, 2).wait()
        assert_same(state, ck.load(step=1))
        assert_same(state, ck.load(step=2))
    # nothing half-built left behind
    folder = fresh_native / "tierckpt" / "native"
    assert not folder.exists() or not list(folder.iterdir())


def test_the_knob_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERCKPT_NATIVE_COPY", raising=False)
    assert config.native_copy() is True
    monkeypatch.setenv("TIERCKPT_NATIVE_COPY", "off")
    assert config.native_copy() is False
    monkeypatch.setenv("TIERCKPT_NATIVE_COPY", "maybe")
    with pytest.raises(ValueError, match="TIERCKPT_NATIVE_COPY"):
        config.native_copy()


def test_a_bad_knob_is_refused_when_the_writer_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_native: Path
) -> None:
    # as every other knob: a ValueError in the caller, not a traceback of the build's thread
    # (and a save that went on as if nothing was said)
    monkeypatch.setenv("TIERCKPT_NATIVE_COPY", "nah")
    with pytest.raises(ValueError, match="TIERCKPT_NATIVE_COPY='nah'"):
        Checkpointer([LocalTier(tmp_path / "ck")])
    assert not _native._state.started


_BUILD = """
import sys
from tierckpt import _native
ok = _native.wait(300)
print("OK" if ok else "NO " + _native._state.why_not)
"""


def test_two_processes_building_at_once_both_get_a_working_copy(tmp_path: Path) -> None:
    if _compiler() is None:
        pytest.skip("no C compiler (cc / $CC) to build the streaming-store copy")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop("TIERCKPT_NATIVE_COPY", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", _BUILD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["OK", "OK"], outs
    files = sorted(p.name for p in (tmp_path / "tierckpt" / "native").iterdir())
    assert len(files) == 1 and files[0].endswith(".so"), files  # no temporary file left


def test_a_source_changed_between_its_hash_and_its_copy_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused hash reads each block's source before it is copied; a source written in
    between (the state changed during its capture, against the rules) is stored with a
    checksum that does not match it: loading it raises, never returns other bytes."""
    state = {"w": torch.zeros(6 << 20, dtype=torch.uint8)}
    real = capture_mod._copy_bytes
    hit: list[int] = []

    def write_then_copy(dst: int, src: int, n: int) -> None:
        # on the capture thread, which hashes its blocks before copying them (a helper
        # thread's blocks are hashed after it copied them)
        if not hit and threading.current_thread().name != "tierckpt-copy":
            ctypes.memset(src + n // 2, 0x5A, 1)  # after it was hashed, before it is copied
            hit.append(n)
        real(dst, src, n)

    monkeypatch.setattr(capture_mod, "_copy_bytes", write_then_copy)
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=4 << 20) as ck:
        _save_lazily(ck, state, 1)
        assert hit
        with pytest.raises(CorruptCheckpoint, match="does not match its checksum") as ei:
            ck.load(step=1)
        assert isinstance(ei.value.__cause__, CorruptChunk)


def test_the_self_check_catches_a_wrong_copy_without_a_python_step_per_byte() -> None:
    """The self-check runs on a thread started with every Checkpointer, often while a load
    starts: its test bytes are made without a Python step per byte (which held the GIL for
    ms), and it still refuses a copy that gives wrong bytes."""
    fn = _native_or_skip()
    lines = 0

    def tracer(frame: Any, event: str, _arg: Any) -> Any:
        nonlocal lines
        lines += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        _native._self_check(fn)
    finally:
        sys.settrace(None)
    assert lines < 2000  # (a step per byte: more than 12,000)

    def off_by_one(dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src + 1, n)

    with pytest.raises(OSError, match="wrong bytes"):
        _native._self_check(off_by_one)
