"""Bad input gives a specific error from one family, naming file/chunk/key."""

from __future__ import annotations

import enum
import json
import os
from pathlib import Path

import pytest
import torch

from tierckpt import (
    Checkpointer,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    LocalTier,
    S3Tier,
    TierCkptError,
    UnknownCodec,
    UnsupportedObject,
)
from tierckpt.format import manifest_name, shard_name


def _save(root: Path, step: int = 7, **kw: object) -> dict:
    state = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(10), "meta": {"k": 1}}
    with Checkpointer([LocalTier(root)], chunk_bytes=64 << 10, **kw) as ck:  # type: ignore[arg-type]
        ck.save(state, step=step).wait()
    return state


def _load(root: Path, **kw: object):
    with Checkpointer([LocalTier(root)]) as ck:
        return ck.load(**kw)  # type: ignore[arg-type]


def test_truncated_shard_file(tmp_path: Path) -> None:
    _save(tmp_path)
    f = tmp_path / shard_name(7, 0)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(CorruptCheckpoint, match=r"rank-000000\.tck.*truncated"):
        _load(tmp_path)


def test_flipped_byte_in_a_chunk_names_tier_file_chunk(tmp_path: Path) -> None:
    _save(tmp_path)
    f = tmp_path / shard_name(7, 0)
    data = bytearray(f.read_bytes())
    data[4096 * 17 + 5] ^= 0x40  # inside the second 64 KiB chunk
    f.write_bytes(data)
    with pytest.raises(CorruptCheckpoint, match=r"tier 'local'.*rank-000000\.tck.*chunk 1 ") as ei:
        _load(tmp_path)
    assert isinstance(ei.value.__cause__, CorruptChunk)
    assert ei.value.__cause__.chunk == 1 and ei.value.__cause__.tier == "local"


def test_flipped_byte_in_index_and_footer(tmp_path: Path) -> None:
    _save(tmp_path)
    f = tmp_path / shard_name(7, 0)
    good = f.read_bytes()
    for pos in (len(good) - 64 - 10, len(good) - 30, len(good) - 3):
        bad = bytearray(good)
        bad[pos] ^= 0x01
        f.write_bytes(bad)
        with pytest.raises(CorruptCheckpoint):
            _load(tmp_path)
    f.write_bytes(good)
    assert torch.equal(_load(tmp_path)["b"], torch.ones(10))


def test_manifest_naming_a_missing_file(tmp_path: Path) -> None:
    _save(tmp_path)
    os.unlink(tmp_path / shard_name(7, 0))
    # committed, so not "nothing to resume" (CheckpointNotFound): damage (test_damaged_newest)
    with pytest.raises(CorruptCheckpoint, match=r"rank-000000\.tck does not exist"):
        _load(tmp_path)


def test_corrupt_manifest(tmp_path: Path) -> None:
    _save(tmp_path)
    m = tmp_path / manifest_name(7)
    body = json.loads(m.read_text())
    body["world_size"] = 1
    body["shards"][0]["size"] += 1  # checksum no longer matches
    m.write_text(json.dumps(body))
    with pytest.raises(CorruptCheckpoint, match="manifest checksum"):
        _load(tmp_path)
    m.write_text("{not json")
    with pytest.raises(CorruptCheckpoint, match="not valid JSON"):
        _load(tmp_path)


def test_unknown_codec_id_refused_on_read(tmp_path: Path) -> None:
    _save(tmp_path)
    f = tmp_path / shard_name(7, 0)
    data = f.read_bytes()
    patched = data.replace(b'"codecs":[{"id":"raw"}]', b'"codecs":[{"id":"ro0"}]')
    assert patched != data
    # re-seal index + footer so only the codec id is wrong
    from tierckpt.format import FOOTER_SIZE, Footer, checksum

    footer = Footer.decode(data[-FOOTER_SIZE:], file_size=len(data), where="x")
    index = patched[footer.index_offset : -FOOTER_SIZE]
    new_footer = Footer(footer.index_offset, len(index), checksum(index), len(patched))
    f.write_bytes(patched[: footer.index_offset] + index + new_footer.encode())
    m = tmp_path / manifest_name(7)
    body = json.loads(m.read_text())
    body.pop("checksum")
    body["shards"][0]["index_checksum"] = checksum(index)
    from tierckpt.format import checksum as ck_sum

    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["checksum"] = ck_sum(canon.encode())
    m.write_text(json.dumps(body))
    with pytest.raises(UnknownCodec, match="unknown codec id 'ro0'.*known codecs"):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"a": {"b": [1, object()]}}, r"builtins\.object at \['a'\]\['b'\]\[1\]"),
        ({"f": lambda: 0}, r"function at \['f'\]"),
        ({"s": {1, 2}}, r"builtins\.set at \['s'\]"),
        ({"sparse": torch.eye(3).to_sparse()}, r"\['sparse'\].*layout"),
    ],
)
def test_unsupported_object_refused_at_save(tmp_path: Path, state: object, where: str) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(UnsupportedObject, match=where):
            ck.save(state, step=1)
        assert ck.steps() == []
        assert not (tmp_path / "steps").exists()


def test_missing_step_and_empty_tier(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="no committed checkpoint"):
        _load(tmp_path)
    _save(tmp_path)
    with pytest.raises(CheckpointNotFound, match=r"step 8 is not committed.*\[7\]"):
        _load(tmp_path, step=8)
    assert isinstance(CheckpointNotFound("x"), FileNotFoundError)


def test_bad_step_values(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        for bad in (-1, 1.5, "3", 10**13):
            with pytest.raises((ValueError, FormatError)):
                ck.save({}, step=bad)  # type: ignore[arg-type]


def test_interrupted_save_is_invisible(tmp_path: Path) -> None:
    """A save whose manifest was never written: data present, no manifest."""
    _save(tmp_path, step=7)
    _save(tmp_path / "other", step=9)
    # simulate a crash after the shard file landed but before the manifest
    os.makedirs((tmp_path / shard_name(9, 0)).parent)
    os.replace(tmp_path / "other" / shard_name(9, 0), tmp_path / shard_name(9, 0))
    (tmp_path / f"{shard_name(9, 0)}.abcdef.tmp").write_bytes(b"x" * 100)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert ck.steps() == [7]
        assert torch.equal(ck.load()["b"], torch.ones(10))
        # the next committed save cleans the leftovers
        ck.save({"x": torch.zeros(1)}, step=10).wait()
    assert not (tmp_path / shard_name(9, 0)).parent.exists()


def test_every_error_is_in_the_family() -> None:
    for cls in (
        CheckpointNotFound,
        CorruptCheckpoint,
        CorruptChunk,
        FormatError,
        UnknownCodec,
        UnsupportedObject,
    ):
        assert issubclass(cls, TierCkptError)
    assert issubclass(UnsupportedObject, TypeError)
    assert issubclass(CorruptChunk, ValueError)


def test_a_file_that_cannot_be_read_is_not_called_unwritable() -> None:
    """EACCES on a read said "not writable by this user ... give the tier a writable
    folder", sending the operator to the wrong fix."""
    import errno as _errno

    from tierckpt.backends.local import _os_error

    denied = PermissionError(_errno.EACCES, "Permission denied")
    read = str(_os_error("/ck", "de/steps/1/rank-000000.tck", "open", denied))
    assert "not readable by this user" in read and "writable" not in read
    assert "not writable by this user" in str(_os_error("/ck", "x", "create", denied))


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_a_mistyped_store_option_is_refused_by_the_tier_naming_the_right_one(driver: str) -> None:
    """``S3Tier(..., endpoint=...)`` (for ``endpoint_url``) was accepted and failed only at the
    Checkpointer, as ``TypeError: ObjectStoreBackend.__init__() got an unexpected keyword
    argument 'endpoint'``; now the tier refuses it and suggests the name."""
    from tierckpt import AzureTier, GCSTier, S3Tier

    with pytest.raises(TypeError, match=r"S3Tier\(\) got unexpected .*endpoint \(did you mean "):
        S3Tier("s3://bucket/p", endpoint="http://127.0.0.1:9", driver=driver)
    with pytest.raises(TypeError, match=r"evry \(did you mean every\?\)"):
        S3Tier("s3://bucket/p", evry=2, driver=driver)
    tier = S3Tier("s3://bucket/p", endpoint_url="http://127.0.0.1:9", every=2, driver=driver)
    assert tier.options == {"endpoint_url": "http://127.0.0.1:9"} and tier.every == 2
    for cls, url in ((GCSTier, "gs://b/p"), (AzureTier, "az://c/p")):
        with pytest.raises(TypeError, match=rf"{cls.__name__}\(\) got .*endpont_url \(did you"):
            cls(url, endpont_url="http://127.0.0.1:9")


def test_a_file_given_for_a_local_tier_folder_says_so(tmp_path: Path) -> None:
    """A file where the tier's folder (or one above it) should be: the error says that a
    folder is needed (it said only "[Errno 17] ...: create folder failed: File exists")."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    for where in (afile, afile / "sub"):
        with pytest.raises(TierCkptError, match="where a folder is needed") as ei:
            Checkpointer([LocalTier(where)])
        assert str(where) in str(ei.value)
    assert afile.read_text() == "x"


def test_a_load_from_a_folder_one_level_off_names_the_tier_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The resume idiom (``except CheckpointNotFound: start afresh``) given the folder above
    the one the saves went to, or one inside it: the error and a warning name the tier
    folder, so the job that starts from step 0 says why."""
    run = tmp_path / "runs" / "ck"
    _save(run)
    caplog.set_level("WARNING", logger="tierckpt")
    with pytest.raises(CheckpointNotFound, match="has tier folders below it") as above:
        _load(tmp_path / "runs")
    assert str(run) in str(above.value)
    assert str(run) in caplog.text
    with pytest.raises(CheckpointNotFound, match="is inside the tier folder") as inside:
        _load(run / "manifests")
    assert f"inside the tier folder {run}" in str(inside.value)
    with pytest.raises(CheckpointNotFound, match=r"step 3 is not committed.*inside the tier"):
        _load(run / "sub", step=3)
    caplog.clear()
    with pytest.raises(CheckpointNotFound) as fresh:  # a first start: nothing near, no warning
        _load(tmp_path / "elsewhere")
    assert "tier folder" not in str(fresh.value) and "tier folder" not in caplog.text


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_a_load_from_a_prefix_one_level_off_names_the_tier_prefix(
    s3_server,  # type: ignore[no-untyped-def]
    s3_bucket,  # type: ignore[no-untyped-def]
    caplog: pytest.LogCaptureFixture,
    driver: str,
) -> None:
    """The object-store form, for the job restored on a new cluster from the prefix above
    the one its saves went to, or one inside it: the error and a warning name the tier
    prefix (listed from the bucket's root with the tier's own endpoint and driver)."""
    ep = s3_server.endpoint_url
    run = f"s3://{s3_bucket(s3_server)}/jobs/run-7"
    with Checkpointer([S3Tier(run, endpoint_url=ep, driver=driver)]) as ck:
        ck.save({"w": torch.ones(10)}, step=1).wait()

    def load(url: str) -> None:
        with Checkpointer([S3Tier(url, endpoint_url=ep, driver=driver)]) as ck:
            ck.load()

    caplog.set_level("WARNING", logger="tierckpt")
    with pytest.raises(CheckpointNotFound, match="has tier prefixes below it") as above:
        load(run.rsplit("/", 1)[0])
    assert run in str(above.value) and run in caplog.text
    with pytest.raises(CheckpointNotFound, match="is inside the tier prefix") as inside:
        load(f"{run}/manifests")
    assert f"inside the tier prefix {run}" in str(inside.value)
    caplog.clear()
    with pytest.raises(CheckpointNotFound) as fresh:  # a first start: nothing near, no warning
        load(run + "-new")
    assert "tier prefix" not in str(fresh.value) and "tier prefix" not in caplog.text


def test_a_damaged_newest_names_the_older_steps_and_the_fallback(tmp_path: Path) -> None:
    _save(tmp_path, step=5)
    _save(tmp_path, step=7)
    f = tmp_path / shard_name(7, 0)
    os.truncate(f, f.stat().st_size - 100)
    with pytest.raises(
        CorruptCheckpoint, match=r"Older committed steps: \[5\].*fallback='previous'"
    ):
        _load(tmp_path)
    assert torch.equal(_load(tmp_path, fallback="previous")["b"], torch.ones(10))
    alone = tmp_path / "alone"  # the only checkpoint: nothing older to advise
    _save(alone, step=7)
    os.truncate(alone / shard_name(7, 0), (alone / shard_name(7, 0)).stat().st_size - 100)
    with pytest.raises(CorruptCheckpoint, match="truncated") as info:
        _load(alone)
    assert "Older committed steps" not in str(info.value)


def test_a_load_right_after_save_says_the_save_is_still_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from tierckpt.backends.local import LocalBackend

    release = threading.Event()
    opened = LocalBackend.open_writer

    def held(self: LocalBackend, name: str) -> object:
        release.wait(60)  # the tier's copy cannot finish until the load has looked
        return opened(self, name)

    monkeypatch.setattr(LocalBackend, "open_writer", held)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"w": torch.ones(4)}, step=3)
        with pytest.raises(CheckpointNotFound, match=r"still saving step\(s\) \[3\].*ck.wait\(\)"):
            ck.load()
        release.set()
        ck.wait()
        assert torch.equal(ck.load()["w"], torch.ones(4))


class _Phase(enum.Enum):
    TRAIN = "train"


def test_an_unsupported_value_is_told_how_to_convert_it(tmp_path: Path) -> None:
    import argparse
    import collections
    import dataclasses
    import datetime
    import pathlib

    import numpy as np

    @dataclasses.dataclass
    class Config:
        lr: float = 0.1

    pair = collections.namedtuple("pair", "a b")
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        for value, hint in (
            (torch.Generator(), r"x\.get_state\(\)"),
            (Config(), r"dataclasses\.asdict\(x\)"),
            (pair(1, 2), r"x\._asdict\(\)"),
            (object(), r"\.state_dict\(\), \.tolist\(\) or str\(\)"),
            # the values a training script keeps, each told its own way (a field test found
            # them all told "e.g. with .state_dict(), .tolist() or str()")
            (argparse.Namespace(lr=0.1), r"vars\(x\)"),
            (pathlib.Path("/data"), r"str\(x\), rebuilt with pathlib\.Path"),
            ({1, 2}, r"sorted\(x\)"),
            (_Phase.TRAIN, r"x\.value"),
            (datetime.datetime(2026, 1, 1), r"x\.isoformat\(\)"),
            (collections.defaultdict(int), r"dict\(x\)"),
            (np.str_("adam"), r"x\.item\(\)"),
        ):
            with pytest.raises(UnsupportedObject, match=hint):
                ck.save({"v": value}, 1)
        assert ck.steps() == []
