"""NodeRamTier: checkpoints in /dev/shm that survive a killed process; its budget; dead runs.

Every test works in its own folder of /dev/shm, removed after it. Reads are counted by
wrapping the tiers' backends (``peer_workers.ReadCounter``).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import peer_workers
import pytest
import torch
from dist_workers import rank_state, same

from tierckpt import BackendError, Checkpointer, CheckpointNotFound, LocalTier, NodeRamTier
from tierckpt.cli import main as cli_main
from tierckpt.distributed import is_private_tier
from tierckpt.noderam import REPLICA_SUFFIX, NodeRamBackend, clean_dead_runs, default_namespace

ROOT = Path(__file__).resolve().parents[1]


def _run_and_kill(code: str) -> None:
    """Run ``code`` in a fresh interpreter that SIGKILLs itself at the end (a crashed worker)."""
    body = textwrap.dedent(code) + "\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


def test_defaults_are_node_ram_ones(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    assert default_namespace() == "job_42"  # torchrun's run id, made a safe folder name
    spec = NodeRamTier(path=shm)
    assert spec.root == str(shm / "job_42") and spec.keep_last == 2 and spec.codec == "raw"
    assert 0 < spec.max_bytes <= shutil.disk_usage(shm).total
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default: no run id
    assert default_namespace() == "default"
    with pytest.raises(ValueError, match="namespace"):
        NodeRamTier(path=shm, namespace="../x")
    with pytest.raises(ValueError, match="max_bytes"):
        NodeRamTier(path=shm, max_bytes=0)
    b = NodeRamTier(path=shm, namespace="r").make_backend()
    assert b.is_durable and b.is_node_local and not b.is_remote


def test_killed_process_restarts_from_node_ram_reading_nothing_from_disk(
    shm: Path, tmp_path: Path
) -> None:
    _run_and_kill(
        f"""
        from dist_workers import rank_state
        from tierckpt import Checkpointer, LocalTier, NodeRamTier
        ck = Checkpointer([NodeRamTier(path={str(shm)!r}, namespace="run"),
                           LocalTier({str(tmp_path / "disk")!r})], chunk_bytes=64 << 10)
        for step in (1, 2, 3):
            ck.save(rank_state(0, step), step).wait(timeout=60)
        """
    )
    tiers = [NodeRamTier(path=shm, namespace="run"), LocalTier(tmp_path / "disk")]
    with Checkpointer(tiers) as ck:
        steps = ck.tier_steps()
        assert steps["local"] == [1, 2, 3]
        # keep_last=2; killed right after step 3's commit was reported, the process may not
        # have run the retention pass that trails it: step 1 then goes at the next save
        assert steps["noderam"] in ([2, 3], [1, 2, 3]), steps
        counter = peer_workers.ReadCounter(ck)
        got = ck.load()
        assert same(got, rank_state(0, 3)) == []
        assert counter.calls["local"] == 0 and counter.bytes["noderam"] > 0
        # the dead writer's lease is taken over at once (same host, its process is gone)
        ck.save(rank_state(0, 4), 4).wait(timeout=60)
        assert ck.tier_steps()["noderam"] == [3, 4]


def test_budget_fails_the_node_ram_copy_not_the_save(shm: Path, tmp_path: Path) -> None:
    state = {"w": torch.randn(64 << 10)}  # 256 KiB
    tiers = [
        NodeRamTier(path=shm, namespace="small", max_bytes=400 << 10),
        LocalTier(tmp_path / "disk"),
    ]
    with Checkpointer(tiers, chunk_bytes=64 << 10) as ck:
        ck.save(state, 1).wait(timeout=60)
        h = ck.save(state, 2)  # step 1 (256 KiB) + step 2 do not fit in 400 KiB
        with pytest.raises(Exception) as info:
            h.wait(timeout=60)
        err = str(info.value)
        assert "node RAM budget exceeded" in err and "max_bytes=409600" in err
        assert ck.tier_steps() == {"noderam": [1], "local": [1, 2]}
        assert h.done("local")
    usage = NodeRamBackend(shm / "small", max_bytes=1).usage()
    assert usage <= 400 << 10  # nothing half-written is left over budget
    with pytest.raises(BackendError) as e:
        NodeRamBackend(shm / "small", max_bytes=1).check_budget(1, "x")
    assert e.value.errno == errno.ENOSPC


def test_node_ram_is_private_to_its_node(shm: Path) -> None:
    with Checkpointer([NodeRamTier(path=shm, namespace="p")]) as ck:
        assert is_private_tier(ck._tiers[0])


def _dead_run(shm: Path, ns: str) -> None:
    """A run whose only process saved and was killed: its lease names a dead process."""
    _run_and_kill(
        f"""
        import torch
        from tierckpt import Checkpointer, NodeRamTier
        ck = Checkpointer([NodeRamTier(path={str(shm)!r}, namespace={ns!r})])
        ck.save({{"w": torch.ones(1000)}}, 1).wait(timeout=60)
        """
    )
    (shm / f"{ns}{REPLICA_SUFFIX}" / "rank-000001").mkdir(parents=True)
    assert (shm / ns / "leases" / "rank-000000.json").exists()


def test_dead_runs_are_removed_on_start_and_live_ones_never(shm: Path) -> None:
    _dead_run(shm, "dead")
    _dead_run(shm, "mine")
    live = Checkpointer([NodeRamTier(path=shm, namespace="live", stale_after_s=None)])
    live.save({"w": torch.ones(10)}, 1).wait(timeout=60)  # holds its lease: alive
    # a dead run stays while it may still be restarted (changed less than stale_after_s ago)
    NodeRamTier(path=shm, namespace="new", stale_after_s=3600).make_backend()
    assert (shm / "dead").is_dir()
    # older than the grace: the dead run goes, with its replicas; the live one and the run
    # being opened stay, even though "mine" is dead too
    NodeRamTier(path=shm, namespace="mine", stale_after_s=0).make_backend()
    assert not (shm / "dead").exists() and not (shm / f"dead{REPLICA_SUFFIX}").exists()
    assert (shm / "mine" / "manifests").is_dir() and (shm / "live" / "manifests").is_dir()
    assert [d.name for d in shm.iterdir() if d.name.startswith("li")] == ["live"]
    live.close()


def test_a_restarted_run_that_has_not_saved_yet_is_not_a_dead_run(shm: Path) -> None:
    """A restarted worker takes its writer lease at its first save. Until then (it has loaded
    and trains for as long as the save interval) another job opening the tier, or
    ``gc --dead-runs``, judged the run by its dead predecessor's lease and deleted the folder
    it had just restored from: its next crash found no checkpoint. A process that has the
    folder open now marks it live; once it is gone, the run is dead again."""
    _dead_run(shm, "restarted")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    code = textwrap.dedent(
        f"""
        import sys, time
        from tierckpt import Checkpointer, NodeRamTier
        ck = Checkpointer([NodeRamTier(path={str(shm)!r}, namespace="restarted")])
        assert ck.load()["w"].sum().item() == 1000
        print("LOADED", flush=True)
        time.sleep(120)  # training, no save yet
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "LOADED"
        NodeRamTier(path=shm, namespace="other", stale_after_s=0).make_backend().close()
        assert (shm / "restarted" / "manifests" / "step-000000000001.json").exists()
        dead = clean_dead_runs(shm, stale_after_s=0, dry_run=True)  # gc --dead-runs
        assert [d.namespace for d in dead] == ["other"], dead  # closed, never saved
    finally:
        child.kill()
        child.wait(timeout=30)
    gone = clean_dead_runs(shm, stale_after_s=0)
    assert sorted(d.namespace for d in gone) == ["other", "restarted"], gone
    assert not (shm / "restarted").exists()
    # a closed backend leaves no mark behind
    b = NodeRamTier(path=shm, namespace="closed", stale_after_s=None).make_backend()
    assert [f.name.startswith("open-") for f in (shm / "closed" / "leases").iterdir()] == [
        True,
        True,
    ]
    b.close()
    assert list((shm / "closed" / "leases").iterdir()) == []


def test_jobs_without_a_run_id_do_not_share_node_ram(
    shm: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without torchrun (no ``TORCHELASTIC_RUN_ID``) every ``NodeRamTier()`` used the namespace
    ``"default"``: a new job with other data and another folder loaded the last job's
    checkpoint from node RAM, silently. The namespace is now named by the run's other tiers,
    so the same job restarted finds its checkpoints and another job does not."""
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)

    def job(folder: str) -> Checkpointer:
        return Checkpointer([NodeRamTier(path=shm), LocalTier(tmp_path / folder)])

    with job("a") as ck:
        ck.save({"w": torch.full((100,), 1.0)}, 7).wait(timeout=60)
    with job("b") as ck:  # another job: its own node-RAM folder, nothing to load
        with pytest.raises(CheckpointNotFound):
            ck.load()
        ck.save({"w": torch.full((100,), 2.0)}, 3).wait(timeout=60)
    names = sorted(p.name for p in shm.iterdir())
    assert len(names) == 2 and all(n.startswith("default-") for n in names), names
    shutil.rmtree(tmp_path / "a")  # job a restarted on this node: node RAM has its step
    with job("a") as ck:
        got = ck.load()
        assert torch.equal(got["w"], torch.full((100,), 1.0))
    # alone, with nothing to name the run by: "default", and a warning that says so
    with caplog.at_level("WARNING", logger="tierckpt"), Checkpointer([NodeRamTier(path=shm)]) as ck:
        ck.save({"w": torch.ones(3)}, 1).wait(timeout=60)
    assert (shm / "default" / "manifests").is_dir()
    assert "Pass NodeRamTier(namespace=...)" in caplog.text
    # a namespace given, or torchrun's run id, is used as it is
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-9")
    assert NodeRamTier(path=shm).for_run([LocalTier(tmp_path / "a")]).namespace == "run-9"
    spec = NodeRamTier(path=shm, namespace="mine")
    assert spec.for_run([spec, LocalTier(tmp_path / "a")]) is spec


def test_gc_dead_runs_command(shm: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _dead_run(shm, "gone")
    with Checkpointer([NodeRamTier(path=shm, namespace="alive", stale_after_s=None)]) as ck:
        ck.save({"w": torch.ones(10)}, 1).wait(timeout=60)
        time.sleep(0.05)
        assert cli_main(["gc", str(shm), "--dead-runs", "--stale-after", "0", "--dry-run"]) == 0
        assert "would remove dead run 'gone'" in capsys.readouterr().out
        assert (shm / "gone").is_dir()
        assert cli_main(["gc", str(shm), "--dead-runs", "--stale-after", "0"]) == 0
        out = capsys.readouterr().out
        assert out.count("removed dead run") == 1 and "removed dead run 'gone'" in out
        assert not (shm / "gone").exists() and (shm / "alive" / "manifests").is_dir()
    assert clean_dead_runs(shm / "nothing-here") == []
    assert cli_main(["gc", str(shm)]) != 0  # neither --keep-last nor --dead-runs
    assert "needs --keep-last" in capsys.readouterr().err


@pytest.mark.distributed
def test_four_ranks_restart_from_node_ram_without_peers(shm: Path, tmp_path: Path) -> None:
    """NodeRamTier alone in a multi-rank job: it commits per node (through the store) and a
    restart of every rank after one was SIGKILLed reads each shard from its node's RAM."""
    kw = {"shm": str(shm), "disk": str(tmp_path), "s3": None, "peer": False}
    res = peer_workers.run("w_save", 4, victim=2, expect_killed=(2,), **kw)
    assert all(r["steps"]["noderam"] == [1, 2] for r in res if r is not None)
    res = peer_workers.run("w_load", 4, **kw)
    for r in res:
        assert r["step"] == 2 and r["diff"] == []
        assert r["calls"]["local"] == 0 and r["bytes"]["noderam"] > 0
    json.dumps(res)
