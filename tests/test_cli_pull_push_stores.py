"""``tierckpt pull`` / ``push`` with every object store the tiers write to: a replacement node
pre-pulls a run from GCS or Azure as from S3. Before, both commands took ``s3://`` only and
refused ``gs://`` / ``az://`` with a message that read as if the arguments were swapped."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import torch

from tierckpt import AzureTier, Checkpointer, GCSTier, LocalTier, TierSpec
from tierckpt.cli import main
from tierckpt.testing.emulators import Emulator
from tierckpt.testing.gcsxml import GcsXmlFront

pytestmark = pytest.mark.s3


def _round_trip(
    url: str, endpoint: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 4}
    with Checkpointer([LocalTier(tmp_path / "run", keep_last=None)]) as ck:
        ck.save(state, 4).wait()
    assert main(["push", str(tmp_path / "run"), url, "--all", "--endpoint-url", endpoint]) == 0
    assert main(["pull", url, str(tmp_path / "node"), "--all", "--endpoint-url", endpoint]) == 0
    capsys.readouterr()
    with Checkpointer([LocalTier(tmp_path / "node")]) as ck:
        got = ck.load()
    assert torch.equal(got["w"], state["w"]) and got["step"] == 4
    # the wrong order is still refused, saying what each command copies
    assert main(["pull", str(tmp_path / "run"), url]) == 2
    assert "into a local folder" in capsys.readouterr().err


def test_pull_and_push_with_gcs(
    fake_gcs: Emulator, gcs_xml: GcsXmlFront, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = f"tierckpt-{secrets.token_hex(6)}"
    fake_gcs.create_bucket(bucket)
    url = f"gs://{bucket}/run"
    _round_trip(url, gcs_xml.endpoint_url, tmp_path, capsys)
    _pushed_there(GCSTier(url, endpoint_url=gcs_xml.endpoint_url))


def test_pull_and_push_with_azure(
    azurite: Emulator, azure_env: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    container = f"tierckpt-{secrets.token_hex(6)}"
    azurite.create_bucket(container)
    url = f"az://{container}/run"
    _round_trip(url, azurite.endpoint_url, tmp_path, capsys)
    _pushed_there(AzureTier(url, endpoint_url=azurite.endpoint_url))


def _pushed_there(tier: TierSpec) -> None:
    """The store's own tier sees what push wrote (committed, under the store's tier name)."""
    with Checkpointer([tier]) as ck:
        assert ck.steps() == [4]
