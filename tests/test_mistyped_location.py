"""A mistyped location: a reader leaves it uncreated, and the not-found error names it.

The 3 a.m. case: a restart points at ``/ckpt/run1`` where the run is ``/ckpt/run-1``. A
``TierReader`` (a reader: it writes nothing) used to create the folder it was given; and
``Checkpointer.load()``'s "no committed checkpoint" named the tier only ("(local)"), not the
folder it looked in, so the typo did not show.
"""

from __future__ import annotations

import os

import pytest
import torch

import tierckpt
from tierckpt.backends.local import LocalBackend
from tierckpt.dcp import TierReader
from tierckpt.errors import CheckpointNotFound


def test_a_reader_leaves_a_mistyped_folder_uncreated(tmp_path):
    typo = tmp_path / "no-such" / "run1"
    reader = TierReader(str(typo))
    with pytest.raises(CheckpointNotFound, match=str(typo)):
        reader.read_metadata()
    assert not (tmp_path / "no-such").exists()


def test_a_backend_opened_without_create_lists_empty_and_its_first_write_makes_it(tmp_path):
    root = tmp_path / "later"
    backend = LocalBackend(root, create=False)
    assert not root.exists()
    assert backend.list("") == []
    backend.put_atomic("x.json", b"{}")
    assert backend.get("x.json") == b"{}"
    # a writer's backend still makes its folder at once
    LocalBackend(tmp_path / "now")
    assert (tmp_path / "now").is_dir()


def test_a_file_where_a_reader_expects_a_folder_is_still_an_error(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(Exception, match="f"):
        LocalBackend(tmp_path / "f", create=False)


def test_checkpointer_not_found_names_the_folder_it_looked_in(tmp_path):
    real = tmp_path / "run-1"
    with tierckpt.Checkpointer(str(real)) as ck:
        ck.save({"w": torch.ones(3)}, 1).wait()
    typo = tmp_path / "run1"
    with tierckpt.Checkpointer(str(typo)) as ck, pytest.raises(CheckpointNotFound) as ei:
        ck.load()
    assert f"local: {typo}" in str(ei.value), str(ei.value)
    assert os.path.isdir(real / "manifests")


def test_steps_on_the_folder_above_a_run_warns_where_the_checkpoints_are(
    tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    # `if ck.steps(): ck.load()` with the parent folder given: an empty list, and the job
    # trained from step 0 without a word (the hint was only in load()'s error and the CLI)
    run = tmp_path / "runs" / "run1"
    with tierckpt.Checkpointer(str(run)) as ck:
        ck.save({"w": torch.ones(3)}, 1).wait()
    above = tierckpt.Checkpointer(str(tmp_path / "runs"))
    with caplog.at_level("WARNING", logger="tierckpt"), above as ck:
        assert ck.steps() == []
        assert ck.steps() == []  # said once
    said = [r.getMessage() for r in caplog.records if "found no checkpoint" in r.getMessage()]
    assert len(said) == 1 and str(run) in said[0], said
