"""The ``auto`` policy chooses per tier from measured restore rates, and explores to get them.

A tier that compresses never stores raw chunks, so no load of it measures a raw restore; after a
compressed load the loader reads a slice of the shard again, raw (the link probe), and the
policy compares what the two delivered. Driven with injected measurements (fast link + slow
decoder: raw; slow link + fast decoder: compressed; the probe happens when due and its reading
changes the choice; a measured veto is re-examined after a few raw loads), then end to end:
a decoder made slow (a sleeping codec) against a real S3 server switches the tier to raw; a
link made slow (a throttled backend) keeps it compressing; checkpoints whose chunks mix
raw and compressed (the policy switched between them) load bit-exact; and what loads taught a
policy survives a restart (real processes), so a restarted job that loads raw chunks does not
go back to compressing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.checkpointer import _auto_feedback
from tierckpt.checkpointer._auto_feedback import (
    PROBE_FRACTION,
    PROBE_MAX,
    PROBE_MIN,
    probe_bytes,
    recall,
    remember,
    state_path,
)
from tierckpt.codecs import Codec, PlanesCodec, RawCodec, ZstdCodec, register_codec
from tierckpt.codecs.adaptive import EXPLORE_EVERY, AdaptiveCodec
from tierckpt.codecs.auto import CodecProfile
from tierckpt.restore import read_index, read_manifest
from tierckpt.testing.s3servers import S3Server

CHUNK = 1 << 20
MiB = 1 << 20
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# -- the policy, driven with injected measurements --------------------------------------------
def _policy(decode_bps: float = 10e9, ratio: float = 0.6) -> AdaptiveCodec:
    """A remote tier's policy whose codec on paper outruns any link (encode and decode 10 GB/s)
    and whose save link (100 MiB/s) makes compressing pay on the save."""
    policy = AdaptiveCodec(remote=True, parallel=2)
    policy._profiles["float4"] = CodecProfile(PlanesCodec(threads=1), 10e9, decode_bps, ratio)
    policy.observe(100 * MiB, 1.0)
    return policy


def _compresses(policy: AdaptiveCodec) -> bool:
    return not policy.for_dtype("float32").is_passthrough


def test_fast_link_and_slow_decoder_measured_go_raw() -> None:
    """On paper the decoders outrun the link; the measurements say otherwise (a store sharing
    the decoder's cores): a compressed load delivered 0.1 GB/s, the raw probe read 0.3 GB/s."""
    policy = _policy()
    assert _compresses(policy)
    policy.observe_read(600 * MiB, 1000 * MiB, 10.0, compressed=True)  # C = 0.1 GB/s
    assert _compresses(policy)  # one side of the comparison only: the model still says compress
    assert policy.link_probe_due()
    policy.observe_link_probe(300 * MiB, 1.0)  # R = 0.3 GB/s
    assert not _compresses(policy)
    assert not policy.link_probe_due()
    seen = policy.describe()
    assert seen["compress"] == {"float4": False}
    assert seen["read_link_bps"] == pytest.approx(300 * MiB)


def test_slow_link_and_fast_decoder_measured_keep_compressing() -> None:
    policy = _policy()
    policy.observe_read(60 * MiB, 100 * MiB, 1.0, compressed=True)  # C = 100 MiB/s
    assert policy.link_probe_due()
    policy.observe_link_probe(60 * MiB, 1.0)  # R = 60 MiB/s: the link is the bottleneck
    assert _compresses(policy)
    assert policy.describe()["compress"] == {"float4": True}


def test_measurements_overrule_the_model_both_ways() -> None:
    """The model vetoes (decoder 50 MB/s x 2 < a 1 GiB/s read link), but compressed loads
    were measured faster than raw reads: compress. The measurement is what the restore sees."""
    policy = _policy(decode_bps=50e6)
    policy.observe_read(1 << 30, 1 << 30, 1.0, compressed=False)  # R = 1 GiB/s
    assert not _compresses(policy)  # model veto: no compressed load measured yet
    policy.observe_read(512 * MiB, 1 << 30, 0.5, compressed=True)  # C = 2 GiB/s
    assert _compresses(policy)


def test_the_probe_is_due_after_a_compressed_load_without_a_raw_rate_and_again_when_stale() -> None:
    policy = _policy()
    assert not policy.link_probe_due()  # no compressed load yet: nothing to compare with
    policy.observe_read(60 * MiB, 100 * MiB, 1.0, compressed=True)
    assert policy.link_probe_due()
    policy.observe_link_probe(50 * MiB, 1.0)  # R = 50 MiB/s < C: keep compressing
    assert not policy.link_probe_due()
    for i in range(EXPLORE_EVERY):
        assert not policy.link_probe_due(), i
        policy.observe_read(60 * MiB, 100 * MiB, 1.0, compressed=True)
    assert policy.link_probe_due()  # R is EXPLORE_EVERY compressed loads old
    # the link got faster meanwhile: the fresh probe replaces the stale R and turns the choice
    assert _compresses(policy)
    policy.observe_link_probe(400 * MiB, 1.0)
    assert not _compresses(policy)
    # loads too small to say anything, and empty probes, change nothing
    before = policy.describe()
    policy.observe_read(10, 10, 1.0, compressed=True)
    policy.observe_link_probe(10, 1.0)
    policy.observe_link_probe(100 * MiB, 0.0)
    assert policy.describe() == before


def test_a_measured_veto_is_reexamined_after_some_raw_loads() -> None:
    policy = _policy()
    policy.observe_read(600 * MiB, 1000 * MiB, 10.0, compressed=True)  # C = 0.1 GB/s
    policy.observe_link_probe(300 * MiB, 1.0)  # R = 0.3 GB/s: raw
    assert not _compresses(policy)
    for _ in range(EXPLORE_EVERY - 1):
        policy.observe_read(300 * MiB, 300 * MiB, 1.0, compressed=False)
        assert not _compresses(policy)
    policy.observe_read(300 * MiB, 300 * MiB, 1.0, compressed=False)
    # C forgotten: the save-side rules (and the model) decide again until a compressed load
    assert policy.describe()["read_compressed_bps"] is None
    assert _compresses(policy)
    policy.observe_read(600 * MiB, 1000 * MiB, 10.0, compressed=True)  # still 0.1 GB/s
    assert not policy.link_probe_due()  # R was measured by the raw loads just now
    assert not _compresses(policy)


def test_probe_size() -> None:
    assert probe_bytes(8 * MiB, 9 * MiB) == 0  # a small load: no probe, never all of it again
    assert probe_bytes(4 * PROBE_MIN - 1, 1 << 30) == 0  # its quarter is under PROBE_MIN
    assert probe_bytes(4 * PROBE_MIN, 1 << 30) == PROBE_MIN
    assert probe_bytes(1 << 30, (1 << 30) + 4096) == (1 << 30) // PROBE_FRACTION
    assert probe_bytes(64 << 30, 65 << 30) == PROBE_MAX
    assert probe_bytes(1 << 30, 100 * MiB) == 100 * MiB  # never past the file's end


# -- end to end -------------------------------------------------------------------------------
class SlowZstd(ZstdCodec):
    """zstd whose decode sleeps: a decoder slower than any link (as one sharing its cores
    with the object store is), without depending on how loaded the machine is."""

    codec_id = "test-slow-zstd"
    DELAY = 0.3

    def decode(self, data: Any, out: memoryview) -> None:
        time.sleep(self.DELAY)
        super().decode(data, out)


register_codec(SlowZstd, replace=True)


def _state() -> dict[str, Any]:
    """8 MiB of float32 that zstd shrinks (bf16-rounded: the low half of each value is 0)."""
    gen = torch.Generator().manual_seed(3)
    return {"w": torch.randn(2 * MiB, generator=gen).to(torch.bfloat16).float(), "step": 1}


def _injected(candidate: Codec) -> AdaptiveCodec:
    """A policy whose save side always compresses (profile injected, as if measured on an
    idle machine: encode and decode far faster than any link), so the restore decides."""
    policy = AdaptiveCodec(remote=True, parallel=2, candidate=candidate)
    policy._profiles["float4"] = CodecProfile(candidate.for_dtype("float32"), 1e12, 1e12, 0.5)
    return policy


def _probe_small_loads() -> None:
    """Let a load of this file's few MiB probe the link, all of it read again (a real
    probe skips loads under 4 x PROBE_MIN: tests here would need 128 MiB states)."""
    _auto_feedback.PROBE_MIN, _auto_feedback.PROBE_FRACTION = MiB, 1


def _codec_ids(backend: Backend, step: int) -> list[str]:
    index = read_index(backend, read_manifest(backend, step, "t").shard_for(0), "t")[0]
    return [index["codecs"][c.codec]["id"] for c in index["chunks"]]


def test_a_slow_decoder_switches_an_s3_tier_to_raw(
    s3_server: S3Server, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_auto_feedback, "PROBE_MIN", MiB)
    monkeypatch.setattr(_auto_feedback, "PROBE_FRACTION", 1)
    bucket = s3_bucket(s3_server)
    state = _state()
    policy = _injected(SlowZstd())
    tier = S3Tier(f"s3://{bucket}/auto", endpoint_url=s3_server.endpoint_url, codec=policy)
    backend = tier.make_backend()
    try:
        with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
            ck.save(state, step=1).result()
            assert set(_codec_ids(backend, 1)) == {SlowZstd.codec_id}
            assert policy.describe()["compress"] == {"float4": True}
            assert_same(ck.load(), state)  # compressed, decoded at <= 8 MiB/s; then probed
            seen = policy.describe()
            assert seen["read_link_bps"] is not None  # the probe ran
            assert seen["read_link_bps"] > seen["read_compressed_bps"]
            assert seen["compress"] == {"float4": False}
            ck.save(state, step=2).result()
            assert set(_codec_ids(backend, 2)) == {"raw"}
            assert_same(ck.load(step=1), state)  # both kinds still load
            assert_same(ck.load(step=2), state)
    finally:
        backend.close()


class ThrottledBackend(LocalBackend):
    """A local folder read at ~4 MB/s per reader thread (``read`` goes through ``read_into``): a link slower than the decoder."""

    RATE = 4e6

    def read_into(self, name: str, offset: int, out: memoryview) -> None:
        time.sleep(len(out) / self.RATE)
        super().read_into(name, offset, out)

    def read_into_pieces(self, name: str, offset: int, outs: Any) -> None:
        time.sleep(sum(len(o) for o in outs) / self.RATE)
        super().read_into_pieces(name, offset, outs)


class ThrottledTier(LocalTier):
    def make_backend(self) -> Backend:
        return ThrottledBackend(self.path)


def test_a_slow_link_keeps_the_tier_compressing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_auto_feedback, "PROBE_MIN", MiB)
    monkeypatch.setattr(_auto_feedback, "PROBE_FRACTION", 1)
    state = _state()
    policy = _injected(ZstdCodec())
    tier = ThrottledTier(tmp_path, codec=policy, keep_last=None)
    with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
        ck.save(state, step=1).result()
        assert set(_codec_ids(LocalBackend(tmp_path), 1)) == {"zstd"}
        assert_same(ck.load(), state)
        seen = policy.describe()
        assert seen["read_link_bps"] is not None  # the probe ran
        # the compressed load moved about half the bytes over the same link
        assert seen["read_compressed_bps"] > seen["read_link_bps"]
        assert seen["compress"] == {"float4": True}
        ck.save(state, step=2).result()
        assert set(_codec_ids(LocalBackend(tmp_path), 2)) == {"zstd"}


class Alternating(AdaptiveCodec):
    """A policy that changes its mind between every two chunks of one save."""

    def __init__(self) -> None:
        super().__init__(remote=True, parallel=2)
        self.calls = 0

    def for_dtype(self, dtype_name: str) -> Codec:
        self.calls += 1
        return RawCodec() if self.calls % 2 else super().for_dtype(dtype_name)


def test_a_checkpoint_mixing_raw_and_compressed_chunks_loads(
    s3_server: S3Server, s3_bucket: Any
) -> None:
    bucket = s3_bucket(s3_server)
    state = _state()
    state["ids"] = torch.arange(300_000, dtype=torch.int64)  # "other" chunks: zstd
    state["half"] = torch.randn(600_000, generator=torch.Generator().manual_seed(1)).half()
    policy = Alternating()
    tier = S3Tier(f"s3://{bucket}/mixed", endpoint_url=s3_server.endpoint_url, codec=policy)
    backend = tier.make_backend()
    try:
        with Checkpointer([tier], chunk_bytes=CHUNK) as ck:
            ck.save(state, step=1).result()
            ids = _codec_ids(backend, 1)
            assert "raw" in ids and "planes" in ids, ids
            assert_same(ck.load(), state)
        # and a checkpointer whose tier never saw the policy (codec auto, fresh) loads it too
        with Checkpointer(
            [S3Tier(f"s3://{bucket}/mixed", endpoint_url=s3_server.endpoint_url)]
        ) as ck:
            assert_same(ck.load(), state)
    finally:
        backend.close()


# -- memory across restarts ------------------------------------------------------------------
def test_the_load_side_state_round_trips_and_garbage_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERCKPT_AUTO_STATE_DIR", str(tmp_path / "state"))
    path = state_path("s3://b/run", 3)
    assert path is not None and path.startswith(str(tmp_path / "state"))
    assert path != state_path("s3://b/run", 4) and path != state_path("s3://b/other", 3)
    learned = _policy()
    learned.observe_read(600 * MiB, 1000 * MiB, 10.0, compressed=True)
    learned.observe_link_probe(300 * MiB, 1.0)
    remember(learned, path, "s3://b/run", 3)
    fresh = _policy()
    assert _compresses(fresh)
    assert recall(fresh, path)
    assert not _compresses(fresh)
    assert fresh.read_state() == learned.read_state()
    assert not recall(fresh, path)  # it measured (took) a state already: its own is newer
    for bad in [b"", b"{not json", b"[]", json.dumps({"format": "x"}).encode()]:
        Path(path).write_bytes(bad)
        assert not recall(_policy(), path)
    doc = {"format": "tierckpt-auto-state", "version": 1, "state": {"read_link_bps": -1}}
    Path(path).write_text(json.dumps(doc))
    assert not recall(_policy(), path)
    monkeypatch.setenv("TIERCKPT_AUTO_STATE_DIR", "off")
    assert state_path("s3://b/run", 3) is None


def _restart_worker(folder: str, step: int) -> None:
    """One process of a job on a local tier with a slow-decoding auto policy: load the newest
    checkpoint (if any), save ``step``, print the saved chunks' codec ids."""
    _probe_small_loads()
    state = _state()
    policy = _injected(SlowZstd())
    with Checkpointer([LocalTier(folder, codec=policy, keep_last=None)], chunk_bytes=CHUNK) as ck:
        if step > 1:
            assert_same(ck.load(), state)
        ck.save(state, step=step).result()
    print(json.dumps({"ids": sorted(set(_codec_ids(LocalBackend(folder), step)))}))


def _run_process(folder: Path, step: int, state_dir: str) -> list[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    env["TIERCKPT_AUTO_STATE_DIR"] = state_dir
    code = f"import test_auto_explore as t; t._restart_worker({str(folder)!r}, {step})"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])["ids"]
    return ids


@pytest.mark.parametrize("kept", [True, False], ids=["state-kept", "state-off"])
def test_a_restarted_job_remembers_that_compressed_restores_were_slower(
    tmp_path: Path, kept: bool
) -> None:
    """Three processes: the first saves compressed; the second loads it (slowly), probes, and
    saves raw; the third loads those raw chunks. With the state kept it knows the compressed
    restore was slower and saves raw again; with it off it knows only the raw rate, so the
    model (decoders far faster than the link) sends it back to compressing."""
    folder = tmp_path / "tier"
    state_dir = str(tmp_path / "state") if kept else "off"
    assert _run_process(folder, 1, state_dir) == [SlowZstd.codec_id]
    assert _run_process(folder, 2, state_dir) == ["raw"]
    assert _run_process(folder, 3, state_dir) == (["raw"] if kept else [SlowZstd.codec_id])


def test_the_state_folder_follows_the_knob_then_the_xdg_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierckpt import config

    monkeypatch.delenv("TIERCKPT_AUTO_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert config.auto_state_dir() == str(tmp_path / "xdg" / "tierckpt" / "auto")
    monkeypatch.setenv("TIERCKPT_AUTO_STATE_DIR", str(tmp_path / "mine"))
    assert config.auto_state_dir() == str(tmp_path / "mine")
    for off in ["off", "0", "No"]:
        monkeypatch.setenv("TIERCKPT_AUTO_STATE_DIR", off)
        assert config.auto_state_dir() is None
