"""A checkpoint written by a newer tierckpt is never deleted or replaced by this one.

The field case: a run upgrades the library, saves, then rolls the library back after a bad
deploy. The older release cannot read the newer manifests; it must leave them alone. Before:
the training job's retention deleted a newer-format checkpoint once keep_last newer steps
were committed beside it; ``tierckpt pull`` called the destination's newer copy "damaged" and
replaced it; ``gc`` and ``ls`` reported it as damage. A newer release is simulated by raising
a manifest's ``version`` (its checksum recomputed, as the writer would).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.cli import main
from tierckpt.errors import FormatError, NewerFormat
from tierckpt.format import MANIFEST_VERSIONS, checksum, manifest_name
from tierckpt.testing.s3servers import S3Server


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((64,), float(step))}


def _make_newer(root: Path, step: int) -> bytes:
    """Rewrite ``step``'s manifest as a newer release would: a higher version and a field
    this release does not know, its checksum recomputed. Returns the new bytes."""
    path = root / manifest_name(step)
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    body["version"] = max(MANIFEST_VERSIONS) + 1
    body["added_later"] = {"x": 1}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    body["checksum"] = checksum(canon.encode("utf-8"))
    data = json.dumps(body, sort_keys=True).encode()
    path.write_bytes(data)
    return data


def _save(root: Path, steps: range, keep_last: int = 2) -> None:
    with Checkpointer([LocalTier(root, keep_last=keep_last)]) as ck:
        for s in steps:
            ck.save(_state(s), s).wait()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_retention_keeps_a_newer_release_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _save(root, range(1, 4))
    newer = _make_newer(root, 3)
    with pytest.raises(NewerFormat, match="newer tierckpt"):
        Checkpointer([LocalTier(root)]).load(step=3)
    _save(root, range(4, 8))  # keep_last=2: steps 1..5 go, 3 stays
    with Checkpointer([LocalTier(root)]) as ck:
        assert [c.step for c in ck.checkpoints()] == [3, 6, 7]
        assert torch.equal(ck.load()["w"], _state(7)["w"])
    assert (root / manifest_name(3)).read_bytes() == newer
    assert issubclass(NewerFormat, FormatError)  # except FormatError still catches it


def test_gc_and_ls_say_newer_release_not_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    _save(root, range(1, 6), keep_last=5)
    _make_newer(root, 2)
    _make_newer(root, 5)
    rc, out, err = _run(["ls", str(root)], capsys)
    assert rc == 1  # a manifest it cannot read: said, as before
    assert "newer release" in out and "DAMAGED" not in out + err
    assert "step 5 is written by a newer tierckpt" in err
    rc, out, err = _run(["gc", str(root), "--keep-last", "1"], capsys)
    assert rc == 0, (out, err)
    assert "DAMAGED" not in out + err
    assert "kept 2, 5: written by a newer tierckpt" in out, out
    assert "deleted 2 expired checkpoint(s): 1, 3" in out, out
    assert (root / manifest_name(2)).exists() and (root / manifest_name(5)).exists()
    assert (root / manifest_name(4)).exists()  # the newest intact one, keep_last=1


def test_pull_does_not_replace_a_newer_release_copy(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    moto_server: S3Server,
    s3_bucket: Callable[[S3Server], str],
) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    url = f"s3://{s3_bucket(moto_server)}/run"
    ep = ["--endpoint-url", moto_server.endpoint_url]
    _save(src, range(1, 3))
    assert _run(["push", str(src), url, *ep, "--all", "--codec", "keep"], capsys)[0] == 0
    assert _run(["pull", url, str(dst), *ep, "--codec", "keep"], capsys)[0] == 0
    newer = _make_newer(dst, 2)
    rc, out, err = _run(["pull", url, str(dst), *ep, "--codec", "keep"], capsys)
    assert rc == 1, (out, err)
    assert "not copied" in err and "newer tierckpt" in err, err
    assert (dst / manifest_name(2)).read_bytes() == newer
