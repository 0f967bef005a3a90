"""Rollback and resume: a run resumed from an older step is a new timeline.

Rolling back after a loss spike is routine: load step 6 of a run that reached 10, train on,
save 7, 8, ... The resumed run's checkpoints are on a new timeline, newer than every
checkpoint of the abandoned run whatever their step numbers: retention keeps the newest
``(timeline, step)`` ids, so the resumed run's commits are never deleted in favour of the
abandoned run's (which go as they become older), a save at a step the abandoned run also
holds is no collision, and ``load()`` returns the newest step of the newest timeline.

The main scenario runs each phase in a fresh process (started from a forkserver: a fork of a
process that imported torch and never ran a checkpointer), on a local tier and on a local +
S3 tier (moto), with ``keep_last`` 1, 2 and 3. The tests check the behaviour with the API every
tierckpt version has (``steps()``, ``load()``, save handles) before the timeline API, so
that on a tierckpt without timelines they fail for what went wrong, not for a missing name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import dist_workers
import pytest
import timeline_child
import torch
from golden_state import golden_state
from helpers import assert_same
from rel_util import Recorder

from tierckpt import Checkpointer, CheckpointFailed, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main as cli_main
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.format import manifest_name, shard_name
from tierckpt.retention import delete_step

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "format_v1"
TRAINED = 10  # the run that is abandoned reached this step
# 6: the archive (every=3) holds steps 3, 6, 9 of the abandoned run
ROLLBACK = 6  # the step the resumed run loads
UNTIL = 11  # the resumed run saves ROLLBACK+1..UNTIL (7..10 collide with abandoned steps)


def _phase(phase: str, spec: dict[str, Any], out: Path, timeout: float = 300) -> Any:
    """Run one phase of ``timeline_child`` in a fresh process; its result."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "TIERCKPT_"))}
    proc = dist_workers._context().Process(
        target=timeline_child.run, args=(phase, spec, str(out), env)
    )
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        raise AssertionError(f"{phase}: still running after {timeout} s")
    err = out / "error.txt"
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    if err.exists() or proc.exitcode != 0:
        detail = err.read_text() if err.exists() else f"exit code {proc.exitcode}"
        raise AssertionError(f"{phase} failed:\n{detail}\n--- log:\n{log[-4000:]}")
    return json.loads((out / "result.json").read_text())


def _kept(keep: int, resumed: list[int]) -> list[list[int]]:
    """What retention must leave on a ``keep_last`` tier: the ``keep`` newest of every
    checkpoint committed so far, newest by (timeline, step); ``[step, timeline]``, oldest
    first."""
    every = [(0, s) for s in range(1, TRAINED + 1)] + [(1, s) for s in resumed]
    return [[s, t] for t, s in sorted(every)[-keep:]]


def _archived(resumed: list[int]) -> list[list[int]]:
    """What the archive holds: the steps that are multiples of 3 (``every=3`` counts steps,
    in the abandoned run and in the resumed one alike), all kept."""
    ids = [[s, 0] for s in range(1, TRAINED + 1) if s % 3 == 0]
    return ids + [[s, 1] for s in resumed if s % 3 == 0]


def _newest_per_step(ids: list[list[int]]) -> list[list[int]]:
    best: dict[int, int] = {}
    for s, t in ids:
        best[s] = max(t, best.get(s, t))
    return sorted(([s, t] for s, t in best.items()), key=lambda c: (c[1], c[0]))


def _marker(state: Any) -> list[int]:
    return [int(state["run"]), int(state["step"])]


def _state(run: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((1000,), float(run * 1000 + step)), "step": step, "run": run}


# -- the scenario, in real processes ------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 2, 3])
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_rollback_in_a_fresh_process_keeps_the_resumed_runs_checkpoints(
    where: str, keep: int, tmp_path: Path, request: pytest.FixtureRequest, record: Recorder
) -> None:
    """Tiers: ``local`` (and ``s3``) keep the last ``keep`` checkpoints; ``archive`` gets the
    steps that are multiples of 3 and keeps them all (the operator finds step 6 there). Each
    phase is a fresh process."""
    spec: dict[str, Any] = {
        "local": str(tmp_path / "local"),
        "archive": str(tmp_path / "archive"),
        "keep_last": keep,
    }
    if where == "s3":
        server = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")(server)
        spec["s3"] = {"bucket": bucket, "endpoint": server.endpoint_url}
    kept_tiers = ["local", "s3"] if where == "s3" else ["local"]

    trained = _phase("train", {**spec, "steps": TRAINED}, tmp_path / "train")
    for t in kept_tiers:
        assert trained["steps"][t] == list(range(TRAINED - keep + 1, TRAINED + 1))
    assert trained["steps"]["archive"] == [3, ROLLBACK, 9]

    # a fresh process goes back to step 6 and trains on: 7..10 collide with abandoned steps
    resumed = _phase("resume", {**spec, "load_step": ROLLBACK, "until": UNTIL}, tmp_path / "resume")
    assert resumed["loaded"] == [1, ROLLBACK]
    saved: list[int] = []
    for sv in resumed["saves"]:
        saved.append(sv["step"])
        # the behaviour: committed, and still there once the handle said so (after retention)
        assert not sv["error"] and sv["committed"], sv
        for t in sv["tiers"]:
            assert sv["step"] in sv["steps"][t], f"{where}: step {sv['step']} gone from {t}: {sv}"
        # the ids: a new timeline; retention keeps the newest ids, so every checkpoint of the
        # resumed run within keep_last stays and abandoned ones go only as they become older
        assert sv["timeline"] == 1
        for t in kept_tiers:
            assert sv["ids"][t] == _kept(keep, saved), (t, sv)
        assert sv["ids"]["archive"] == _archived(saved)
    log = (tmp_path / "resume" / "log.txt").read_text()
    assert (
        f"step {ROLLBACK + 1} is not after the newest checkpoint (step 10, timeline 0): "
        "starting timeline 1" in log
    )

    # a fresh process loads the resumed run's newest, and its steps, never the abandoned ones
    everywhere = sorted(
        {tuple(c) for c in _kept(keep, saved) + _archived(saved)}, key=lambda c: (c[1], c[0])
    )
    new_steps = [s for s, t in everywhere if t == 1]
    view = _phase("load", {**spec, "load_steps": [ROLLBACK, *new_steps]}, tmp_path / "load")
    assert view["newest"] == [2, UNTIL]
    assert view["by_step"] == {str(ROLLBACK): [1, ROLLBACK], **{str(s): [2, s] for s in new_steps}}
    assert view["ids"] == [list(c) for c in everywhere]
    assert view["steps"] == [s for s, _ in _newest_per_step([list(c) for c in everywhere])]
    record(
        "timelines",
        f"{where}, keep_last={keep}: load step {ROLLBACK} of a run at {TRAINED}, save "
        f"{ROLLBACK + 1}..{UNTIL}",
        f"every new step committed and kept; fresh load() = resumed step {UNTIL}; "
        f"kept {_kept(keep, saved)}",
    )


# -- several ranks --------------------------------------------------------------------------------


@pytest.mark.distributed
def test_two_ranks_agree_on_the_timeline_of_a_rollback(tmp_path: Path, record: Recorder) -> None:
    """The ranks choose the timeline from their own view of the tiers, and their views differ:
    rank 0's node-local disk still holds the abandoned steps 4 and 5, rank 1's does not (its
    node was replaced) and neither does the shared folder. Every rank must still write the
    same checkpoint ids, or the shared commit waits for records that never come."""
    env = {"TIERCKPT_PRIVATE_TIERS": "nvme"}
    dist_workers.run("w_timeline_rollback", 2, root=str(tmp_path), phase="train", env=env)
    for folder in ("shared", "nvme-1"):
        for s in (4, 5):
            delete_step(LocalBackend(tmp_path / folder), s)
    res = dist_workers.run(
        "w_timeline_rollback", 2, root=str(tmp_path), phase="resume", env=env, timeout=180
    )
    for rank, r in enumerate(res):
        assert r["errors"] == [], (rank, r["errors"])
        assert r["loaded_diff"] == [] and r["newest_diff"] == [], (rank, r)
        assert r["timelines"] == [1, 1, 1], (rank, r["timelines"])
        assert r["ids"] == {"shared": [[4, 1], [5, 1], [6, 1]], "nvme": [[4, 1], [5, 1], [6, 1]]}
    record("timelines", "2 ranks (gloo), rollback with differing views", "both on timeline 1")


# -- the format ---------------------------------------------------------------------------------


def test_v1_golden_checkpoint_is_timeline_0_and_keeps_its_names(tmp_path: Path) -> None:
    from tierckpt.format import CheckpointId, decode_manifest, encode_manifest

    root = tmp_path / "raw"
    shutil.copytree(FIXTURES / "raw", root)
    golden = (root / manifest_name(42)).read_bytes()
    m = decode_manifest(golden, where="golden")
    assert m.timeline == 0 and m.id == CheckpointId(42)
    assert encode_manifest(m) == golden  # a timeline-0 manifest is byte for byte a v1 one
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        assert ck.checkpoints() == [CheckpointId(42, 0)]
        assert_same(golden_state(), ck.load())
        h = ck.save(_state(1, 43), 43)
        h.wait(timeout=60)
        assert h.timeline == 0
        assert (root / "manifests" / "step-000000000043.json").exists()
        assert (root / shard_name(43, 0)).exists()  # format v2 beside the v1 golden files
        # an older step saved by the same object: the run went back, a new timeline
        h = ck.save(_state(2, 40), 40)
        h.wait(timeout=60)
        assert h.timeline == 1
        assert (root / "manifests" / "step-000000000040.t000001.json").exists()
        assert (root / shard_name(40, 0, timeline=1)).exists()
        assert shard_name(40, 0, timeline=1).endswith("/steps/000000000040.t000001/rank-000000.tck")
        assert ck.checkpoints() == [CheckpointId(42), CheckpointId(43), CheckpointId(40, 1)]
        assert ck.steps() == [42, 43, 40]
        assert _marker(ck.load()) == [2, 40]
        assert_same(golden_state(), ck.load(42))


def test_names_ids_and_manifests() -> None:
    from tierckpt.format import (
        CheckpointId,
        Manifest,
        ShardRef,
        decode_manifest,
        encode_manifest,
        parse_data_folder,
        parse_manifest_id,
        rank_failure_name,
        rank_record_name,
        step_prefix,
    )

    assert manifest_name(8) == "manifests/step-000000000008.json"
    assert manifest_name(8, timeline=1) == "manifests/step-000000000008.t000001.json"
    assert step_prefix(8, timeline=12) == "steps/000000000008.t000012/"
    assert shard_name(8, 3, timeline=1, prefixes=0) == "steps/000000000008.t000001/rank-000003.tck"
    assert shard_name(8, 3, timeline=1).endswith("/steps/000000000008.t000001/rank-000003.tck")
    assert rank_record_name(8, 3, timeline=1).startswith("steps/000000000008.t000001/")
    assert rank_failure_name(8, 3, timeline=1).startswith("steps/000000000008.t000001/")
    for cid in (CheckpointId(8), CheckpointId(8, 1), CheckpointId(10**12 - 1, 10**6 - 1)):
        assert parse_manifest_id(manifest_name(cid.step, timeline=cid.timeline)) == cid
        assert parse_data_folder(shard_name(cid.step, 0, timeline=cid.timeline)) == cid
    # one name per checkpoint: timeline 0 has no suffix; other shapes are not manifests
    for bad in (
        "manifests/step-000000000008.t000000.json",
        "manifests/step-000000000008.t1.json",
        "manifests/step-000000000008.t0000001.json",
        "manifests/step-8.json",
    ):
        assert parse_manifest_id(bad) is None, bad
    assert parse_data_folder("steps/000000000008.t000000/rank-000000.tck") is None
    with pytest.raises(FormatError):
        manifest_name(8, timeline=10**6)
    with pytest.raises(FormatError):
        CheckpointId(8, -1)
    # newest = the largest id: a newer timeline beats a higher step
    assert CheckpointId(100, 0) < CheckpointId(8, 1) < CheckpointId(9, 1)
    assert max([CheckpointId(100), CheckpointId(8, 1)]) == CheckpointId(8, 1)

    ref = ShardRef(0, shard_name(8, 0, timeline=2), 4096, "0" * 16)
    m = Manifest(8, 1, (ref,), 1.0, "x", timeline=2)
    body = json.loads(encode_manifest(m))
    assert body["timeline"] == 2
    assert decode_manifest(encode_manifest(m), where="t").id == CheckpointId(8, 2)
    assert "timeline" not in json.loads(
        encode_manifest(Manifest(8, 1, (ShardRef(0, shard_name(8, 0), 4096, "0" * 16),), 1.0, "x"))
    )
    # a shard outside its own timeline's folder is refused
    with pytest.raises(FormatError, match="outside step 8's folder"):
        decode_manifest(encode_manifest(Manifest(8, 1, (ref,), 1.0, "x", timeline=1)), where="t")


@pytest.mark.parametrize("value", [-1, 10**6, "1", 1.0, None, True])
def test_hostile_timeline_in_a_manifest_is_refused(value: Any, tmp_path: Path) -> None:
    from rel_util import seal_manifest

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save(_state(1, 8), 8).wait(timeout=60)
    path = tmp_path / manifest_name(8)
    body = json.loads(path.read_bytes())
    body["timeline"] = value
    path.write_bytes(seal_manifest(body))
    with Checkpointer([LocalTier(tmp_path)]) as ck, pytest.raises(FormatError):
        ck.load()


def test_a_manifest_whose_timeline_disagrees_with_its_name_is_refused(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save(_state(1, 8), 8).wait(timeout=60)
        ck.load(8)
        ck.save(_state(2, 8), 8).wait(timeout=60)  # after a load: a new timeline
    # timeline 1's manifest (it names timeline 1's shard) put under timeline 0's name
    (tmp_path / manifest_name(8)).unlink()
    os.link(tmp_path / manifest_name(8, timeline=1), tmp_path / manifest_name(8))
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(FormatError, match="timeline 1's, not timeline 0's"):
            ck.load(8, timeline=0)
        assert _marker(ck.load(8)) == [2, 8]


# -- in one process: load, fallback, retries, leftovers ------------------------------------------


def _rolled_back(root: Path, keep: int | None = None) -> None:
    """Run 1 saves 1..6; it goes back to step 3; run 2 saves 4 and 5 (timeline 1)."""
    with Checkpointer([LocalTier(root, keep_last=keep)]) as ck:
        for s in range(1, 7):
            ck.save(_state(1, s), s).wait(timeout=60)
        assert _marker(ck.load(3)) == [1, 3]
        for s in (4, 5):
            h = ck.save(_state(2, s), s)
            h.wait(timeout=60)
            assert h.timeline == 1


def test_load_steps_and_fallback_follow_the_newest_timeline(tmp_path: Path) -> None:
    from tierckpt.format import CheckpointId

    _rolled_back(tmp_path)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        assert ck.steps() == [1, 2, 3, 6, 4, 5]  # one per step, the last is load()'s
        assert ck.checkpoints()[-3:] == [CheckpointId(6), CheckpointId(4, 1), CheckpointId(5, 1)]
        assert _marker(ck.load()) == [2, 5]
        assert _marker(ck.load(4)) == [2, 4]  # the newest timeline holding step 4
        assert _marker(ck.load(4, timeline=0)) == [1, 4]  # the abandoned one, by name
        assert _marker(ck.load(6)) == [1, 6]
        assert _marker(ck.load(timeline=0)) == [1, 6]
    # the resumed run's checkpoints are unreadable: fallback goes back along its history, to
    # step 3, never to the abandoned run's 6, 5 or 4
    for s in (4, 5):
        p = tmp_path / shard_name(s, 0, timeline=1)
        raw = bytearray(p.read_bytes())
        raw[100] ^= 0xFF
        p.write_bytes(bytes(raw))
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(CorruptCheckpoint):
            ck.load()
        assert _marker(ck.load(fallback="previous")) == [1, 3]
        assert _marker(ck.load(5, fallback="previous")) == [1, 3]
        assert _marker(ck.load(6, fallback="previous")) == [1, 6]


def test_a_retry_of_the_same_step_stays_on_its_timeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed save retried at the same step commits on the same timeline; a step already
    committed on that timeline is refused, never overwritten."""
    real_open = LocalBackend.open_writer
    fail = [True]

    def open_writer(self: LocalBackend, name: str) -> Any:
        if fail[0] and name == shard_name(2, 0):
            raise OSError(28, "No space left on device")
        return real_open(self, name)

    monkeypatch.setattr(LocalBackend, "open_writer", open_writer)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        ck.save(_state(1, 1), 1).wait(timeout=60)
        with pytest.raises(CheckpointFailed):
            ck.save(_state(1, 2), 2).wait(timeout=60)
        fail[0] = False
        h = ck.save(_state(1, 2), 2)
        h.wait(timeout=60)
        assert h.timeline == 0
        h = ck.save(_state(9, 2), 2)
        with pytest.raises(CheckpointFailed, match="already committed"):
            h.wait(timeout=60)
        assert h.timeline == 0
        assert _marker(ck.load()) == [1, 2]
        assert ck.steps() == [1, 2]


def test_leftovers_go_only_when_older_than_the_newest_checkpoint(tmp_path: Path) -> None:
    """A killed save of the abandoned run (no manifest) goes once the resumed run commits; a
    data folder of the resumed run's newer timeline is never taken for a leftover."""
    from tierckpt.format import CheckpointId
    from tierckpt.retention import gc_tier

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for s in range(1, 11):
            ck.save(_state(1, s), s).wait(timeout=60)
    b = LocalBackend(tmp_path)
    b.put_atomic(shard_name(11, 0), b"killed while saving step 11 of the abandoned run")
    b.put_atomic(shard_name(9, 0, timeline=1), b"the resumed run's step 9, still being written")
    assert gc_tier(b, 5) == [CheckpointId(s) for s in range(1, 6)]
    assert b.exists(shard_name(11, 0)) and b.exists(shard_name(9, 0, timeline=1))
    with Checkpointer([LocalTier(tmp_path, keep_last=3)]) as ck:
        ck.load(7)
        h = ck.save(_state(2, 8), 8)
        h.wait(timeout=60)
        assert h.timeline == 1
        assert ck.checkpoints() == [CheckpointId(9), CheckpointId(10), CheckpointId(8, 1)]
    assert not b.exists(shard_name(11, 0))  # older than (8, timeline 1): a leftover
    assert b.exists(shard_name(9, 0, timeline=1))  # newer: perhaps still being written


# -- the command line -----------------------------------------------------------------------------


def test_tierckpt_ls_shows_the_abandoned_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _rolled_back(tmp_path)
    assert cli_main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [ln.split() for ln in out.splitlines()]
    assert lines[0][-2:] == ["TIMELINE", "STATUS"]
    rows = [ln for ln in lines[2:] if ln and ln[0].isdigit()]
    assert [(r[0], r[-2]) for r in rows if r[-1] == "abandoned"] == [
        (str(s), "0") for s in range(1, 7)
    ]
    assert [r[0] for r in rows if r[-1] != "abandoned"] == ["4", "5"]
    assert rows[-1][-1] == "newest"
    assert "abandoned: checkpoints of an older timeline" in out

    assert cli_main(["ls", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["timeline"], c["abandoned"]) for c in doc["checkpoints"]] == [
        *[(s, 0, True) for s in range(1, 7)],
        (4, 1, False),
        (5, 1, False),
    ]
    # commands that take a step pick the newest timeline holding it, or the one named
    assert cli_main(["verify", str(tmp_path), "--step", "4"]) == 0
    assert "ok  step 4 (timeline 1):" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path), "--step", "4", "--timeline", "0"]) == 0
    assert "ok  step 4:" in capsys.readouterr().out
    assert cli_main(["inspect", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["step"], doc["timeline"]) == (5, 1)
    assert cli_main(["gc", str(tmp_path), "--keep-last", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "keeping step(s) 4 (timeline 1), 5 (timeline 1)" in out
    assert "would delete 6 expired checkpoint(s): 1, 2, 3, 4, 5, 6" in out


# -- integrations -------------------------------------------------------------------------------


def test_lightning_plugin_saves_the_resumed_runs_steps(tmp_path: Path) -> None:
    """Resumed from an older checkpoint, the plugin saves the steps the abandoned run also
    saved (it used to skip every step committed on the tiers)."""
    pytest.importorskip("lightning")
    from tierckpt.integrations.lightning import TierCkptIO

    def ckpt(step: int, value: float) -> dict[str, Any]:
        return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), value)}}

    tiers = [LocalTier(tmp_path / "tier", keep_last=None)]
    io = TierCkptIO(tiers)
    for s in (1, 2, 3):
        io.save_checkpoint(ckpt(s, 1.0), str(tmp_path / "c" / f"step={s}.ckpt"))
    io.close()
    io = TierCkptIO(tiers)
    io.load_checkpoint(str(tmp_path / "c" / "step=1.ckpt"))
    io.save_checkpoint(ckpt(1, 2.0), str(tmp_path / "c" / "again.ckpt"))  # the loaded step
    io.save_checkpoint(ckpt(2, 2.0), str(tmp_path / "c" / "step=2.ckpt"))
    io.checkpointer.wait()
    loaded = io.load_checkpoint(str(tmp_path / "c" / "step=2.ckpt"))
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4,), 2.0))
    # a save at the loaded step is saved too (its content may differ from the loaded one's:
    # here it does), on the new timeline with 2; 3 is the abandoned run's
    again = io.load_checkpoint(str(tmp_path / "c" / "again.ckpt"))
    assert torch.equal(again["state_dict"]["w"], torch.full((4,), 2.0))
    assert io.checkpointer.steps() == [3, 1, 2]
    io.close()
