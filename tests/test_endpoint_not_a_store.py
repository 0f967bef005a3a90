"""An endpoint that answers as no object store does must not read as "nothing saved".

Found by a field test: a web server, captive portal or proxy answering a listing with an HTML
page and status 200 was read as a listing of no objects, by both S3 drivers. On a new node,
``if ck.steps(): ck.load()`` then trained from step 0 beside the run's checkpoints (and its
saves, older than the run's newest, were deleted by retention as they committed). Now the
boto3 driver refuses a listing without the fields every store's has, and the obstore driver
checks its first empty listing with a HEAD of a key that cannot exist, which a store answers
"not found": either way the tier is unreadable (``TiersUnreadable``), never empty.
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tierckpt import Checkpointer, LocalTier, S3Tier, TiersUnreadable

pytestmark = pytest.mark.s3

_PAGE = b"<html><body><h1>Welcome</h1><p>Log in to use this network.</p></body></html>"


class _Portal(http.server.BaseHTTPRequestHandler):
    """Status 200 and an HTML page for every request, as a captive portal answers."""

    def _page(self, body: bool = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(_PAGE)))
        self.end_headers()
        if body:
            self.wfile.write(_PAGE)

    def do_GET(self) -> None:
        self._page()

    def do_HEAD(self) -> None:
        self._page(body=False)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def portal() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Portal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(params=["obstore", "boto3"])
def driver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", request.param)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return str(request.param)


def test_a_portal_at_the_endpoint_is_unreadable_not_empty(
    tmp_path: Path, portal: str, driver: str
) -> None:
    s3 = S3Tier("s3://bucket/run", endpoint_url=portal, max_attempts=1)
    with Checkpointer([LocalTier(tmp_path / "new-node"), s3]) as ck:
        with pytest.raises(TiersUnreadable, match="web server, captive portal or proxy"):
            ck.steps()  # before: [] (a restart pattern trained from step 0)
        with pytest.raises(TiersUnreadable):
            ck.load()  # before: CheckpointNotFound ("nothing saved")


def test_an_empty_prefix_of_a_store_is_empty(moto_server: Any, s3_bucket: Any, driver: str) -> None:
    bucket = s3_bucket(moto_server)
    s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    with Checkpointer([s3]) as ck:
        assert ck.steps() == []
        ck.save({"w": _w()}, step=1).wait()
        assert ck.steps() == [1]
    with Checkpointer(
        [S3Tier(f"s3://{bucket}/other", endpoint_url=moto_server.endpoint_url)]
    ) as ck:
        assert ck.steps() == []


def _w() -> Any:
    import torch

    return torch.arange(16.0)
