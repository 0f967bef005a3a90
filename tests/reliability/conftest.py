"""Fixtures of the reliability suite (the root conftest's S3 fixtures are used as they are)."""

from __future__ import annotations

from typing import Any

import pytest
from rel_util import WAIT_S, Recorder


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Recorder:
    """``record(category, case, outcome, ok)``: one line of docs/reliability.md's evidence."""
    return Recorder(request.node.nodeid)


@pytest.fixture
def waited_bucket(moto_server: Any, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on moto, with the listing and lease waits at ``WAIT_S``."""
    monkeypatch.setenv("TIERCKPT_LEASE_WAIT_S", str(WAIT_S))
    return str(s3_bucket(moto_server))
