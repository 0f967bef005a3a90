"""Fixtures shared by the whole test suite, grouped by topic.

S3
    Dummy AWS credentials for the session (nothing can reach the cloud: the config and
    credentials files are hidden, endpoints point at 127.0.0.1), one moto server and one
    SeaweedFS server per session, each started on first use, and ``s3_bucket``: a factory that
    creates a fresh bucket on a server for one test and empties and removes it afterwards.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierckpt.testing.emulators import (
    AZURITE_ACCOUNT,
    AZURITE_KEY,
    Emulator,
    start_azurite,
    start_fake_gcs,
)
from tierckpt.testing.gcsxml import GcsXmlFront
from tierckpt.testing.s3servers import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    S3Server,
    start_moto,
    start_seaweedfs,
)


@pytest.fixture(scope="session", autouse=True)
def _auto_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """codec="auto" keeps what loads measured in a session folder, not the user's cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TIERCKPT_AUTO_STATE_DIR", str(tmp_path_factory.mktemp("auto-state")))
    # the streaming-store copy is compiled once per session into a session folder too
    # (tierckpt/_native.py builds into $XDG_CACHE_HOME/tierckpt/native), not the user's cache
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("user-cache")))
    yield
    mp.undo()


# -- S3 -----------------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def _aws_test_credentials() -> Iterator[None]:
    """Dummy credentials for every test; the user's AWS config never leaks in."""
    mp = pytest.MonkeyPatch()
    for key in list(os.environ):
        if key.startswith("AWS_"):
            mp.delenv(key)
    mp.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    mp.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    mp.setenv("AWS_DEFAULT_REGION", REGION)
    mp.setenv("AWS_CONFIG_FILE", os.devnull)
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # the S3 driver: the default (obstore) unless TIERCKPT_S3_DRIVER names one, so the suite
    # runs on what users get; TIERCKPT_S3_DRIVER=boto3 runs it on boto3. Both drivers run the
    # shared backend suite (test_backends.py) whatever is set; tests written against
    # botocore's own hooks pin boto3 themselves (the ``boto3_driver`` fixture)
    yield
    mp.undo()


@pytest.fixture
def boto3_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    """The boto3 S3 driver for this test (and the processes it starts): for tests that reach
    into botocore (its events, retry handlers, client) rather than the backend contract."""
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "boto3")


@pytest.fixture(scope="session")
def moto_server() -> Iterator[S3Server]:
    """moto's S3 on 127.0.0.1, in this process."""
    server = start_moto()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """SeaweedFS (``weed mini``) on 127.0.0.1; fails with its log if it does not start."""
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """Each S3 server in turn (for tests that must pass on both)."""
    server: S3Server = request.getfixturevalue(f"{request.param}_server")
    return server


@pytest.fixture
def s3_bucket() -> Iterator[Callable[[S3Server], str]]:
    """``s3_bucket(server)`` creates a fresh bucket for this test and returns its name."""
    made: list[tuple[S3Server, str]] = []

    def make(server: S3Server) -> str:
        name = f"tierckpt-{secrets.token_hex(6)}"
        server.admin.create_bucket(Bucket=name)
        made.append((server, name))
        return name

    yield make
    for server, name in made:
        _remove_bucket(server, name)


def _remove_bucket(server: S3Server, bucket: str) -> None:
    client = server.admin
    with contextlib.suppress(Exception):
        pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket)
        for page in pages:
            for up in page.get("Uploads", []):
                client.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=bucket)


# -- object-store emulators: GCS and Azure Blob (the obstore backend) -----------------------


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """Azurite's blob service on 127.0.0.1; skips where Azurite (npm) is not installed."""
    try:
        server = start_azurite(tmp_path_factory.mktemp("azurite"))
    except FileNotFoundError as exc:
        pytest.skip(f"Azurite is not installed here: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    """fake-gcs-server on 127.0.0.1; skips where its wheel is not installed."""
    try:
        server = start_fake_gcs(tmp_path_factory.mktemp("fake-gcs"))
    except FileNotFoundError as exc:
        pytest.skip(f"fake-gcs-server is not installed here: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def gcs_xml(fake_gcs: Emulator) -> Iterator[GcsXmlFront]:
    """fake-gcs-server with the XML API's writes that obstore sends (tierckpt.testing.gcsxml):
    ``gcs_xml.endpoint_url`` is what a ``gs://`` backend's ``endpoint_url=`` takes."""
    with GcsXmlFront(fake_gcs.endpoint_url) as front:
        yield front


@pytest.fixture
def azure_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Azurite's well-known account through the standard environment variables."""
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY)


# -- node RAM (NodeRamTier, PeerTier) -------------------------------------------------------


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh folder in /dev/shm (node RAM; in the peer tests, the "nodes'" folders
    ``node-<r>``), removed after the test."""
    path = Path(f"/dev/shm/tierckpt-test-{secrets.token_hex(5)}")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)
