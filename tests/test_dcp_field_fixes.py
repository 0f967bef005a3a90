"""``tierckpt.dcp`` field reports: a rollback after a load starts a new timeline, the newest
*DCP* checkpoint is loaded when a native one is newer, the errors of a failed load say what a
``TierReader`` can do, and the location ``dcp.save`` reports loads back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt import Checkpointer, LocalTier
from tierckpt.dcp import TierReader, TierWriter
from tierckpt.format import CheckpointId, manifest_name

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _sd(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), v)}


def _load(tiers: list[LocalTier], step: int | None = None) -> tuple[float, CheckpointId | None]:
    got = _sd(-1.0)
    reader = TierReader(tiers, step)
    dcp.load(got, storage_reader=reader, no_dist=True)
    return float(got["w"][0]), reader.loaded_id


def test_a_save_after_a_load_of_an_older_step_starts_a_new_timeline(tmp_path: Path) -> None:
    """Save 1-4, load step 2, save 3 and 4 with a new writer: a rollback (as ``Checkpointer``
    does), not "Checkpoint already exists" as before; the old timeline's checkpoints stay."""
    tiers = [LocalTier(tmp_path, keep_last=None)]
    with TierWriter(tiers) as w:
        for s in (1, 2, 3, 4):
            dcp.save(_sd(s), storage_writer=w, checkpoint_id=s, no_dist=True)
    assert _load(tiers, 2) == (2.0, CheckpointId(2))
    with TierWriter(tiers) as w:
        dcp.save(_sd(103), storage_writer=w, checkpoint_id=3, no_dist=True)
        dcp.save(_sd(104), storage_writer=w, checkpoint_id=4, no_dist=True)
    assert _load(tiers) == (104.0, CheckpointId(4, 1))
    assert _load(tiers, 3) == (103.0, CheckpointId(3, 1))
    assert (tmp_path / manifest_name(3)).exists()  # timeline 0's step 3 is kept


def test_a_committed_step_saved_again_without_a_load_is_still_refused(tmp_path: Path) -> None:
    """Without a load in between, a step committed on the newest timeline is the checkpoint
    ``checkpoint_id`` names: refused, as ``FileSystemWriter(overwrite=False)`` refuses."""
    tiers = [LocalTier(tmp_path, keep_last=None)]
    with TierWriter(tiers) as w:
        for s in (1, 2, 3):
            dcp.save(_sd(s), storage_writer=w, checkpoint_id=s, no_dist=True)
    with TierWriter(tiers) as w, pytest.raises(CheckpointException, match="already exists"):
        dcp.save(_sd(9), storage_writer=w, checkpoint_id=2, no_dist=True)
    # a load of the newest is no rollback: its step again is refused too
    assert _load(tiers) == (3.0, CheckpointId(3))
    with TierWriter(tiers) as w, pytest.raises(CheckpointException, match="already exists"):
        dcp.save(_sd(9), storage_writer=w, checkpoint_id=3, no_dist=True)


def test_the_newest_dcp_checkpoint_is_loaded_when_a_native_one_is_newer(tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path, keep_last=None)]
    with Checkpointer(tiers) as ck:
        ck.save({"n": torch.ones(3)}, 1).wait()
    with TierWriter(tiers) as w:
        dcp.save(_sd(3), storage_writer=w, checkpoint_id=3, no_dist=True)
    with Checkpointer(tiers) as ck:
        ck.save({"n": torch.ones(3)}, 4).wait()
    assert _load(tiers) == (3.0, CheckpointId(3))  # before: "step 4 is not a DCP checkpoint"


def test_only_native_checkpoints_say_so(tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path, keep_last=None)]
    with Checkpointer(tiers) as ck:
        ck.save({"n": torch.ones(3)}, 1).wait()
    with pytest.raises(CheckpointException, match="native ones: load them with Checkpointer"):
        _load(tiers)


def test_a_failed_load_says_only_what_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No "rank local metadata read failed" after the real error (DCP's per-rank fallback is
    not offered), and no advice to pass ``tier=``, which TierReader does not take."""
    with pytest.raises(CheckpointException) as ei:
        _load([LocalTier(tmp_path)], 9)
    assert "DCP step 9 is not committed on any tier (local: " in str(ei.value)
    assert "rank local metadata" not in str(ei.value)

    def unlisted(
        tiers: object, wait: object = None
    ) -> tuple[dict[str, list[CheckpointId]], dict[str, str]]:
        return {"local": []}, {"local": "PermissionError: access denied"}

    monkeypatch.setattr("tierckpt.dcp._reader.list_tiers", unlisted)
    with pytest.raises(CheckpointException) as ei:  # a tier that cannot be listed
        _load([LocalTier(tmp_path)])
    text = str(ei.value)
    assert "cannot tell whether a checkpoint exists" in text, text
    assert "tier=" not in text and "pass TierReader only the tiers you can read" in text, text
    assert "rank local metadata" not in text, text


def test_the_location_dcp_save_reports_loads_back(tmp_path: Path) -> None:
    tiers = [LocalTier(tmp_path, keep_last=None)]
    with TierWriter(tiers) as w:
        md = dcp.save(_sd(1), storage_writer=w, checkpoint_id=100, no_dist=True)
    with TierWriter(tiers, overwrite=True) as w:
        md2 = dcp.save(_sd(2), storage_writer=w, checkpoint_id=100, no_dist=True)
    assert md.storage_meta is not None and md2.storage_meta is not None
    first, again = md.storage_meta.checkpoint_id, md2.storage_meta.checkpoint_id
    assert str(first).endswith("steps/000000000100") and str(again).endswith(".t000001")
    for cid, want in ((first, 1.0), (again, 2.0)):
        got = _sd(-1.0)
        reader = TierReader(tiers)
        dcp.load(got, storage_reader=reader, checkpoint_id=cid, no_dist=True)
        assert float(got["w"][0]) == want and reader.loaded_step == 100
    assert TierReader.validate_checkpoint_id(str(first))
    # a location on another folder is not this reader's
    other = TierReader([LocalTier(tmp_path / "elsewhere")])
    with pytest.raises(ValueError, match="not one of this TierReader's tiers"):
        other.reset(first)


def test_writer_docstring_says_every_takes_multiples_of_the_step() -> None:
    doc = TierWriter.__doc__ or ""
    assert "counts the saves" not in doc and "multiples of ``N``" in doc


def test_a_load_from_a_location_one_level_off_names_the_tier_location(tmp_path: Path) -> None:
    """A TierReader given the folder above the run's (or one inside it) names the tier's
    folder and the tier folder nearby, as ``Checkpointer.load`` does; a step never saved
    names the newest one there instead of saying "not readable"."""
    run = tmp_path / "run" / "ck"
    with TierWriter([LocalTier(run)]) as w:
        dcp.save(_sd(1), storage_writer=w, checkpoint_id=1, no_dist=True)
    above, inside = tmp_path / "run", run / "manifests"
    with pytest.raises(CheckpointException) as info:
        _load([LocalTier(above)])
    msg = str(info.value)
    assert f"no committed checkpoint on any tier (local: {above})" in msg, msg
    assert f"has tier folders below it: ['{run}']" in msg, msg
    with pytest.raises(CheckpointException) as info:
        _load([LocalTier(inside)])
    assert f"is inside the tier folder {run}" in str(info.value), str(info.value)
    with pytest.raises(CheckpointException) as info:
        _load([LocalTier(run)], 5)
    msg = str(info.value)
    assert (
        f"DCP step 5 is not committed on any tier (local: {run}); the newest there: step 1" in msg
    )
    assert _load([LocalTier(run)]) == (1.0, CheckpointId(1))
