"""obstore, the default S3 driver (issue 15), with what only boto3 had: a named credentials
profile, the rank's share of its node's connections at restore, the attempt on the CLI's wait
line, and a create-only put sent twice that knows its own bytes; boto3 stays selectable."""

from __future__ import annotations

import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.errors import BackendError
from tierckpt.testing.s3servers import S3Server

BucketFactory = Callable[[S3Server], str]
MiB = 2**20


@pytest.fixture
def default_driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No driver chosen: what a user gets (the suite may pin one through the environment)."""
    monkeypatch.delenv("TIERCKPT_S3_DRIVER", raising=False)
    yield


# -- the choice --------------------------------------------------------------------------------
def test_s3_tiers_and_offline_tools_default_to_obstore(default_driver: None) -> None:
    from tierckpt.offline import open_backend

    tier = S3Tier("s3://bkt/run", endpoint_url="http://127.0.0.1:9")
    assert tier.driver == "obstore"
    for backend in (tier.make_backend(), open_backend("s3://bkt/run")):
        assert isinstance(backend, ObjectStoreBackend)
        backend.close()


def test_boto3_stays_selectable(default_driver: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """By argument, by environment, and by handing the tier a boto3 client (which only boto3
    can use: asking obstore to use it says what to do)."""
    tier = S3Tier("s3://bkt/run", driver="boto3", endpoint_url="http://127.0.0.1:9")
    backend = tier.make_backend()
    assert isinstance(backend, S3Backend)
    backend.close()
    assert S3Tier("s3://bkt/run", client=object()).driver == "boto3"
    with pytest.raises(ValueError, match=r"client=.*driver='boto3'"):
        S3Tier("s3://bkt/run", client=object(), driver="obstore")
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "boto3")
    assert S3Tier("s3://bkt/run").driver == "boto3"
    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "obstore")
    assert S3Tier("s3://bkt/run", client=object()).driver == "boto3"  # the client decides


# -- profile= ----------------------------------------------------------------------------------
@pytest.mark.s3
def test_a_named_profile_signs_obstores_requests(
    seaweedfs_server: S3Server,
    s3_bucket: BucketFactory,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    default_driver: None,
) -> None:
    """SeaweedFS checks signatures: the environment holds wrong keys, the profile the right
    ones, and a checkpoint saved and restored through S3Tier(profile=) on the default driver
    is signed with the profile's."""
    bucket = s3_bucket(seaweedfs_server)
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ckpt]\naws_access_key_id = {seaweedfs_server.access_key}\n"
        f"aws_secret_access_key = {seaweedfs_server.secret_key}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    url = f"s3://{bucket}/run"
    endpoint = seaweedfs_server.endpoint_url
    state = {"w": torch.arange(300_000, dtype=torch.float32)}
    tier = S3Tier(url, profile="ckpt", endpoint_url=endpoint)
    assert tier.driver == "obstore"
    with Checkpointer([tier], chunk_bytes=1 << 20, host_buffer_bytes=8 << 20) as ck:
        ck.save(state, step=1).result()
    with Checkpointer([S3Tier(url, profile="ckpt", endpoint_url=endpoint)]) as fresh:
        assert torch.equal(fresh.load()["w"], state["w"])
    # the environment's keys really are refused: the profile was what signed
    plain = ObjectStoreBackend(url, endpoint_url=endpoint, max_attempts=1)
    with pytest.raises(BackendError, match="403"):
        plain.list()
    plain.close()


def test_refreshable_credentials_are_handed_out_until_shortly_before_they_expire() -> None:
    """Role credentials (botocore refreshes them) are handed to obstore for at most 5 minutes
    and never past their expiry, so obstore asks again in time and gets the refreshed keys;
    static keys are handed out for hours."""
    from botocore.credentials import Credentials, RefreshableCredentials

    from tierckpt.backends.objstore._store import BotocoreCredentials

    issued = iter(range(1, 100))

    def refresh() -> dict[str, str]:
        n = next(issued)
        expiry = datetime.now(UTC) + timedelta(minutes=20 if n == 1 else 3)
        return {
            "access_key": f"AK{n}",
            "secret_key": "s",
            "token": f"T{n}",
            "expiry_time": expiry.isoformat(),
        }

    creds = RefreshableCredentials.create_from_metadata(refresh(), refresh, "test")
    provider = BotocoreCredentials(creds)
    now = datetime.now(UTC)
    first = provider()
    assert first["access_key_id"] == "AK1" and first["token"] == "T1"
    assert now < first["expires_at"] <= now + timedelta(minutes=5, seconds=5)
    creds._expiry_time = datetime.now(UTC) + timedelta(seconds=30)  # past botocore's margin
    second = provider()
    assert second["access_key_id"] == "AK2"  # refreshed, not the keys obstore held
    assert second["expires_at"] <= datetime.now(UTC) + timedelta(minutes=3, seconds=5)
    static = BotocoreCredentials(Credentials("AK", "SK"))()
    assert static["expires_at"] > now + timedelta(hours=1) and static["token"] is None


def test_an_unknown_profile_says_what_to_do() -> None:
    from tierckpt.errors import FormatError

    with pytest.raises(FormatError, match=r"no-such.*name a profile of ~/.aws/config"):
        ObjectStoreBackend("s3://bkt/run", profile="no-such", endpoint_url="http://127.0.0.1:9")


# -- the node's connection share -----------------------------------------------------------------
@pytest.mark.s3
@pytest.mark.parametrize(("local_ranks", "most"), [("8", 2), ("2", 8)])
def test_reads_stay_within_the_ranks_share_of_the_nodes_connections(
    moto_server: S3Server,
    s3_bucket: BucketFactory,
    monkeypatch: pytest.MonkeyPatch,
    local_ranks: str,
    most: int,
) -> None:
    """A node budget of 16 GETs: a rank of 8 on the node has 2, of 2 has 8; two reader threads
    reading at once never have more ranged GETs in flight together (counted at obstore's
    calls, each held a moment so that those sent together overlap)."""
    import obstore

    bucket = s3_bucket(moto_server)
    monkeypatch.setenv("TIERCKPT_NODE_S3_CONNECTIONS", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    part = 5 * MiB
    data = bytes(range(256)) * (12 * part // 256)
    moto_server.admin.put_object(Bucket=bucket, Key="run/big", Body=data)
    lock = threading.Lock()
    now, peak = [0], [0]

    def counted(fn: Any, n: Callable[..., int]) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            k = n(*args, **kwargs)
            with lock:
                now[0] += k
                peak[0] = max(peak[0], now[0])
            try:
                time.sleep(0.05)
                return fn(*args, **kwargs)
            finally:
                with lock:
                    now[0] -= k

        return call

    monkeypatch.setattr(
        obstore, "get_ranges", counted(obstore.get_ranges, lambda *a, **k: len(k["starts"]))
    )
    monkeypatch.setattr(obstore, "get_range", counted(obstore.get_range, lambda *a, **k: 1))
    b = ObjectStoreBackend(
        f"s3://{bucket}/run",
        endpoint_url=moto_server.endpoint_url,
        part_size=part,
        max_concurrency=8,
    )
    assert b.read_concurrency == 16 // int(local_ranks)
    outs = [bytearray(len(data)) for _ in range(2)]
    threads = [threading.Thread(target=b.read_into, args=("big", 0, memoryview(o))) for o in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    b.close()
    assert all(o == data for o in outs)
    assert 1 <= peak[0] <= most
    if most == 2:
        assert peak[0] == 2  # the share is used, not just respected


# -- the CLI's wait line -----------------------------------------------------------------------
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_wait_line_shows_the_attempt_while_obstore_retries(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """obstore against a refused port (4 attempts): the line printed between
    attempts names the attempt, as with boto3 (tests/test_cli_wait_attempts.py). The backoff
    is fixed at 0.3 s and the notice's delays shortened, so lines fall inside every wait."""
    from tierckpt.backends.objstore import _backend
    from tierckpt.cli import _hints, main

    monkeypatch.setenv("TIERCKPT_S3_DRIVER", "obstore")
    monkeypatch.setattr(_backend, "backoff", lambda attempt, exc=None, url="": time.sleep(0.3))
    monkeypatch.setattr(_hints, "WAIT_NOTICE_S", 0.0)
    monkeypatch.setattr(_hints, "WAIT_REPEAT_S", 0.02)
    port = _closed_port()
    rc = main(["ls", "s3://bucket/run", "--endpoint-url", f"http://127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"nothing answered at 127.0.0.1:{port}" in err, err
    waits = [ln for ln in err.splitlines() if ln.startswith("tierckpt: waiting for s3://bucket")]
    tries = [int(m.group(1)) for ln in waits if (m := re.search(r"attempt (\d) of 4\)", ln))]
    assert set(tries) == {2, 3, 4}, err
    assert tries == sorted(tries)


# -- a create-only put sent twice ------------------------------------------------------------
@pytest.mark.s3
def test_a_create_sent_again_after_a_lost_answer_finds_its_own_bytes(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first create-only PUT lands but its answer is lost (a connection error after the
    server applied it); the backend sends it again, meets the object, sees its own bytes and
    reports success, where object_store's hidden retry would have reported FileExistsError.
    A different object there is still refused."""
    import obstore

    bucket = s3_bucket(moto_server)
    b = ObjectStoreBackend(
        f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, conditional_put=True
    )
    real_put = obstore.put
    lost = [0]

    class GenericError(Exception):  # obstore's kind for a request that got no answer
        pass

    def put_then_lose(store: Any, key: str, body: Any, **kwargs: Any) -> Any:
        out = real_put(store, key, body, **kwargs)
        if kwargs.get("mode") == "create" and not lost[0]:
            lost[0] += 1
            raise GenericError("Generic S3 error: HTTP error: error sending request")
        return out

    monkeypatch.setattr(obstore, "put", put_then_lose)
    name = f"manifest-{secrets.token_hex(3)}"
    b.put_atomic(name, b"ours")
    assert lost[0] == 1 and b.get(name) == b"ours"
    with pytest.raises(FileExistsError):
        b.put_atomic(name, b"theirs")
    b.close()


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_after_close_what_is_committed_can_still_be_listed_and_loaded(
    moto_server: S3Server, s3_bucket: BucketFactory, driver: str
) -> None:
    """A report after training (``with Checkpointer(...) as ck: ...``, then ``ck.steps()``)
    worked on boto3 and local tiers, while obstore's tier raised "backend is closed" and
    dropped out of ``tier_steps()``. Reads go on after ``close()`` on both drivers; writes
    to the closed backend are refused (the writer let go of its lease)."""
    bucket = s3_bucket(moto_server)
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, driver=driver)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with Checkpointer([tier]) as ck:
        ck.save(state, 4).wait()
        backend = ck.backend("s3")
    assert ck.steps() == [4] and ck.tier_steps() == {"s3": [4]}
    readers = {t for t in threading.enumerate() if t.name.startswith("tierckpt-read")}
    assert torch.equal(ck.load(tier="s3")["w"], state["w"])
    # its reader threads ended with the load (nobody would end them after close())
    assert {t for t in threading.enumerate() if t.name.startswith("tierckpt-read")} <= readers
    if driver == "obstore":
        with pytest.raises(BackendError, match="closed; open a new one to write"):
            backend.put_atomic("x", b"1")
