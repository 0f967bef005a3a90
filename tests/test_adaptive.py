"""codec="auto": compress only where it makes the tier faster, learned from the run itself."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.codecs.adaptive import AdaptiveCodec
from tierckpt.format import FOOTER_SIZE, Footer, decode_index, shard_name


class _SlowLink(LocalBackend):
    """A "remote" folder behind a ~40 MB/s link (sleeps in proportion to the bytes)."""

    @property
    def is_remote(self) -> bool:
        return True

    def open_writer(self, name: str):  # type: ignore[no-untyped-def]
        w = super().open_writer(name)
        orig = w.write

        def write(offset: int, data: object) -> None:
            time.sleep(len(memoryview(data).cast("B")) / 40e6)  # type: ignore[arg-type]
            orig(offset, data)  # type: ignore[arg-type]

        w.write = write  # type: ignore[method-assign]
        return w


class _SlowTier(LocalTier):
    def make_backend(self):  # type: ignore[no-untyped-def]
        return _SlowLink(self.path)


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # trained-looking weights: small normal values compress on their exponent byte
    return {
        f"w{i}": (torch.randn(1 << 20, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)
    }


def _codec_ids(root: Path, step: int) -> set[str]:
    data = (root / shard_name(step, 0)).read_bytes()
    f = Footer.decode(data[-FOOTER_SIZE:], file_size=len(data), where="t")
    index = decode_index(
        data[f.index_offset : f.index_offset + f.index_length], file_size=len(data), where="t"
    )
    return {c["id"] for c in index["codecs"]}


def test_local_raw_slow_remote_link_compressed(tmp_path: Path) -> None:
    state = _weights()
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    with Checkpointer([LocalTier(fast), _SlowTier(slow, name="slow")], chunk_bytes=1 << 20) as ck:
        for step in range(3):
            ck.save(state, step=step).wait()
        slow_policy = ck._tier("slow").codec
        assert isinstance(slow_policy, AdaptiveCodec)
        assert slow_policy.describe()["compress"] == {"float2": True}, slow_policy.describe()
        assert slow_policy.describe()["link_bps"] < 100e6
        assert _codec_ids(slow, 2) == {"planes"}
        # local disks get raw chunks under "auto"
        assert ck._tier("local").codec.codec_id == "raw"
        assert _codec_ids(fast, 2) == {"raw"}
        assert_same(state, ck.load(tier="slow"))
        assert_same(state, ck.load(tier="local"))


def test_policy_decision_from_numbers() -> None:
    policy = AdaptiveCodec(remote=True)
    sample = (torch.randn(1 << 20) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy()
    policy.profile("bfloat16", memoryview(sample))
    policy.observe(1 << 30, 1.0 / 0.05)  # a 50 MB/s link: compression pays
    assert policy.for_dtype("bfloat16").codec_id == "planes"
    for _ in range(4):
        policy.observe(1 << 30, 1.0 / 50)  # a 50 GB/s link: raw is faster
    assert policy.for_dtype("bfloat16").codec_id == "raw"
    assert AdaptiveCodec(remote=False).for_dtype("float32").codec_id == "raw"
