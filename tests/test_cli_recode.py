"""``tierckpt push``/``pull`` store the copy with the destination tier's codec (issue 17: push
copied raw local bytes to S3 although the S3 tier compresses), name the tier the copy is on,
and the copy loads bit-exact. Against a real S3 server (moto) on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.cli import main
from tierckpt.format import manifest_name
from tierckpt.offline import open_backend
from tierckpt.restore import read_index, read_manifest

pytestmark = pytest.mark.s3


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(60_000, generator=g),  # float: the float-aware codec
        "h": torch.randn(20_000, generator=g).to(torch.bfloat16),
        "ids": torch.arange(50_000),  # integers: zstd
        "z": torch.zeros(30_000),
    }


def _codecs(url: str, endpoint: str | None, step: int) -> list[str]:
    """The codec ids the checkpoint's stored chunks name, read from its shard indexes."""
    backend = open_backend(url, endpoint_url=endpoint)
    try:
        m = read_manifest(backend, step, url)
        ids: list[str] = []
        for ref in m.shards:
            index, _, _ = read_index(backend, ref, url)
            ids += [str(index["codecs"][c.codec]["id"]) for c in index["chunks"]]
        return ids
    finally:
        backend.close()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
        for k in a
    )


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_push_stores_the_s3_tiers_codec_and_loads_bit_exact(
    codec: str | None,
    tmp_path: Path,
    moto_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    ep = moto_server.endpoint_url
    bucket = s3_bucket(moto_server)
    local = tmp_path / "local"
    with Checkpointer([LocalTier(local, codec="raw")]) as ck:
        ck.save(_state(), step=3).wait()
    assert set(_codecs(str(local), None, 3)) == {"raw"}
    dest = f"s3://{bucket}/pushed"
    argv = ["push", str(local), dest, "--endpoint-url", ep]
    rc, out, err = _run([*argv, *(["--codec", codec] if codec else [])], capsys)
    assert rc == 0, err
    stored = _codecs(dest, ep, 3)
    if codec is None:  # auto on S3: compressed, the float-aware codec for float chunks
        assert "raw" not in stored and "planes" in stored, stored
    else:
        assert set(stored) == {"zstd"}, stored
    rc, out, err = _run(["ls", dest, "--endpoint-url", ep, "--json"], capsys)
    (c,) = json.loads(out)["checkpoints"]
    assert c["tier"] == "s3" and sorted(set(stored)) == c["codecs"]
    assert c["stored_bytes"] < c["raw_bytes"]  # the manifest's sizes are the copy's
    with Checkpointer([S3Tier(dest, endpoint_url=ep)]) as ck:
        assert _same(ck.load(step=3), _state())


def test_pull_decodes_for_a_local_tier_and_keep_copies_as_stored(
    tmp_path: Path,
    moto_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    ep = moto_server.endpoint_url
    url = f"s3://{s3_bucket(moto_server)}/run"
    with Checkpointer([S3Tier(url, endpoint_url=ep, codec="zstd")]) as ck:
        ck.save(_state(), step=5).wait()
    back = tmp_path / "back"
    rc, _out, err = _run(["pull", url, str(back), "--endpoint-url", ep], capsys)
    assert rc == 0, err
    assert set(_codecs(str(back), None, 5)) == {"raw"}  # auto on a local disk: raw
    kept = tmp_path / "kept"
    argv = ["pull", url, str(kept), "--endpoint-url", ep, "--codec", "keep"]
    assert _run([*argv, "--tier-name", "nvme"], capsys)[0] == 0
    assert set(_codecs(str(kept), None, 5)) == {"zstd"}
    rc, out, _ = _run(["ls", str(kept), "--json"], capsys)
    assert json.loads(out)["checkpoints"][0]["tier"] == "nvme"
    for folder in (back, kept):
        with Checkpointer([LocalTier(folder)]) as ck:
            assert _same(ck.load(step=5), _state())
    rc, _out, err = _run(
        ["pull", url, str(tmp_path / "x"), "--endpoint-url", ep, "--codec", "lz9"], capsys
    )
    assert rc == 2 and "--codec 'lz9' is not a codec" in err


@pytest.mark.parametrize("codec", ["auto", "keep"])
def test_a_pushed_dcp_checkpoint_keeps_its_metadata_and_loads(
    codec: str,
    tmp_path: Path,
    moto_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter, dcp_metadata_name

    ep = moto_server.endpoint_url
    local = tmp_path / "dcp"
    state = _state()
    with TierWriter([LocalTier(local)], 2) as w:
        dcp.save(state, storage_writer=w, no_dist=True)
    dest = f"s3://{s3_bucket(moto_server)}/dcp"
    rc, _out, err = _run(["push", str(local), dest, "--endpoint-url", ep, "--codec", codec], capsys)
    assert rc == 0, err
    backend = open_backend(dest, endpoint_url=ep)
    try:
        assert backend.exists(dcp_metadata_name(2)) and backend.exists(manifest_name(2))
    finally:
        backend.close()
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, storage_reader=TierReader([S3Tier(dest, endpoint_url=ep)], 2), no_dist=True)
    assert _same(target, state)
