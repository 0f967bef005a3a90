"""Secrets stay out of errors, logs, tracebacks and the command line's output.

An endpoint URL with credentials in it (``http://KEY:SECRET@host``, given to ``S3Tier`` or
through ``AWS_ENDPOINT_URL``) used to come back verbatim in botocore's connection errors, and
from there in the save handle's error, the log and ``tierckpt ls``'s stderr. An
``s3://KEY:SECRET@bucket`` URL was taken as a bucket name and echoed. ``tierckpt --debug``
turned botocore's DEBUG log on, which prints request headers (``x-amz-security-token``).

Each case runs in a real process against a real endpoint (a closed port on 127.0.0.1, so the
connection error that carries the URL is real; moto for the debug log) and searches the
process's whole output, tracebacks included, for the secret.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rel_util import Recorder

from tierckpt import S3Tier
from tierckpt.backends.s3 import S3Backend
from tierckpt.config import s3_driver
from tierckpt.errors import FormatError
from tierckpt.testing.s3servers import S3Server

pytestmark = pytest.mark.s3

REPO = Path(__file__).resolve().parents[2]
KEY = "AKIAOPSKEYEXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYzEXAMPLEKEY"  # with "/" and "+", as AWS keys have
#: without "/", the URL is valid and botocore's error is the connection error that names it
PLAIN_SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"
TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENxyz"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()  # nothing listens there: connecting fails at once, with the URL in the error
    return port


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


SAVER = """
import logging, sys, traceback, torch
from tierckpt import Checkpointer, S3Tier
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger("tierckpt").setLevel(logging.DEBUG)  # tierckpt's whole log, not botocore's
endpoint = sys.argv[1] or None
options = dict(max_attempts=1, connect_timeout=2, read_timeout=2)
if endpoint:
    options["endpoint_url"] = endpoint
tier = S3Tier("s3://bucket/run", **options)
print("tier:", repr(tier))
ck = Checkpointer([tier])
h = ck.save({"w": torch.ones(1000)}, 1)
try:
    h.wait(timeout=120)
    print("SAVED?!")
except Exception as exc:
    print("save error:", exc)
    print("errors:", exc.errors)
    traceback.print_exc()  # the whole chain, botocore's exception included
print("steps:", ck.steps())  # logs that the tier cannot be listed
try:
    ck.load()
except Exception as exc:
    print("load error:", exc)
    traceback.print_exc()
ck.close()
"""


@pytest.mark.parametrize(
    ("via", "secret"),
    [("endpoint_url", PLAIN_SECRET), ("AWS_ENDPOINT_URL", SECRET)],
    ids=["endpoint_url-plain", "AWS_ENDPOINT_URL-slash"],
)
def test_endpoint_credentials_never_in_errors_logs_or_tracebacks(
    via: str, secret: str, record: Recorder
) -> None:
    port = _closed_port()
    endpoint = f"http://{KEY}:{secret}@127.0.0.1:{port}"
    if via == "endpoint_url":
        argv, env = [endpoint], _env()
    else:
        argv, env = [""], _env(AWS_ENDPOINT_URL=endpoint)
    p = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SAVER), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=REPO,
    )
    out = p.stdout + p.stderr
    if s3_driver() == "obstore":
        # obstore's driver refuses such an endpoint when the tier opens (a clear FormatError)
        assert p.returncode == 1 and "credentials do not belong" in out, out[-3000:]
    else:
        assert p.returncode == 0, out[-3000:]
        assert "save error:" in out
        if secret == PLAIN_SECRET:
            assert "Could not connect to the endpoint URL" in out  # botocore's own words
    assert "SAVED?!" not in out
    assert f"127.0.0.1:{port}" in out  # the error still says where
    leaked = secret in out or KEY in out
    record(
        "secrets",
        f"endpoint URL with credentials via {via} ({'with' if '/' in secret else 'no'} '/'): "
        "save error, log, traceback, load error",
        "credentials shown" if leaked else "redacted to http://***@127.0.0.1:PORT",
        not leaked,
    )
    assert secret not in out, out[-3000:]
    assert KEY not in out, out[-3000:]
    assert "***@127.0.0.1" in out


@pytest.mark.parametrize("url", [f"s3://{KEY}:{SECRET}@bucket/run", f"s3://{KEY}@bucket"])
def test_s3_url_with_credentials_is_refused(url: str, record: Recorder) -> None:
    for make in (lambda: S3Tier(url), lambda: S3Backend(url)):
        with pytest.raises(FormatError) as info:
            make()
        msg = str(info.value)
        assert SECRET not in msg and KEY not in msg
        assert "environment" in msg and "profile" in msg
    # a bare bucket name with credentials in it, too
    with pytest.raises(FormatError, match="environment"):
        S3Backend(url.removeprefix("s3://").removesuffix("/run"))
    if "/run" not in url:
        return  # the command line once is enough
    p = subprocess.run(
        [sys.executable, "-m", "tierckpt.cli", "ls", url],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
        cwd=REPO,
    )
    out = p.stdout + p.stderr
    ok = p.returncode == 2 and SECRET not in out and KEY not in out
    record("secrets", "s3://KEY:SECRET@bucket URL", f"exit {p.returncode}, refused", ok)
    assert p.returncode == 2, out
    assert "credentials do not belong" in p.stderr
    assert SECRET not in out and KEY not in out


def test_credentials_in_a_gs_az_or_endpoint_url_are_refused_with_that_clouds_advice() -> None:
    """The refusal told every cloud to use AWS variables and ``s3://bucket/prefix``."""
    from tierckpt import AzureTier, GCSTier

    cases = [
        (lambda: GCSTier(f"gs://{KEY}:{SECRET}@bucket/run"), "GOOGLE_APPLICATION_CREDENTIALS"),
        (lambda: AzureTier(f"az://{KEY}:{SECRET}@box/run"), "AZURE_STORAGE_ACCOUNT_KEY"),
        (
            lambda: GCSTier("gs://bucket/run", endpoint_url=f"http://{KEY}:{SECRET}@127.0.0.1:9"),
            "http(s)://host:port",
        ),
    ]
    for make, advice in cases:
        with pytest.raises(FormatError) as info:
            make()
        msg = str(info.value)
        assert advice in msg and "s3://" not in msg and "AWS_" not in msg, msg
        assert SECRET not in msg and KEY not in msg


def test_cli_never_prints_endpoint_credentials(record: Recorder) -> None:
    """`tierckpt ls` failing to connect: plain and with --debug (a traceback), the endpoint
    given by flag and by environment. Run side by side: each waits out botocore's retries."""
    port = _closed_port()
    runs = {
        "--endpoint-url, plain secret": (
            [
                "ls",
                "s3://bucket/run",
                "--endpoint-url",
                f"http://{KEY}:{PLAIN_SECRET}@127.0.0.1:{port}",
            ],
            _env(),
        ),
        "AWS_ENDPOINT_URL --debug, secret with '/'": (
            ["ls", "--debug", "s3://bucket/run"],
            _env(AWS_ENDPOINT_URL=f"http://{KEY}:{SECRET}@127.0.0.1:{port}"),
        ),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tierckpt.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name, (argv, env) in runs.items()
    }
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        secrets = (SECRET, PLAIN_SECRET, KEY)
        leaked = any(x in out + err for x in secrets)
        record("secrets", f"tierckpt ls, endpoint {name}", f"exit {proc.returncode}", not leaked)
        # boto3: the connection fails (1); obstore refuses the endpoint at once (2, usage)
        assert proc.returncode == (2 if s3_driver() == "obstore" else 1), (name, out, err)
        assert f"127.0.0.1:{port}" in err, (name, err)
        assert SECRET not in out + err, (name, err)
        assert PLAIN_SECRET not in out + err, (name, err)
        assert KEY not in out + err, (name, err)


def test_debug_keeps_botocore_wire_log_off_unless_asked_by_name(
    moto_server: S3Server, s3_bucket: object, record: Recorder
) -> None:
    bucket = s3_bucket(moto_server)  # type: ignore[operator]
    base = _env(AWS_SESSION_TOKEN=TOKEN, AWS_ENDPOINT_URL=moto_server.endpoint_url)
    runs = {
        "--debug": (["--debug"], base),
        "--debug-botocore": (["--debug-botocore"], base),
        "--debug + TIERCKPT_DEBUG_BOTOCORE=1": (
            ["--debug"],
            {**base, "TIERCKPT_DEBUG_BOTOCORE": "1"},
        ),
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "tierckpt.cli", "ls", *flags, f"s3://{bucket}/run"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO,
        )
        for name, (flags, env) in runs.items()
    }
    got = {name: (*proc.communicate(timeout=300), proc.returncode) for name, proc in procs.items()}
    out, err, rc = got["--debug"]
    shown = TOKEN in err or "x-amz-security-token" in err.lower()
    record(
        "secrets",
        "tierckpt --debug: botocore wire log",
        "token shown" if shown else "off",
        not shown,
    )
    assert rc == 0, err
    assert "no committed checkpoint" in out
    assert TOKEN not in out + err
    assert "x-amz-security-token" not in err.lower()
    # asked for by name, the wire log is there (so the check above could fail)
    for name in ("--debug-botocore", "--debug + TIERCKPT_DEBUG_BOTOCORE=1"):
        out, err, rc = got[name]
        assert rc == 0, (name, err)
        assert "x-amz-security-token" in err.lower(), name
