"""Fixtures of the reliability suite (the root conftest's S3 fixtures are used as they are)."""

from __future__ import annotations

import pytest
from rel_util import Recorder


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Recorder:
    """``record(category, case, outcome, ok)``: one line of docs/reliability.md's evidence."""
    return Recorder(request.node.nodeid)
