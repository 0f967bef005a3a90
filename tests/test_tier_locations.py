"""Two tiers of one job on the same folder or prefix are refused before anything is written.

Found by trying it: ``[LocalTier(d, name="a", codec="raw"), LocalTier(d, name="b",
codec="zstd")]`` committed step N on tier "a", then tier "b" wrote its shard file under the same
name, so every committed checkpoint failed its size check and ``load()`` raised
``CorruptCheckpoint``: nothing loadable was left. An "archive" tier (``keep_last=None,
every=2``) on the run's own folder had its steps deleted by the run tier's ``keep_last=2``. The
writer lease cannot see it: both tiers belong to one writer.

The same mistake across jobs, one after the other: a new run pointed at a finished run's folder
saves from step 0 on a new timeline (as a rollback does), and retention then removes the old
run's checkpoints. That cannot be refused (a rollback loaded some other way looks the same), so
rank 0 warns at that save, naming the newest checkpoint there and how to keep it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, GCSTier, LocalTier, MemoryTier, S3Tier
from tierckpt.policy import TierPolicy


def _state(step: int) -> dict[str, object]:
    return {"w": torch.arange(50_000, dtype=torch.float32) + step, "step": step}


def _refused(tiers: list[object]) -> str:
    with pytest.raises(ValueError, match="both write to") as info:
        Checkpointer(tiers)  # type: ignore[arg-type]
    return str(info.value)


def test_two_local_tiers_on_one_folder_are_refused_and_the_committed_run_is_untouched(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    with Checkpointer([LocalTier(run)]) as ck:
        ck.save(_state(7), 7).wait()
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    (tmp_path / "link").symlink_to(run)
    spellings = [f"{run}/", str(tmp_path / "x" / ".." / "run"), str(tmp_path / "link")]
    for other in spellings:
        message = _refused(
            [LocalTier(run, name="fast", codec="raw"), LocalTier(other, name="b", codec="zstd")]
        )
        assert "'fast' and 'b'" in message and os.path.realpath(run) in message
        assert "own folder or prefix" in message  # says what to do
    # nothing was written: no lease, no temporary file, the committed step loads bit-exact
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    with Checkpointer([LocalTier(run)]) as ck:
        assert torch.equal(ck.load()["w"], _state(7)["w"])


def test_an_archive_on_the_runs_own_prefix_is_refused_and_a_side_by_side_one_is_not() -> None:
    refused = [
        (S3Tier("s3://b/run"), S3Tier("s3://b/run/", name="archive", keep_last=None, every=100)),
        (S3Tier("s3://b/run"), S3Tier("s3://b", prefix="run", name="archive")),
        (
            S3Tier("s3://b/run", endpoint_url="http://127.0.0.1:9000/"),
            S3Tier("s3://b/run", name="archive", endpoint_url="HTTP://127.0.0.1:9000"),
        ),
        (GCSTier("gs://b/run"), GCSTier("gs://b//run/", name="archive")),
        (MemoryTier(), MemoryTier(name="other")),
    ]
    for tiers in refused:
        with pytest.raises(ValueError, match="both write to"):
            TierPolicy(list(tiers))
    # different places, or possibly different stores: accepted
    accepted = [
        (S3Tier("s3://b/run"), S3Tier("s3://b/run-archive", name="archive")),
        (S3Tier("s3://b/run"), S3Tier("s3://other/run", name="archive")),
        (
            S3Tier("s3://b/run", endpoint_url="http://127.0.0.1:9000"),
            S3Tier("s3://b/run", name="archive", endpoint_url="http://127.0.0.1:9001"),
        ),
        (S3Tier("s3://b/run"), S3Tier("s3://b/run", name="archive", profile="backup")),
        (S3Tier("s3://b/run"), GCSTier("gs://b/run", name="archive")),
        (MemoryTier(), MemoryTier(name="other", namespace="eval")),
    ]
    for tiers in accepted:
        assert len(TierPolicy(list(tiers))) == 2


def test_a_dcp_writer_refuses_them_too(tmp_path: Path) -> None:
    from tierckpt.dcp import TierWriter

    with pytest.raises(ValueError, match="'local' and 'copy' both write to"):
        TierWriter([LocalTier(tmp_path), LocalTier(tmp_path, name="copy")], step=1)
    assert list(tmp_path.iterdir()) == []


def test_a_new_run_saving_over_another_runs_newer_steps_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job pointed at another run's folder saves from step 0 on a new timeline (as a rollback
    does) and retention then removes the other run's checkpoints: rank 0 warns at that save,
    naming the newest checkpoint there and how to keep it. A run that loaded first (a rollback
    on purpose) or goes on after the newest step is not warned about."""
    run = tmp_path / "run"
    with Checkpointer([LocalTier(run, keep_last=2)]) as ck:
        for step in (1000, 2000, 3000):
            ck.save(_state(step), step).wait()

    def warnings_of(saves: list[int], load: int | None = None) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="tierckpt"), Checkpointer([LocalTier(run)]) as ck:
            if load is not None:
                ck.load(step=load)
            for step in saves:
                ck.save(_state(step), step).wait()
        return [r.getMessage() for r in caplog.records if "loaded none" in r.getMessage()]

    assert warnings_of([3001]) == []  # the run goes on
    assert warnings_of([2001], load=2000) == []  # went back on purpose, through load()
    # a new run in the old run's folder: warned once, at step 0 (the newest there is the
    # rollback's step 2001 on timeline 1)
    (message,) = warnings_of([0, 1])
    assert "step 0 is not after the newest checkpoint on these tiers (step 2001, timeline 1)" in (
        message
    )
    assert "ck.pin(2001, timeline=1)" in message and "own folder or prefix" in message
    # its own saves going back (a per-epoch batch index as the step): said as such
    caplog.clear()
    epochs = Checkpointer([LocalTier(tmp_path / "epochs")])
    with caplog.at_level("WARNING", logger="tierckpt"), epochs as ck:
        for step in (10, 20, 0):
            ck.save(_state(step), step).wait()
    (own,) = [r.getMessage() for r in caplog.records if "is not after" in r.getMessage()]
    assert "step 0 is not after step 20, which this Checkpointer saved itself" in own
    assert "not an epoch's batch index" in own


def test_a_folder_under_the_home_folder_is_not_a_folder_named_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``LocalTier("~/ckpt")`` wrote to ``./~/ckpt`` in the working directory: the checkpoints
    were not where the operator looked (a restore on the next node found none), and the
    ``rm -rf ~`` that cleans the stray folder up deletes the home folder."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    with Checkpointer([LocalTier("~/ckpt")]) as ck:
        ck.save(_state(3), 3).wait()
    assert list(work.iterdir()) == []  # no folder named "~" here
    with Checkpointer([LocalTier(home / "ckpt")]) as ck:
        assert ck.steps() == [3]
    assert LocalTier("./~/x").path == "./~/x"  # a folder really named so, written as such
    with pytest.raises(ValueError, match="absolute path"):
        LocalTier("~no-such-user-here/ckpt")


def test_node_ram_tiers_on_one_run_folder_are_refused(tmp_path: Path) -> None:
    """A node-RAM tier's run folder is ``path/namespace``: two such tiers on one run, or a local
    tier pointed at it, write the same files."""
    from tierckpt import NodeRamTier

    ram = NodeRamTier(path=tmp_path, namespace="run1")
    for other in (
        NodeRamTier(path=tmp_path, namespace="run1", name="copy"),
        LocalTier(tmp_path / "run1"),
    ):
        with pytest.raises(ValueError, match=f"'noderam' and '{other.name}' both write to"):
            TierPolicy([ram, other])
    assert len(TierPolicy([ram, NodeRamTier(path=tmp_path, namespace="run2", name="b")])) == 2


def test_the_two_paths_of_a_bind_mount_are_one_folder(tmp_path: Path) -> None:
    # a field test's LocalTier(a) beside LocalTier(b, name="archive") where b is a bind mount
    # of a: accepted (the paths differ), each step committed on one tier only, the run tier's
    # keep_last deleted the archive's steps, and the other tier's shard files replaced the
    # two left (neither loaded). The key is now the folder's device and inode
    import subprocess

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    got = subprocess.run(["mount", "--bind", str(a), str(b)], capture_output=True)
    if got.returncode != 0:
        pytest.skip(f"no bind mount here: {got.stderr.decode(errors='replace').strip()}")
    try:
        _refused([LocalTier(a), LocalTier(b, name="archive")])
        _refused([LocalTier(a / "run"), LocalTier(b / "run", name="archive")])  # not made yet
    finally:
        subprocess.run(["umount", str(b)], check=True)
    TierPolicy([LocalTier(a), LocalTier(b, name="archive")])  # two folders again


def test_two_names_of_one_store_are_refused_at_the_first_save(
    moto_server, s3_bucket, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # localhost and 127.0.0.1: the policy sees two stores (it compares what it is given); the
    # second tier's lease take finds the first tier's (the same writer, another tier). Before,
    # a field test lost every checkpoint this way: half the saves failed on each tier, the run
    # tier's keep_last deleted the archive's steps, and shard files replaced each other's
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    other = moto_server.endpoint_url.replace("127.0.0.1", "localhost")
    assert other != moto_server.endpoint_url
    tiers = [
        S3Tier(url, endpoint_url=moto_server.endpoint_url, keep_last=2, codec="raw"),
        S3Tier(url, endpoint_url=other, name="archive", keep_last=None, codec="zstd"),
    ]
    ck = Checkpointer(tiers)
    try:
        with pytest.raises(Exception, match="another tier of this same job") as info:
            ck.save(_state(1), 1).wait()
        assert "Give each tier its own folder or prefix" in str(info.value)
    finally:
        ck.close()
    names = [o["Key"] for o in moto_server.admin.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert not [n for n in names if "/manifests/" in n], names  # nothing committed


def test_a_lease_lost_to_this_jobs_other_tier_says_so(tmp_path: Path) -> None:
    # on a store without conditional PUT two aliased tiers can both take the lease; the one
    # that reads back the other's is told of the aliasing, not of "two jobs"
    import dataclasses

    from tierckpt.backends.local import LocalBackend
    from tierckpt.lease import WriterLease
    from tierckpt.lease_refusal import lost_lease, tier_owner
    from tierckpt.liveness import LeaseRecord

    writer = "a" * 32
    lease = WriterLease(LocalBackend(tmp_path), "run", 0, tier_owner(writer, "run"), 60.0)
    other = dataclasses.replace(LeaseRecord.mine(writer, 60.0), owner=tier_owner(writer, "archive"))
    text = str(lost_lease(lease, "another writer took it over", False, other))
    assert "Another tier of this same job took it" in text and "Two jobs" not in text, text
    stranger = dataclasses.replace(other, owner=tier_owner("b" * 32, "run"))
    assert "Two jobs" in str(lost_lease(lease, "another writer took it over", False, stranger))
