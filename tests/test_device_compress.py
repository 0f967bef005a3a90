"""Compress on the device, then copy: a tier whose codec is nvCOMP gets chunks compressed on
the state's device (byte planes split there, pieces in nvCOMP's RAW mode), and only the stored
bytes go into the arena. Proven on the CPU: the device path runs on host tensors with a CPU
imitation of nvCOMP (tests/test_codecs.py) and the fake CUDA surface, and the stored chunks
decode exactly with the CPU libraries."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fake_cuda
import pytest
import torch
from test_codecs import _FakeBatch, _FakeNvCodec

from tierckpt import Checkpointer, LocalTier, capture
from tierckpt.codecs import nvcomp as nvcomp_mod
from tierckpt.codecs.nvcomp import NvcompCodec


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    fake_cuda.install(monkeypatch)
    fake_cuda.state_on_device(monkeypatch, 0)
    fake = SimpleNamespace(
        Codec=_FakeNvCodec,
        BitstreamKind=SimpleNamespace(RAW="RAW"),
        as_array=lambda t, cuda_stream=0: t,
        as_arrays=lambda buf, offsets, sizes, cuda_stream=0: _FakeBatch(buf, offsets, sizes),
    )
    monkeypatch.setattr(nvcomp_mod, "_nvcomp", lambda: fake)
    monkeypatch.setattr(nvcomp_mod, "_on_gpu", lambda t: True)
    monkeypatch.setattr(nvcomp_mod, "_stream_of", lambda device: 0)
    monkeypatch.setattr(nvcomp_mod, "_cuda_available", lambda: False)
    monkeypatch.setattr(capture, "_device_compressible", lambda device: True)
    sizes: list[int] = []
    real = capture.compress_chunk

    def recording(*a: Any, **k: Any) -> Any:
        out = real(*a, **k)
        if out is not None:
            sizes.append(out[0])
        return out

    from tierckpt.pipeline import _capture as capture_mod

    monkeypatch.setattr(capture_mod, "compress_chunk", recording)
    return sizes


def _weights() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    scales = torch.logspace(-3, -1, 16)
    w = (torch.randn(16, 40_000, generator=g) * scales[:, None]).bfloat16()
    return {"w": w, "m": torch.zeros(50_000), "step": 2}


def test_nvcomp_tier_gets_device_compressed_chunks_that_decode_on_the_cpu(
    device_path: list[int], tmp_path: Path
) -> None:
    state = _weights()
    tier = LocalTier(tmp_path, codec=NvcompCodec("zstd", piece_bytes=1 << 16))
    with Checkpointer([tier], chunk_bytes=256 << 10, host_buffer_bytes=4 << 20) as ck:
        h = ck.save(state, step=1)
        res = h.result()
    assert device_path, "no chunk was compressed on the device"
    raw = state["w"].nbytes + state["m"].nbytes
    assert sum(device_path) < raw * 0.85  # >= 15% fewer bytes cross PCIe
    assert res["local"].stored_bytes < raw * 0.85
    assert res["local"].codec == "nvcomp"
    # a machine without a GPU restores it with the CPU libraries, exactly
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        got = ck.load()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["m"], state["m"])
    assert got["step"] == 2


def test_raw_tier_alongside_keeps_the_raw_path(device_path: list[int], tmp_path: Path) -> None:
    """A tier that wants raw bytes next to the nvCOMP tier: chunks are copied raw once (no
    device compression), and both tiers restore exactly."""
    state = _weights()
    tiers = [
        LocalTier(tmp_path / "a"),
        LocalTier(tmp_path / "b", name="s", codec=NvcompCodec("zstd")),
    ]
    with Checkpointer(tiers, chunk_bytes=256 << 10, host_buffer_bytes=4 << 20) as ck:
        ck.save(state, step=1).wait()
    assert device_path == []
    for sub, name in (("a", "local"), ("b", "s")):
        with Checkpointer([LocalTier(tmp_path / sub, name=name)]) as ck:
            got = ck.load()
        assert torch.equal(got["w"], state["w"]) and torch.equal(got["m"], state["m"])
