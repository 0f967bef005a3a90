"""Codecs: each one passes the shared ``CodecTests``; plus the registry, planes, nvcomp, auto.

Run ``python tests/test_codecs.py`` to regenerate the golden files after an intended format
change (never run by the tests).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tierckpt.codecs import (
    Codec,
    PlanesCodec,
    RawCodec,
    ZstdCodec,
    codec_from_config,
    codec_ids,
    get_codec,
    register_codec,
    register_lazy_codec,
)
from tierckpt.codecs import planes as planes_mod
from tierckpt.codecs.auto import (
    CodecProfile,
    choose_codec,
    measure_codec,
    transfer_seconds,
)
from tierckpt.codecs.nvcomp import CPU_DECODABLE, NvcompCodec
from tierckpt.errors import CorruptChunk, UnknownCodec
from tierckpt.testing.codecs import (
    CodecTests,
    float_specials,
    golden_input,
    golden_name,
    regenerate_golden,
    roundtrip,
)

GOLDEN = Path(__file__).parent / "fixtures" / "codecs"
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


class TestRaw(CodecTests):
    golden_dir = GOLDEN

    @pytest.fixture
    def codec(self) -> Codec:
        return RawCodec()


class TestZstd(CodecTests):
    golden_dir = GOLDEN

    @pytest.fixture(params=[(1, 1), (1, 2), (3, 1), (3, 2)], ids=lambda p: f"l{p[0]}t{p[1]}")
    def codec(self, request: pytest.FixtureRequest) -> Codec:
        level, threads = request.param
        return ZstdCodec(level=level, threads=threads)


class TestPlanes(CodecTests):
    golden_dir = GOLDEN

    @pytest.fixture(params=[1, 2, 4, 8], ids=lambda s: f"itemsize{s}")
    def codec(self, request: pytest.FixtureRequest) -> Codec:
        return PlanesCodec(itemsize=request.param)


class TestPlanesSmallSegments(CodecTests):
    """Many segments per chunk: the threaded paths and the segment table get exercised."""

    golden_dir = GOLDEN

    @pytest.fixture(autouse=True)
    def _small_segments(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(planes_mod, "_SEGMENT_BYTES", 4096)

    @pytest.fixture(params=[(2, 1), (4, 2), (2, 3)], ids=lambda p: f"itemsize{p[0]}t{p[1]}")
    def codec(self, request: pytest.FixtureRequest) -> Codec:
        itemsize, threads = request.param
        return PlanesCodec(itemsize=itemsize, threads=threads)

    def test_golden(self, codec: Codec) -> None:  # same format as TestPlanes: covered there
        pytest.skip("golden files are covered by TestPlanes")


class TestPlanesLevel(CodecTests):
    """A plain zstd level instead of the tuned entropy-first parameters."""

    golden_dir = GOLDEN

    @pytest.fixture
    def codec(self) -> Codec:
        return PlanesCodec(itemsize=2, level=3)


class TestNvcompCpu(CodecTests):
    """nvcomp framing with the CPU libraries: what a machine without a GPU writes and reads."""

    golden_dir = GOLDEN

    @pytest.fixture(autouse=True)
    def _cpu_only(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr("tierckpt.codecs.nvcomp._cuda_available", lambda: False)

    @pytest.fixture(
        params=[("zstd", 1), ("deflate", 1), ("lz4", 1), ("zstd", 2), ("deflate", 4)],
        ids=lambda p: f"{p[0]}-itemsize{p[1]}",
    )
    def codec(self, request: pytest.FixtureRequest) -> Codec:
        algorithm, itemsize = request.param
        return NvcompCodec(algorithm, itemsize=itemsize)


@gpu
@needs_cuda
class TestNvcompGpu(CodecTests):
    golden_dir = None

    @pytest.fixture(
        params=["zstd", "deflate", "lz4", "ans", "bitcomp", "gdeflate"],
    )
    def codec(self, request: pytest.FixtureRequest) -> Codec:
        return NvcompCodec(request.param)

    def test_bit_flips(self, codec: Codec) -> None:
        # nvCOMP's GPU decoders assume valid pieces (NVIDIA documents that several cannot
        # detect bad input); chunks reach decode only after their checksum passed. The
        # framing itself is checked by the CPU tests and test_truncated / test_not_a_chunk.
        pytest.skip("nvCOMP GPU decoders assume checksum-verified input")


# -- planes specifics ----------------------------------------------------------------------


def test_planes_for_dtype() -> None:
    codec = PlanesCodec()
    assert codec.for_dtype("float32") == PlanesCodec(itemsize=4)
    assert codec.for_dtype("bfloat16") == PlanesCodec(itemsize=2)
    assert codec.for_dtype("torch.float16") == PlanesCodec(itemsize=2)
    assert codec.for_dtype("float64") == PlanesCodec(itemsize=8)
    assert codec.for_dtype("float8_e4m3fn") == PlanesCodec(itemsize=1)
    assert codec.for_dtype("int64") == ZstdCodec(level=1)
    assert codec.for_dtype("bool") == ZstdCodec(level=1)
    threaded = PlanesCodec(itemsize=4, threads=1, level=3)
    assert threaded.for_dtype("bfloat16") == PlanesCodec(itemsize=2, threads=1, level=3)


@pytest.mark.parametrize(
    "kwargs",
    [{"itemsize": 3}, {"itemsize": True}, {"threads": 0}, {"level": 99}, {"coder": "lzma"}],
)
def test_planes_rejects_bad_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        PlanesCodec(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(UnknownCodec):
        codec_from_config({"id": "planes", **kwargs, "bogus": 1})


def test_planes_compresses_weights_like_data() -> None:
    weights = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16()
    raw = weights.view(torch.uint8).numpy().tobytes()
    encoded = PlanesCodec(itemsize=2).encode(raw)
    # the exponent plane carries ~2.7 bits of 8; mantissa planes stay raw
    assert len(encoded) < 0.72 * len(raw)
    zeros_heavy = np.zeros(1 << 20, np.float32)
    zeros_heavy[::7] = 1.5
    assert len(PlanesCodec(itemsize=4).encode(zeros_heavy.tobytes())) < 0.05 * zeros_heavy.nbytes


def test_planes_output_independent_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_mod, "_SEGMENT_BYTES", 1 << 14)
    raw = float_specials(torch.float32, 100_001)
    outputs = {bytes(PlanesCodec(itemsize=4, threads=t).encode(raw)) for t in (1, 2, 4)}
    assert len(outputs) == 1


def _planes_chunk(
    *,
    itemsize: int = 2,
    raw_len: int = 8,
    seg_elems: int = 4,
    entries: list[tuple[int, int]] | None = None,
    payload: bytes = b"",
    magic: bytes = b"TCPL",
    version: int = 1,
) -> bytes:
    entries = entries if entries is not None else []
    head = struct.pack("<4sBBHQII", magic, version, itemsize, 0, raw_len, seg_elems, len(entries))
    lengths = b"".join(struct.pack("<I", n) for _, n in entries)
    modes = bytes(m for m, _ in entries)
    return head + lengths + modes + payload


def test_planes_hostile_headers() -> None:
    codec = PlanesCodec(itemsize=2)
    out = memoryview(bytearray(8))
    good = _planes_chunk(entries=[(0, 4), (0, 4)], payload=bytes(8))
    codec.decode(good, out)  # a well-formed hand-made chunk decodes
    hostile = [
        _planes_chunk(magic=b"XXXX", entries=[(0, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(version=9, entries=[(0, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(itemsize=4, entries=[(0, 2)] * 4, payload=bytes(8)),
        _planes_chunk(raw_len=1 << 40, entries=[(0, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(seg_elems=0, entries=[(0, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(seg_elems=1, entries=[(0, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(entries=[(0, 4)] * 2 + [(0, 0)] * 1000, payload=bytes(8)),
        _planes_chunk(entries=[(2, 4), (0, 4)], payload=bytes(8)),
        _planes_chunk(entries=[(0, 5), (0, 3)], payload=bytes(8)),
        _planes_chunk(entries=[(1, 4), (0, 4)], payload=bytes(8)),  # "zstd" as long as raw
        _planes_chunk(entries=[(1, 3), (0, 4)], payload=b"\x28\xb5\x2f" + bytes(4)),
        _planes_chunk(entries=[(0, 4), (0, 4)], payload=bytes(7)),
        _planes_chunk(entries=[(0, 4), (0, 4)], payload=bytes(9)),
        _planes_chunk(entries=[(0, 0xFFFFFFFF), (0, 4)], payload=bytes(8)),
    ]
    for chunk in hostile:
        with pytest.raises(CorruptChunk):
            codec.decode(chunk, out)


def test_planes_zstd_frame_that_lies_about_its_size() -> None:
    import zstandard

    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(1 << 20))
    chunk = _planes_chunk(raw_len=8, entries=[(1, len(bomb)), (0, 4)], payload=bomb + bytes(4))
    with pytest.raises(CorruptChunk):
        PlanesCodec(itemsize=2).decode(chunk, memoryview(bytearray(8)))


# -- nvcomp --------------------------------------------------------------------------------


def test_nvcomp_config_roundtrip_and_validation() -> None:
    codec = NvcompCodec("deflate", piece_bytes=1 << 14, options={"algorithm_type": 0})
    config = json.loads(json.dumps(codec.get_config()))
    assert config == {
        "id": "nvcomp",
        "algorithm": "deflate",
        "piece_bytes": 16384,
        "itemsize": 1,
        "options": {"algorithm_type": 0},
    }
    assert codec_from_config(config) == codec
    assert get_codec("nvcomp") is NvcompCodec
    assert codec.for_dtype("bfloat16") == NvcompCodec(
        "deflate", piece_bytes=1 << 14, itemsize=2, options={"algorithm_type": 0}
    )
    for bad in (
        {"algorithm": "brotli"},
        {"piece_bytes": 100},
        {"piece_bytes": 1 << 30},
        {"algorithm": "deflate", "piece_bytes": 1 << 20},
        {"itemsize": 3},
        {"options": {"x": [1]}},
    ):
        with pytest.raises(ValueError):
            NvcompCodec(**bad)  # type: ignore[arg-type]


def test_nvcomp_cpu_decodable_flags() -> None:
    assert {"zstd", "deflate", "lz4"} == CPU_DECODABLE
    assert NvcompCodec("zstd").cpu_decodable
    for algorithm in ("ans", "bitcomp", "gdeflate", "cascaded", "snappy"):
        assert not NvcompCodec(algorithm).cpu_decodable


def test_nvcomp_gpu_only_algorithm_without_gpu_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierckpt.codecs.nvcomp._cuda_available", lambda: False)
    zstd_chunk = bytes(NvcompCodec("zstd").encode(bytes(1000)))
    ans = NvcompCodec("ans")
    with pytest.raises(UnknownCodec, match="GPU"):
        ans.decode(zstd_chunk, memoryview(bytearray(1000)))
    with pytest.raises(UnknownCodec, match="GPU"):
        ans.encode(bytes(1000))


def test_nvcomp_cpu_decodes_standard_streams() -> None:
    """Pieces written by the reference CPU libraries, in the nvcomp framing, decode exactly."""
    import zlib

    import lz4.block
    import zstandard

    raw = golden_input()
    piece = 1 << 14
    pieces = [raw[i : i + piece] for i in range(0, len(raw), piece)]
    compressors = {
        # zstd frames without a content size, as a streaming GPU encoder may write them
        "zstd": lambda b: zstandard.ZstdCompressor(write_content_size=False).compress(b),
        "deflate": lambda b: (lambda c: c.compress(b) + c.flush())(zlib.compressobj(9, 8, -15)),
        "lz4": lambda b: lz4.block.compress(b, store_size=False, mode="high_compression"),
    }
    for algorithm, compress in compressors.items():
        frames = [compress(p) for p in pieces]
        head = struct.pack(
            "<4sBBBBQII",
            b"TCNV",
            1,
            ["zstd", "deflate", "lz4"].index(algorithm),
            1,
            0,
            len(raw),
            piece,
            len(frames),
        )
        chunk = bytearray(head + b"".join(struct.pack("<I", len(f)) for f in frames))
        for frame in frames:
            chunk += bytes(-len(chunk) % 16) + frame
        codec = NvcompCodec(algorithm, piece_bytes=piece)
        out = bytearray(len(raw))
        codec.decode_cpu(bytes(chunk), memoryview(out))
        assert bytes(out) == raw, algorithm
        chunk[-1] ^= 0x55
        try:
            codec.decode_cpu(bytes(chunk), memoryview(out))
        except CorruptChunk:
            pass


def test_nvcomp_decode_cpu_rejects_hostile_framing() -> None:
    codec = NvcompCodec("zstd", piece_bytes=1 << 14)
    good = bytes(codec.encode_cpu(golden_input()))
    out = memoryview(bytearray(len(golden_input())))
    codec.decode_cpu(good, out)
    for pos in (0, 4, 5, 6, 7, 8, 16, 20, 24):
        bad = bytearray(good)
        bad[pos] ^= 0x40
        with pytest.raises(CorruptChunk):
            codec.decode_cpu(bytes(bad), out)
    with pytest.raises(CorruptChunk):
        NvcompCodec("deflate", piece_bytes=1 << 14).decode_cpu(good, out)


class _FakeBatch:
    """Stands in for ``nvidia.nvcomp.BatchArray``: pieces of one tensor at given offsets."""

    def __init__(self, buffer: torch.Tensor, offsets: list[int], sizes: list[int]) -> None:
        self.buffer, self.offsets, self.sizes = buffer, list(offsets), list(sizes)

    @property
    def buffer_sizes(self) -> list[int]:
        return list(self.sizes)

    def piece(self, i: int) -> torch.Tensor:
        return self.buffer[self.offsets[i] : self.offsets[i] + self.sizes[i]]


class _FakeNvCodec:
    """A CPU imitation of ``nvidia.nvcomp.Codec`` in RAW mode (zstd level 1, like the CPU
    encoder), so the GPU code paths' offsets, packing and framing run without a GPU."""

    def __init__(self, **kwargs: object) -> None:
        assert kwargs["algorithm"] == "Zstd" and kwargs["bitstream_kind"] == "RAW"
        self.kwargs = kwargs

    def get_max_comp_buffer_size(self, array: torch.Tensor) -> int:
        n = array.numel()
        return n + (n >> 8) + 1024

    def encode(self, batch: _FakeBatch, out: _FakeBatch) -> _FakeBatch:
        import zstandard

        sizes = []
        for i in range(len(batch.sizes)):
            packed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(
                batch.piece(i).numpy().tobytes()
            )
            assert len(packed) <= out.sizes[i]
            out.buffer[out.offsets[i] : out.offsets[i] + len(packed)] = torch.frombuffer(
                bytearray(packed), dtype=torch.uint8
            )
            sizes.append(len(packed))
        return _FakeBatch(out.buffer, out.offsets, sizes)

    def decode(self, batch: _FakeBatch, out: _FakeBatch) -> _FakeBatch:
        import zstandard

        sizes = []
        for i in range(len(batch.sizes)):
            raw = zstandard.ZstdDecompressor().decompress(batch.piece(i).numpy().tobytes())
            out.piece(i)[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            sizes.append(len(raw))
        return _FakeBatch(out.buffer, out.offsets, sizes)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    import tierckpt.codecs.nvcomp as nvcomp_mod

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


@pytest.mark.usefixtures("fake_gpu")
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 5, 4096, 200_003])
def test_nvcomp_device_paths_with_fake_nvcomp(itemsize: int, n: int) -> None:
    """The GPU paths (imitated on the CPU) write exactly the framing the CPU encoder writes."""
    raw = float_specials(torch.bfloat16, n // 2 + 1)[:n]
    codec = NvcompCodec("zstd", piece_bytes=1 << 12, itemsize=itemsize)
    stored_t = codec.encode_device(torch.from_numpy(np.frombuffer(raw, np.uint8).copy()))
    stored = stored_t.numpy().tobytes()
    assert stored == bytes(codec.encode_cpu(raw))
    out = bytearray(len(raw))
    codec.decode_cpu(stored, memoryview(out))
    assert bytes(out) == raw
    for source in (stored, stored_t):
        back = torch.full((n,), 7, dtype=torch.uint8)
        codec.decode_device(source, back)
        assert back.numpy().tobytes() == raw
    if stored_t.numel() > 40:
        with pytest.raises(CorruptChunk):
            codec.decode_device(stored_t[:-1], torch.empty(n, dtype=torch.uint8))


@gpu
@needs_cuda
def test_nvcomp_encode_device_decodes_on_cpu() -> None:
    raw = float_specials(torch.bfloat16, 1 << 20)
    for algorithm in sorted(CPU_DECODABLE):
        codec = NvcompCodec(algorithm).for_dtype("bfloat16")
        assert isinstance(codec, NvcompCodec)
        dev = torch.frombuffer(bytearray(raw), dtype=torch.uint8).cuda()
        stored = codec.encode_device(dev).cpu().numpy().tobytes()
        out = bytearray(len(raw))
        codec.decode_cpu(stored, memoryview(out))
        assert bytes(out) == raw
        back = torch.empty(len(raw), dtype=torch.uint8, device="cuda")
        codec.decode_device(stored, back)
        assert bytes(back.cpu().numpy()) == raw


# -- the registry --------------------------------------------------------------------------


def test_registry_unknown_id_lists_known() -> None:
    with pytest.raises(UnknownCodec) as info:
        codec_from_config({"id": "no-such-codec"})
    for known in ("raw", "zstd", "planes", "nvcomp"):
        assert known in str(info.value)
    assert {"raw", "zstd", "planes", "nvcomp"} <= set(codec_ids())
    with pytest.raises(UnknownCodec):
        codec_from_config({"level": 1})  # type: ignore[dict-item]
    with pytest.raises(UnknownCodec):
        codec_from_config("zstd")  # type: ignore[arg-type]


def test_registry_refuses_overwrite() -> None:
    class Impostor(RawCodec):
        codec_id = "zstd"

    with pytest.raises(ValueError, match="already registered"):
        register_codec(Impostor)
    assert get_codec("zstd") is ZstdCodec
    register_codec(ZstdCodec)  # re-registering the same class is harmless


def test_registry_lazy_codec_names_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierckpt.codecs import base

    monkeypatch.setattr(base, "_lazy", dict(base._lazy))  # undone after the test
    register_lazy_codec(
        "test-missing", "tierckpt_no_such_module.codec:Missing", "tierckpt-missing-package"
    )
    assert "test-missing" in codec_ids()
    with pytest.raises(UnknownCodec, match="pip install tierckpt-missing-package"):
        codec_from_config({"id": "test-missing"})


def test_registry_bad_config_is_unknown_codec() -> None:
    with pytest.raises(UnknownCodec):
        codec_from_config({"id": "zstd", "compression": 3})


# -- auto: compress only where it pays -----------------------------------------------------

GB = 1e9


def _profile(codec: Codec, encode: float, ratio: float) -> CodecProfile:
    return CodecProfile(codec=codec, encode_bps=encode, decode_bps=2 * encode, ratio=ratio)


def test_transfer_seconds_is_the_slower_stage() -> None:
    planes = _profile(PlanesCodec(itemsize=2), encode=1 * GB, ratio=0.67)
    assert transfer_seconds(10**9, 2 * GB) == pytest.approx(0.5)
    assert transfer_seconds(10**9, 0.1 * GB, planes) == pytest.approx(6.7)  # link-bound
    assert transfer_seconds(10**9, 10 * GB, planes) == pytest.approx(1.0)  # encoder-bound
    assert transfer_seconds(10**9, 10 * GB, planes, parallel=2) == pytest.approx(0.5)
    assert transfer_seconds(10**9, 1 * GB, _profile(RawCodec(), 1.0, 1.0)) == pytest.approx(1.0)


def test_choose_fast_link_gets_raw() -> None:
    profiles = [
        _profile(PlanesCodec(itemsize=2), 1.2 * GB, 0.67),
        _profile(ZstdCodec(level=1), 0.7 * GB, 0.78),
    ]
    choice = choose_codec(profiles, link_bps=6 * GB, parallel=2)  # local NVMe
    assert choice.codec == RawCodec()
    assert choice.speedup == pytest.approx(1.0)


def test_choose_slow_link_gets_best_ratio_it_can_feed() -> None:
    profiles = [
        _profile(PlanesCodec(itemsize=2), 1.2 * GB, 0.67),
        _profile(ZstdCodec(level=3), 0.15 * GB, 0.65),  # smaller but starves the link
    ]
    choice = choose_codec(profiles, link_bps=0.5 * GB, parallel=2)  # S3
    assert choice.codec == PlanesCodec(itemsize=2)
    assert choice.speedup == pytest.approx(1 / 0.67)
    assert "link-bound" in choice.reason


def test_choose_marginal_gain_stays_raw() -> None:
    profiles = [_profile(ZstdCodec(level=1), 10 * GB, 0.97)]
    assert choose_codec(profiles, link_bps=0.5 * GB).codec == RawCodec()
    assert choose_codec(profiles, link_bps=0.5 * GB, min_gain=0.0).codec == ZstdCodec(level=1)


def test_choose_never_picks_gpu_only_codec_by_default() -> None:
    profiles = [
        _profile(NvcompCodec("ans"), 50 * GB, 0.6),
        _profile(NvcompCodec("zstd"), 20 * GB, 0.75),
    ]
    choice = choose_codec(profiles, link_bps=0.5 * GB)
    assert choice.codec == NvcompCodec("zstd")
    assert choose_codec(profiles, 0.5 * GB, require_cpu_decode=False).codec == NvcompCodec("ans")
    only_gpu = choose_codec(profiles[:1], link_bps=0.5 * GB)
    assert only_gpu.codec == RawCodec() and "GPU-only" in only_gpu.reason


def test_choose_validates() -> None:
    with pytest.raises(ValueError):
        transfer_seconds(1, 0)
    with pytest.raises(ValueError):
        CodecProfile(RawCodec(), 0, 1, 1)


def test_measure_codec_on_a_sample() -> None:
    sample = float_specials(torch.bfloat16, 1 << 20)
    profile = measure_codec(PlanesCodec(itemsize=2), sample, repeats=2)
    assert 0.5 < profile.ratio < 0.8
    assert profile.encode_bps > 1e6 and profile.decode_bps > 1e6
    raw = measure_codec(RawCodec(), sample, repeats=1)
    assert raw.ratio == 1.0
    with pytest.raises(ValueError):
        measure_codec(RawCodec(), b"")


def test_roundtrip_helper_detects_input_mutation() -> None:
    class Mutating(RawCodec):
        codec_id = "raw"

        def encode(self, data):  # type: ignore[no-untyped-def]
            memoryview(data)[0] ^= 1
            return bytes(data)

    with pytest.raises(AssertionError, match="modified its input"):
        roundtrip(Mutating(), bytearray(b"abc"))


# -- golden files --------------------------------------------------------------------------

GOLDEN_CODECS: list[Codec] = [
    RawCodec(),
    ZstdCodec(level=1),
    ZstdCodec(level=3),
    PlanesCodec(itemsize=1),
    PlanesCodec(itemsize=2),
    PlanesCodec(itemsize=4),
    PlanesCodec(itemsize=8),
    PlanesCodec(itemsize=2, level=3),
    NvcompCodec("zstd"),
    NvcompCodec("deflate"),
    NvcompCodec("lz4"),
    NvcompCodec("zstd", itemsize=2),
    NvcompCodec("deflate", itemsize=4),
]


def test_every_golden_file_is_listed() -> None:
    listed = {golden_name(c) for c in GOLDEN_CODECS}
    on_disk = {p.stem for p in GOLDEN.glob("*.bin")}
    assert on_disk == listed


def _regenerate() -> None:  # pragma: no cover - maintenance, not a test
    import tierckpt.codecs.nvcomp as nvcomp_mod

    nvcomp_mod._cuda_available = lambda: False  # golden nvcomp files use the CPU encoders
    for path in regenerate_golden(GOLDEN, GOLDEN_CODECS):
        print(path)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_regenerate())
