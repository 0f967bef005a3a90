"""``CodecTests``: the suite every codec must pass.

Subclass it in a test module (the name must start with ``Test``), supply a ``codec`` fixture and
point ``golden_dir`` at the folder of golden encoded files::

    class TestMyCodec(CodecTests):
        golden_dir = Path(__file__).parent / "fixtures" / "codecs"

        @pytest.fixture(params=[1, 3])
        def codec(self, request):
            return MyCodec(level=request.param)

The tests use only the contract in :mod:`tierckpt.codecs.base`. Golden files pin the stored
format: each is the encoding of :func:`golden_input` by one codec configuration, named by
:func:`golden_name`. Tests only decode them; :func:`regenerate_golden` (never run by the tests)
writes new ones when a format version is added on purpose.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierckpt._types import BytesLike
from tierckpt.codecs.base import Codec, codec_from_config
from tierckpt.errors import CorruptChunk

__all__ = [
    "PROPERTY_DTYPES",
    "CodecTests",
    "float_specials",
    "golden_input",
    "golden_name",
    "regenerate_golden",
    "roundtrip",
]

#: dtypes of the Hypothesis round-trip property
PROPERTY_DTYPES = ["float32", "bfloat16", "float16", "float64", "int8", "int64", "bool"]
_TORCH_DTYPES = {name: getattr(torch, name) for name in PROPERTY_DTYPES}


def roundtrip(codec: Codec, raw: BytesLike) -> bytes:
    """Encode then decode ``raw``; checks that encode left its input alone."""
    before = bytes(raw)
    encoded = codec.encode(raw)
    assert bytes(raw) == before, f"{codec!r}.encode modified its input"
    out = bytearray(len(before))
    codec.decode(encoded, memoryview(out))
    return bytes(out)


def float_specials(dtype: torch.dtype, n: int, seed: int = 0) -> bytes:
    """``n`` values of ``dtype`` mixing weights-like normals with nan, ±inf, -0.0, denormals."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n, generator=gen, dtype=torch.float64) * 0.02
    info = torch.finfo(dtype)
    specials = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            -0.0,
            0.0,
            info.tiny / 4,
            -info.tiny / 2,
            info.tiny,
            info.max,
            -info.max,
            info.eps,
            1.0,
            -1.0,
        ],
        dtype=torch.float64,
    )
    if n:
        idx = torch.randint(0, n, (min(n, 4 * len(specials)),), generator=gen)
        values[idx] = specials.repeat(len(idx) // len(specials) + 1)[: len(idx)]
    return values.to(dtype).view(torch.uint8).numpy().tobytes()


def _lcg_bytes(n: int, seed: int) -> np.ndarray:
    """Deterministic bytes from a 64-bit LCG (independent of numpy's random generators)."""
    state = np.uint64(seed * 6364136223846793005 + 1442695040888963407)
    idx = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = (idx * np.uint64(0x9E3779B97F4A7C15) + state) * np.uint64(0xBF58476D1CE4E5B9)
        mixed ^= mixed >> np.uint64(31)
    return (mixed >> np.uint64(24)).astype(np.uint8)


def golden_input() -> bytes:
    """The fixed input of every golden file (version 1; never change it, add a new one).

    ~96 KiB: fp32 weights-like values that are exact in binary (k/4096), the same values as
    bf16 (top halves), specials, a zero run, pseudo-random bytes and a 3-byte odd tail.
    """
    ints = _lcg_bytes(8192, 1).astype(np.int64) * 37 % 2001 - 1000
    weights = (ints.astype(np.float32) / np.float32(4096.0)).astype("<f4")
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, -1e-40, 3.4e38, 1.0], dtype="<f4")
    fp32 = np.concatenate([weights, np.tile(specials, 64)])
    bf16 = fp32.view("<u4") >> np.uint32(16)
    parts = [
        fp32.tobytes(),
        bf16.astype("<u2").tobytes(),
        bytes(16384),
        _lcg_bytes(24576, 2).tobytes(),
        b"\x01\x02\x03",
    ]
    return b"".join(parts)


def golden_name(codec: Codec) -> str:
    """File stem of a codec's golden file: its config minus fields that do not change bytes."""
    config = codec.get_config()
    parts = [str(config["id"])]
    for key in sorted(config):
        if key in ("id", "threads"):
            continue
        value = config[key]
        if isinstance(value, dict):
            value = "".join(f"{k}{v}" for k, v in sorted(value.items())) or "none"
        parts.append(f"{key}{value}")
    return "-".join(parts).replace("/", "_").replace("<", "lt")


def regenerate_golden(directory: Path, codecs: Iterable[Codec]) -> list[Path]:
    """Write ``<golden_name>.bin`` and ``.json`` for each codec (a maintenance tool, not a test)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = golden_input()
    written = []
    for codec in codecs:
        encoded = bytes(codec.encode(raw))
        assert roundtrip(codec, raw) == raw
        stem = directory / golden_name(codec)
        stem.with_suffix(".bin").write_bytes(encoded)
        meta = {
            "config": codec.get_config(),
            "input": "golden_input v1",
            "raw_len": len(raw),
            "raw_sha256": hashlib.sha256(raw).hexdigest(),
        }
        stem.with_suffix(".json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        written.append(stem.with_suffix(".bin"))
    return written


class CodecTests:
    """The codec contract as tests; see the module docstring."""

    #: folder of golden files (``None`` skips the golden test, e.g. for GPU-only codecs)
    golden_dir: ClassVar[Path | None] = None
    #: raw sizes, in bytes, that are not multiples of any element size
    odd_lengths: ClassVar[list[int]] = [1, 3, 5, 7, 9, 15, 17, 1023, 4097, 65537, 200_003]

    @pytest.fixture
    def codec(self) -> Codec:  # pragma: no cover - subclasses override
        raise NotImplementedError("a CodecTests subclass must provide a `codec` fixture")

    # -- round trips ----------------------------------------------------------------------

    def test_empty(self, codec: Codec) -> None:
        assert roundtrip(codec, b"") == b""

    def test_one_byte(self, codec: Codec) -> None:
        for value in (b"\x00", b"\x7f", b"\xff"):
            assert roundtrip(codec, value) == value

    def test_odd_lengths(self, codec: Codec) -> None:
        source = float_specials(torch.float32, 200_004 // 4 + 1)
        for n in self.odd_lengths:
            assert roundtrip(codec, source[:n]) == source[:n], n

    def test_zeros(self, codec: Codec) -> None:
        raw = bytes(3 << 20)
        assert roundtrip(codec, raw) == raw

    def test_random_bytes(self, codec: Codec) -> None:
        raw = np.random.default_rng(7).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        assert roundtrip(codec, raw) == raw

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
    def test_float_specials(self, codec: Codec, dtype: str) -> None:
        raw = float_specials(getattr(torch, dtype), 300_001, seed=3)
        for c in (codec, codec.for_dtype(dtype)):
            assert roundtrip(c, raw) == raw

    def test_accepts_buffer_kinds(self, codec: Codec) -> None:
        raw = float_specials(torch.bfloat16, 5001)
        array = np.frombuffer(raw, np.uint8)
        for data in (raw, bytearray(raw), memoryview(raw), array.data, memoryview(bytearray(raw))):
            assert roundtrip(codec, data) == raw

    def test_encoded_survives_bytes_copy(self, codec: Codec) -> None:
        raw = float_specials(torch.float32, 10_001)
        stored = bytes(codec.encode(raw))  # what a backend writes and reads back
        out = bytearray(len(raw))
        codec.decode(stored, memoryview(out))
        assert bytes(out) == raw

    # -- malformed input ------------------------------------------------------------------

    @pytest.mark.parametrize("delta", [-1, 1, 4096])
    def test_wrong_size_out(self, codec: Codec, delta: int) -> None:
        raw = float_specials(torch.float32, 5000)
        encoded = bytes(codec.encode(raw))
        out = bytearray(len(raw) + delta)
        with pytest.raises(CorruptChunk):
            codec.decode(encoded, memoryview(out))

    def test_empty_out_of_nonempty_chunk(self, codec: Codec) -> None:
        encoded = bytes(codec.encode(float_specials(torch.float32, 100)))
        with pytest.raises(CorruptChunk):
            codec.decode(encoded, memoryview(bytearray(0)))

    def test_truncated(self, codec: Codec) -> None:
        raw = float_specials(torch.bfloat16, 40_000)
        encoded = bytes(codec.encode(raw))
        cuts = sorted({0, 1, 7, 24, len(encoded) // 2, len(encoded) - 1})
        for cut in cuts:
            if cut >= len(encoded):
                continue
            with pytest.raises(CorruptChunk):
                codec.decode(encoded[:cut], memoryview(bytearray(len(raw))))

    def test_trailing_garbage(self, codec: Codec) -> None:
        raw = float_specials(torch.bfloat16, 10_000)
        encoded = bytes(codec.encode(raw)) + b"garbage!"
        with pytest.raises(CorruptChunk):
            codec.decode(encoded, memoryview(bytearray(len(raw))))

    def test_bit_flips(self, codec: Codec) -> None:
        """A flipped bit raises CorruptChunk, or (in a region stored raw) still fills ``out``.

        Catching every flip is the checksum layer's job; the codec must only never crash
        with another error, write outside ``out`` or return a wrong-sized result.
        """
        raw = float_specials(torch.bfloat16, 20_000) + bytes(4096)
        encoded = bytes(codec.encode(raw))
        rng = np.random.default_rng(11)
        positions = set(range(min(len(encoded), 48)))
        positions |= {int(p) for p in rng.integers(0, len(encoded), 48)}
        for pos in sorted(positions):
            flipped = bytearray(encoded)
            flipped[pos] ^= 1 << int(rng.integers(0, 8))
            guard = bytearray(len(raw) + 64)
            out = memoryview(guard)[32 : 32 + len(raw)]
            try:
                codec.decode(bytes(flipped), out)
            except CorruptChunk:
                continue
            assert guard[:32] == bytes(32) and guard[-32:] == bytes(32), pos
            assert len(out) == len(raw)

    def test_not_a_chunk(self, codec: Codec) -> None:
        junk = zlib.compress(b"not a chunk of this codec" * 50)
        out = bytearray(4096)
        with pytest.raises(CorruptChunk):
            codec.decode(junk, memoryview(out))

    # -- config ---------------------------------------------------------------------------

    def test_config_roundtrip(self, codec: Codec) -> None:
        config = codec.get_config()
        assert config["id"] == codec.codec_id
        restored = codec_from_config(json.loads(json.dumps(config)))
        assert restored == codec
        assert hash(restored) == hash(codec)
        assert restored.get_config() == config
        assert type(codec).__name__ in repr(codec)

    def test_decode_with_config_copy(self, codec: Codec) -> None:
        """A reader builds the codec from the stored config alone."""
        raw = float_specials(torch.float16, 7777)
        encoded = codec.encode(raw)
        reader = codec_from_config(json.loads(json.dumps(codec.get_config())))
        out = bytearray(len(raw))
        reader.decode(encoded, memoryview(out))
        assert bytes(out) == raw

    @pytest.mark.parametrize("dtype", [*PROPERTY_DTYPES, "uint8", "int32", "complex64"])
    def test_for_dtype(self, codec: Codec, dtype: str) -> None:
        chosen = codec.for_dtype(dtype)
        assert isinstance(chosen, Codec)
        assert codec_from_config(chosen.get_config()) == chosen

    # -- property -------------------------------------------------------------------------

    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(
        dtype=st.sampled_from(PROPERTY_DTYPES),
        count=st.one_of(st.integers(0, 64), st.integers(0, 70_000)),
        extra=st.integers(0, 7),
        seed=st.integers(0, 2**32 - 1),
        style=st.sampled_from(["normal", "specials", "zeros", "bytes"]),
    )
    def test_property_roundtrip(
        self, codec: Codec, dtype: str, count: int, extra: int, seed: int, style: str
    ) -> None:
        tdtype = _TORCH_DTYPES[dtype]
        gen = torch.Generator().manual_seed(seed)
        if style == "zeros":
            body = bytes(count * torch.empty(0, dtype=tdtype).element_size())
        elif style == "bytes" or not tdtype.is_floating_point:
            nbytes = count * torch.empty(0, dtype=tdtype).element_size()
            values = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            body = (values % 2 if tdtype == torch.bool else values).numpy().tobytes()
        elif style == "specials":
            body = float_specials(tdtype, count, seed)
        else:
            values = (torch.randn(count, generator=gen, dtype=torch.float64) * 0.05).to(tdtype)
            body = values.view(torch.uint8).numpy().tobytes()
        raw = body + bytes(range(extra))
        assert roundtrip(codec.for_dtype(dtype), raw) == raw

    # -- golden files ---------------------------------------------------------------------

    def test_golden(self, codec: Codec) -> None:
        if self.golden_dir is None:
            pytest.skip("no golden files for this codec")
        path = self.golden_dir / f"{golden_name(codec)}.bin"
        assert path.exists(), (
            f"missing golden file {path.name}; generate it with regenerate_golden() "
            "(see tests/test_codecs.py) and check it in"
        )
        meta = json.loads(path.with_suffix(".json").read_text())
        stored = codec_from_config(meta["config"])
        assert golden_name(stored) == golden_name(codec)
        raw = golden_input()
        assert meta["raw_len"] == len(raw)
        assert meta["raw_sha256"] == hashlib.sha256(raw).hexdigest()
        out = bytearray(len(raw))
        codec.decode(path.read_bytes(), memoryview(out))
        assert bytes(out) == raw
