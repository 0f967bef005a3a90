"""The CLI's wait line (issue 17: "a progress line on any wait over 2 s") says when a request
is being retried and which attempt runs, so seconds of botocore retries against an endpoint
nobody answers at do not look like a hang."""

from __future__ import annotations

import io
import re
import socket

import pytest

from tierckpt.cli import _hints, main


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_wait_line_shows_the_attempt_while_boto3_retries(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], boto3_driver: None
) -> None:
    """A real boto3 client against a refused port (4 attempts by default): the line printed
    while botocore backs off between attempts names the attempt. The notice's 2 s and 5 s are
    shortened and botocore's random backoff (a few ms after a refused connection) is fixed at
    0.3 s, so that lines fall inside every wait between attempts. (obstore's: in
    tests/test_obstore_default.py.)"""
    from botocore.retries.standard import ExponentialBackoff

    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.3)
    monkeypatch.setattr(_hints, "WAIT_NOTICE_S", 0.0)
    monkeypatch.setattr(_hints, "WAIT_REPEAT_S", 0.02)
    for k, v in (("AWS_ACCESS_KEY_ID", "t"), ("AWS_SECRET_ACCESS_KEY", "t")):
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    port = _closed_port()
    rc = main(["ls", "s3://bucket/run", "--endpoint-url", f"http://127.0.0.1:{port}"])
    _out, err = capsys.readouterr()
    assert rc == 1
    waits = [ln for ln in err.splitlines() if ln.startswith("tierckpt: waiting for s3://bucket")]
    assert waits, err
    tries = [int(m.group(1)) for ln in waits if (m := re.search(r"attempt (\d) of 4\)", ln))]
    assert set(tries) == {2, 3, 4}, err  # each retry shown, none past the 4th
    assert tries == sorted(tries)  # counts up


def test_the_line_drops_the_attempt_once_a_request_is_answered() -> None:
    out = io.StringIO()
    notice = _hints.WaitNotice("s3://b/run", out)
    assert notice.line().endswith("s)\n") and "attempt" not in notice.line()
    notice.attempt_failed(1, 4)
    assert "(0 s, retrying: attempt 2 of 4)" in notice.line()
    notice.attempt_failed(3, 4)
    assert "attempt 4 of 4" in notice.line()
    notice.retrying = None
    assert "attempt" not in notice.line()
