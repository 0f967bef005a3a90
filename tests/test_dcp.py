"""``tierckpt.dcp``: torch.distributed.checkpoint through tierckpt tiers, and resharding."""

from __future__ import annotations

import json
import os
import pickle
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import torch
import torch.distributed.checkpoint as dcp
import zstandard
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt import LocalTier, MemoryTier
from tierckpt.dcp import (
    ItemLocation,
    SafeLoadPlanner,
    TierReader,
    TierWriter,
    dcp_metadata_name,
    decode_metadata,
    encode_metadata,
)
from tierckpt.errors import CorruptCheckpoint, FormatError, UnsupportedObject
from tierckpt.format import CheckpointId, manifest_name, shard_name

# DCP warns that it runs in a single process when no process group is initialized
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _metadata() -> Metadata:
    props = TensorProperties(dtype=torch.bfloat16, requires_grad=True)
    return Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                properties=props,
                size=torch.Size([8, 3]),
                chunks=[
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 3])),
                    ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 3])),
                ],
            ),
            "optim.step": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "optim.step": ("optim", "step", 0)},
        storage_data={
            MetadataIndex("model.w", [0, 0], 0): ItemLocation(0, "0"),
            MetadataIndex("model.w", [4, 0], 1): ItemLocation(1, "0"),
            MetadataIndex("optim.step"): ItemLocation(0, "1"),
        },
        storage_meta=StorageMeta(checkpoint_id="tierckpt:5", save_id="abc", modules=["m"]),
        version="1.0.0",
    )


def test_metadata_round_trip_without_pickle() -> None:
    md = _metadata()
    blob = encode_metadata(md)
    body = json.loads(zstandard.ZstdDecompressor().decompress(blob))
    assert body["format"] == "tierckpt-dcp-metadata"
    back = decode_metadata(blob, where="t")
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data
    assert back.storage_data == md.storage_data
    assert [k.index for k in back.storage_data] == [0, 1, None]  # index hints kept
    assert back.storage_meta == md.storage_meta and back.version == "1.0.0"


def test_metadata_that_would_need_pickle_is_refused() -> None:
    md = _metadata()
    md.planner_data = {"x": object()}
    with pytest.raises(UnsupportedObject, match="cannot store"):
        encode_metadata(md)


def _body_blob(mutate: Any) -> bytes:
    body = json.loads(zstandard.ZstdDecompressor().decompress(encode_metadata(_metadata())))
    mutate(body)
    return zstandard.ZstdCompressor().compress(json.dumps(body).encode())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.update(format="x"),
        lambda b: b.update(version=9),
        lambda b: b["entries"][0][2].update(dtype="object"),
        lambda b: b["entries"][0][2].update(size=[8, -3]),
        lambda b: b["entries"][0][2]["chunk_sizes"].__setitem__(0, 9),  # outside the tensor
        lambda b: b["entries"][0][2].update(n_chunks=3),
        lambda b: b["entries"][0][2]["chunk_offsets"].__setitem__(0, 1.5),
        lambda b: b["entries"][0][2].update(layout="torch.jagged"),
        lambda b: b["storage_data"][0][5].__setitem__(0, "../x"),
        lambda b: b["storage_data"][0][4].__setitem__(0, -1),
        lambda b: b["storage_data"][0][3].append(0),
        lambda b: b["storage_data"][0].__setitem__(1, 99),
        lambda b: b.update(planner_data={"$pickle": "gASV"}),
        lambda b: b["storage_meta"].update(modules=[1]),
    ],
)
def test_hostile_metadata_is_refused(mutate: Any) -> None:
    with pytest.raises(FormatError):
        decode_metadata(_body_blob(mutate), where="t")


def test_garbage_metadata_is_corrupt() -> None:
    with pytest.raises(CorruptCheckpoint):
        decode_metadata(b"\x28\xb5\x2f\xfd garbage", where="t")


def _model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": seed}}


def test_single_process_save_load_falls_back_to_the_next_tier(
    tmp_path: Path, monkeypatch: Any
) -> None:
    tiers = [LocalTier(tmp_path / "a", name="a"), LocalTier(tmp_path / "b", name="b")]
    saved = _model_state(1)
    with TierWriter(tiers, 5, chunk_bytes=4096) as w:
        dcp.save(saved, storage_writer=w, no_dist=True)
    # one shard file per rank per tier, the metadata as zstd JSON, the manifest last
    a = tmp_path / "a"
    assert (a / shard_name(5, 0)).exists() and (a / dcp_metadata_name(5)).exists()
    # a flipped bit in tier a's shard: the reader verifies the chunk and moves to tier b
    p = a / shard_name(5, 0)
    raw = bytearray(p.read_bytes())
    raw[10] ^= 1
    p.write_bytes(bytes(raw))

    def no_pickle(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("pickle used to read tierckpt DCP metadata")

    monkeypatch.setattr(pickle, "load", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    target = _model_state(2)
    dcp.load(target, storage_reader=TierReader(tiers), no_dist=True, planner=SafeLoadPlanner())
    assert dist_workers.same(target, saved) == []


def test_writer_refuses_committed_steps_and_starts_a_timeline_for_older_ones(
    tmp_path: Path,
) -> None:
    tiers = [LocalTier(tmp_path)]
    with TierWriter(tiers, 5) as w:
        dcp.save(_model_state(1), storage_writer=w, no_dist=True)
        with pytest.raises(CheckpointException, match="already committed"):
            dcp.save(_model_state(1), storage_writer=w, no_dist=True)
        # an older step: the run went back; it goes on on a new timeline, step 5 stays
        dcp.save(_model_state(2), storage_writer=w, checkpoint_id=4, no_dist=True)
        dcp.save(_model_state(1), storage_writer=w, checkpoint_id="step-6", no_dist=True)
    assert (tmp_path / manifest_name(5)).exists()
    assert (tmp_path / manifest_name(4, timeline=1)).exists()
    reader = TierReader(tiers)
    target = _model_state(3)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.loaded_step == 6 and reader.loaded_id == CheckpointId(6, 1)
    assert dist_workers.same(target, _model_state(1)) == []
    # a named step: of the newest timeline holding it
    reader = TierReader(tiers, 4)
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert reader.loaded_id == CheckpointId(4, 1)
    assert dist_workers.same(target, _model_state(2)) == []


def test_checkpoint_ids() -> None:
    assert TierWriter.validate_checkpoint_id("12") and TierReader.validate_checkpoint_id("step-3")
    assert not TierWriter.validate_checkpoint_id("/some/folder")
    w = TierWriter([MemoryTier(namespace="ids")])
    with pytest.raises(ValueError, match="needs a step"):
        w.prepare_local_plan(None)  # type: ignore[arg-type]
    w.close()


def test_reader_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointException, match="step 9 is not committed on any tier"):
        dcp.load(_model_state(1), storage_reader=TierReader([LocalTier(tmp_path)], 9), no_dist=True)


# -- FSDP2 on 2, 3 and 4 ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved4(moto_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An FSDP2 model + AdamW saved by 4 ranks as step 10 (dcp.save) and 11 (dcp.async_save),
    to a local folder and to S3, with the unsharded reference state of each."""
    root = tmp_path_factory.mktemp("dcp4")
    bucket = f"tierckpt-dcp-{secrets.token_hex(4)}"
    moto_server.admin.create_bucket(Bucket=bucket)
    s3 = {"bucket": bucket, "endpoint": moto_server.endpoint_url}
    res = dist_workers.run(
        "w_dcp_save", 4, root=str(root), s3=s3, step=10, async_step=11, timeout=150
    )
    assert all(r["placement"] == "(Shard(dim=0),)" for r in res)
    yield {"root": str(root), "s3": s3}
    admin = moto_server.admin
    for page in admin.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            admin.delete_object(Bucket=bucket, Key=o["Key"])
    admin.delete_bucket(Bucket=bucket)


@pytest.mark.distributed
@pytest.mark.s3
def test_fsdp_saved_by_4_ranks_loads_into_2_from_s3(saved4: dict[str, Any]) -> None:
    res = dist_workers.run(
        "w_dcp_load",
        2,
        root=saved4["root"],
        s3=saved4["s3"],
        steps=[10, 11],
        source="s3",
        timeout=120,
    )
    assert res[0]["diff-10"] == [] and res[0]["diff-11"] == []  # equal to the unsharded state
    for r in res:
        assert r["extra-10"] == {"epoch": 3, "tag": "run-a"}
        assert r["extra-11"] == {"epoch": 4, "tag": "run-a"}  # the async_save
        assert r["newest"] == 11


@pytest.mark.distributed
@pytest.mark.s3
def test_fsdp_saved_by_4_ranks_loads_into_3_local_first(saved4: dict[str, Any]) -> None:
    res = dist_workers.run(
        "w_dcp_load",
        3,
        root=saved4["root"],
        s3=saved4["s3"],
        steps=[11],
        source="both",
        timeout=120,
    )
    assert res[0]["diff-11"] == []


@pytest.mark.distributed
def test_fsdp_saved_by_2_ranks_loads_into_4(tmp_path: Path) -> None:
    dist_workers.run("w_dcp_save", 2, root=str(tmp_path), s3=None, step=30, timeout=120)
    res = dist_workers.run(
        "w_dcp_load", 4, root=str(tmp_path), s3=None, steps=[30], source="local", timeout=120
    )
    assert res[0]["diff-30"] == []
    assert all(r["extra-30"] == {"epoch": 3, "tag": "run-a"} and r["newest"] == 30 for r in res)
    # format v2: each shard file under its rank's hashed prefix, the DCP metadata in the
    # step's own folder
    assert sorted(os.listdir(tmp_path / "dcp-local" / "steps" / "000000000030")) == [
        "dcp-metadata.json.zst",
    ]
    for r in (0, 1):
        assert (tmp_path / "dcp-local" / shard_name(30, r)).is_file()


@pytest.mark.distributed
def test_a_private_tier_that_dcp_saves_skip_is_said_once_per_tier(tmp_path: Path) -> None:
    """A RAM tier before a shared one: every multi-rank DCP save skips it, and said so with a
    WARNING at every save. Now once per tier, also with a new writer per save (DCP's idiom:
    the next writer takes the dropped one's pipeline and tiers over)."""
    res = dist_workers.run("w_dcp_private_tier", 2, root=str(tmp_path), timeout=120)
    for r in res:
        assert r["reused"] == ["WARNING", "DEBUG", "DEBUG"], r
        assert r["new_per_save"] == ["WARNING", "DEBUG", "DEBUG"], r
    assert sorted(os.listdir(tmp_path / "idiom" / "manifests")) == [
        manifest_name(s).split("/")[1] for s in (4, 5, 6)
    ]


def test_a_tier_copying_from_another_works_under_dcp(tmp_path: Path) -> None:
    """``source=`` through the DCP writer: tier b copies tier a's file, and reads back alone."""
    tiers = [LocalTier(tmp_path / "a", name="a"), LocalTier(tmp_path / "b", name="b", source="a")]
    saved = _model_state(1)
    with TierWriter(tiers, 5, chunk_bytes=4096) as w:
        dcp.save(saved, storage_writer=w, no_dist=True)
    assert (tmp_path / "b" / shard_name(5, 0)).exists()
    target = _model_state(2)
    reader = TierReader([LocalTier(tmp_path / "b", name="b")])
    dcp.load(target, storage_reader=reader, no_dist=True, planner=SafeLoadPlanner())
    assert reader.loaded_step == 5 and dist_workers.same(target, saved) == []
