"""``tierckpt gc`` checks what it keeps before deleting: a damaged newest checkpoint does not
count toward ``--keep-last`` (the newest N *intact* ones stay, the damaged one too, exit 1);
it says what it removed, not what it planned; a presumed-live lease's refusal names
``tierckpt unlock``. Also the CLI's messages: another tool's checkpoint folder, a file given as
a tier URL, a mistyped option under a command, a quantized tensor's name in ``inspect``, and
export's advice on names that collide."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main
from tierckpt.format import CheckpointId, manifest_name
from tierckpt.lease import lease_name
from tierckpt.liveness import LeaseRecord
from tierckpt.offline import gc
from tierckpt.restore import read_manifest


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _tier(root: Path, steps: tuple[int, ...] = (10, 20, 30)) -> Path:
    with Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=16 << 10) as ck:
        for s in steps:
            g = torch.Generator().manual_seed(s)
            ck.save({"w": torch.randn(20_000, generator=g), "step": s}, s).wait(timeout=60)
    return root


def _shard(root: Path, step: int) -> Path:
    m = read_manifest(LocalBackend(root), step, "t")
    return root / m.shards[0].file


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _empty_manifest(root: Path) -> None:
    (root / manifest_name(30)).write_bytes(b"")


def _not_json(root: Path) -> None:
    _flip(root / manifest_name(30), 0)


def _bad_manifest_checksum(root: Path) -> None:
    p = root / manifest_name(30)
    p.write_text(p.read_text().replace('"step": 30', '"step": 31', 1))


def _truncated(root: Path) -> None:
    p = _shard(root, 30)
    os.truncate(p, p.stat().st_size // 2)


def _zero_length(root: Path) -> None:
    _shard(root, 30).write_bytes(b"")


def _a_directory(root: Path) -> None:
    p = _shard(root, 30)
    p.unlink()
    p.mkdir()


def _index_byte(root: Path) -> None:
    p = _shard(root, 30)
    _flip(p, p.stat().st_size - 200)  # in the index, before the footer


DAMAGE: dict[str, Callable[[Path], None]] = {
    "empty manifest": _empty_manifest,
    "manifest not JSON": _not_json,
    "manifest checksum": _bad_manifest_checksum,
    "truncated shard": _truncated,
    "zero-length shard": _zero_length,
    "shard is a directory": _a_directory,
    "index byte": _index_byte,
}


def _committed(root: Path) -> list[str]:
    return sorted(os.listdir(root / "manifests"))


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_gc_keeps_the_newest_intact_checkpoint_past_a_damaged_newest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, dry_run: bool
) -> None:
    root = _tier(tmp_path / "t")
    DAMAGE[damage](root)
    argv = ["gc", str(root), "--keep-last", "1", *(["--dry-run"] if dry_run else [])]
    rc, out, err = _run(argv, capsys)
    assert rc == 1, (out, err)
    assert "keeping step(s) 20, 30 (DAMAGED)" in out, out
    assert "DAMAGED 30:" in out, out
    assert "expired checkpoint(s): 10" in out, out
    assert "damaged checkpoint(s) found" in err and "kept because of them: 20" in err, err
    if dry_run:
        assert len(_committed(root)) == 3
    else:  # step 20 (the newest intact one) and the damaged 30 stay; 10 goes
        assert _committed(root) == [manifest_name(20)[10:], manifest_name(30)[10:]]
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:  # still loadable
        assert ck.load(20)["step"] == 20


def test_gc_counts_intact_checkpoints_and_keeps_every_damaged_one(tmp_path: Path) -> None:
    root = _tier(tmp_path / "t", (10, 20, 30, 40, 50))
    (root / manifest_name(50)).write_bytes(b"")
    _truncated(root)  # step 30
    plan = gc(LocalBackend(root), 2)
    ids = {c.step for c in plan.retained}
    assert ids == {20, 30, 40, 50}, plan
    assert [c.step for c, _ in plan.damaged] == [50, 30], plan
    assert [c.step for c in plan.kept_for_damage] == [20], plan
    assert [c.step for c in plan.expired] == [10], plan
    assert len(_committed(root)) == 4


def test_gc_without_damage_exits_0_and_deletes_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tier(tmp_path / "t")
    rc, out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 0, (out, err)
    assert "deleted 2 expired checkpoint(s): 10, 20" in out, out
    assert "DAMAGED" not in out and not err.strip(), err
    assert _committed(root) == [manifest_name(30)[10:]]


def test_gc_verify_reads_kept_checkpoints_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A flipped byte in a chunk's data passes the quick check (sizes, indexes): --verify
    reads every chunk of what gc keeps."""
    root = _tier(tmp_path / "t")
    _flip(_shard(root, 30), 100)
    rc, out, err = _run(["gc", str(root), "--keep-last", "1", "--dry-run"], capsys)
    assert rc == 0 and "keeping step(s) 30" in out, (out, err)
    rc, out, err = _run(["gc", str(root), "--keep-last", "1", "--verify"], capsys)
    assert rc == 1, (out, err)
    assert "DAMAGED 30:" in out and "checksum" in out, out
    assert "deleted 1 expired checkpoint(s): 10" in out, out
    assert len(_committed(root)) == 2


def test_gc_prints_what_it_removed_not_what_it_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gc removed step 10 between this one's plan and its deletes: this one says it
    deleted 20 only."""
    import tierckpt.offline._gc as gc_mod

    root = _tier(tmp_path / "t")
    real = gc_mod.gc_tier
    folder = _shard(root, 10).parent

    def racing(backend: LocalBackend, keep_last: int, **kw: object) -> list[CheckpointId]:
        # the other gc removed step 10 (manifest, then data) before this one listed
        (root / manifest_name(10)).unlink()
        shutil.rmtree(folder)
        return real(backend, keep_last, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(gc_mod, "gc_tier", racing)
    rc, out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 0, (out, err)
    assert "deleted 1 expired checkpoint(s): 20" in out, out
    assert "10" not in out.split("deleted 1 expired checkpoint(s)")[1].splitlines()[0], out


def test_gc_refusing_a_presumed_live_lease_names_unlock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tier(tmp_path / "t")
    backend = LocalBackend(root)
    now = time.time()
    rec = dataclasses.replace(
        LeaseRecord.mine("b" * 32, 60.0),
        host="node-b",
        boot_id="00000000-0000-0000-0000-000000000000",
        pid=4242,
        renewed=now,
        started=now - 3600,
    )
    backend.put_atomic(lease_name(0), rec.encode())
    rc, out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 1, (out, err)
    assert f"tierckpt unlock {backend.url}" in err, err
    assert len(_committed(root)) == 3


def test_gc_refusing_a_writer_running_here_says_stop_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "t"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for s in (1, 2):
            ck.save({"w": torch.ones(10)}, s).wait(timeout=60)
        capsys.readouterr()
        rc, out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
        assert rc == 1, (out, err)
        assert "Stop that job first" in err and "unlock" not in err, err


# -- messages ----------------------------------------------------------------------------------
def test_another_tools_checkpoint_folder_is_named_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pt = tmp_path / "pt"
    pt.mkdir()
    torch.save({"w": torch.ones(2)}, pt / "ckpt-10.pt")
    dcp = tmp_path / "dcp" / "step_10"
    dcp.mkdir(parents=True)
    (dcp / ".metadata").write_bytes(b"x")
    (dcp / "__0_0.distcp").write_bytes(b"x")
    for argv in (["inspect", str(pt)], ["export", str(pt), str(tmp_path / "out")]):
        rc, out, err = _run(argv, capsys)
        assert rc == 1, err
        assert err.count("committed") == 1, err  # said once
        assert "ckpt-10.pt" in err and "torch.save" in err and "torch.load" in err, err
    rc, out, err = _run(["inspect", str(tmp_path / "dcp")], capsys)
    assert rc == 1 and err.count("committed") == 1, err
    assert "step_10/.metadata" in err and "DCP" in err and "dcp.load" in err, err
    rc, out, err = _run(["ls", str(pt)], capsys)
    assert rc == 0 and "torch.save" in out, out
    rc, out, err = _run(["inspect", str(tmp_path / "empty-does-not-exist")], capsys)
    assert rc == 1 and "no such folder" in err, err


def test_a_file_given_as_a_tier_url_is_called_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tier(tmp_path / "t", (10,))
    rc, _out, err = _run(["ls", str(root / manifest_name(10))], capsys)
    assert rc == 1, err
    assert "is a file, not a folder" in err and "no such folder" not in err, err


def test_a_mistyped_option_shows_the_commands_usage_and_the_option_meant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _tier(tmp_path / "t", (10,))
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(root), "--stpe", "10"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tierckpt verify" in err, err
    assert "did you mean --step?" in err, err
    with pytest.raises(SystemExit):
        main(["gc", str(root), "--keep-lst", "1"])
    err = capsys.readouterr().err
    assert "usage: tierckpt gc" in err and "did you mean --keep-last?" in err, err


def test_inspect_names_a_quantized_tensor_by_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "q"
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 2, torch.qint8)
    qc = torch.quantize_per_channel(
        torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
    )
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save({"model": {"w": torch.ones(3), "q": q, "qc": qc}}, 1).wait(timeout=60)
    rc, out, err = _run(["inspect", str(root), "--limit", "0"], capsys)
    assert rc == 0, err
    assert "<tensor" not in out, out
    assert "model.q " in out and "model.qc " in out, out
    assert "model.qc.<scales>" in out and "model.qc.<zero_points>" in out, out


@pytest.mark.parametrize("single_file", [False, True])
def test_export_name_collision_advises_renaming_not_single_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], single_file: bool
) -> None:
    root = tmp_path / "c"
    state = {"g": {1: torch.ones(2), "1": torch.zeros(2)}}
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save(state, 1).wait(timeout=60)
    argv = ["export", str(root), str(tmp_path / "out"), *(["--single-file"] * single_file)]
    rc, out, err = _run(argv, capsys)
    assert rc == 1, (out, err)
    assert "same name" in err and "rename" in err, err
    assert "export with --single-file" not in err, err


def test_ls_check_marks_a_damaged_newest_checkpoint_and_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plain ``ls`` reads manifests only (a missing shard file goes unseen, exit 0); with
    ``--check`` the step is marked DAMAGED in the table and the JSON, the reason and what to
    do go to stderr, and the exit status is 1. A truncated file is found too."""
    root = _tier(tmp_path / "t")
    _shard(root, 30).unlink()
    with open(_shard(root, 10), "r+b") as f:
        f.truncate(1000)
    rc, out, _ = _run(["ls", str(root)], capsys)
    assert rc == 0 and "DAMAGED" not in out
    rc, out, err = _run(["ls", str(root), "--check"], capsys)
    assert rc == 1
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()[:2].isdigit()}
    assert "DAMAGED, newest" in rows["30"] and "DAMAGED" in rows["10"], out
    assert "DAMAGED" not in rows["20"], out
    assert "step 30 is DAMAGED" in err and "does not exist" in err, err
    assert "step 10 is DAMAGED" in err and 'fallback="previous"' in err, err
    rc, out, _ = _run(["ls", str(root), "--check", "--json"], capsys)

    doc = {c["step"]: c for c in json.loads(out)["checkpoints"]}
    assert rc == 1 and doc[20]["damaged"] is None
    assert "does not exist" in doc[30]["damaged"] and doc[10]["damaged"], doc
