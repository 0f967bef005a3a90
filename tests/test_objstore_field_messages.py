"""What an operator reads when an object store misbehaves in ways a field test met: each test
drives a real server (moto on 127.0.0.1) through the fault proxy and checks that the message
says what is wrong and what to do.

- A delete refused with 403 AccessDenied while puts work names the permission
  (``s3:DeleteObject``), on both drivers and in ``tierckpt gc``; a retention pass that keeps
  failing is warned about again every ``RETENTION_WARN_EVERY`` passes, not once for ever.
- A multipart completion under throttling is retried with the throttling backoff, and where the
  abort after a failed completion fails too, the error names the completion.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.cli import main
from tierckpt.errors import BackendError
from tierckpt.pipeline._retain import RETENTION_WARN_EVERY
from tierckpt.testing import faultproxy
from tierckpt.testing.faultproxy import Fault, FaultProxy

pytestmark = pytest.mark.s3

MiB = 1 << 20


@pytest.fixture
def denied_action(monkeypatch: pytest.MonkeyPatch) -> str:
    """A proxy action ``denied``: answer ``403 AccessDenied`` (a policy without a permission;
    the credentials are fine)."""
    monkeypatch.setattr(faultproxy, "ACTIONS", faultproxy.ACTIONS | {"denied"})
    errors = {
        **faultproxy._ERRORS,
        "denied": (403, "Forbidden", "AccessDenied", "Access Denied"),
    }
    monkeypatch.setattr(faultproxy, "_ERRORS", errors)
    return "denied"


def _deletes_denied(action: str) -> list[Fault]:
    # object_store deletes one object with DeleteObjects (POST ?delete), botocore with DELETE
    return [
        Fault(action, method="DELETE"),
        Fault(action, method="POST", path_contains="?delete"),
    ]


@pytest.fixture
def proxy(moto_server: Any) -> Iterator[FaultProxy]:
    with FaultProxy(moto_server.endpoint_url) as p:
        yield p


def _backend(driver: str, url: str, proxy: FaultProxy) -> ObjectStoreBackend | S3Backend:
    """The backend of ``driver`` for ``url``, through ``proxy``."""
    if driver == "obstore":
        return ObjectStoreBackend(url, endpoint_url=proxy.endpoint_url)
    return S3Backend(url, endpoint_url=proxy.endpoint_url)


# -- A: a delete refused by the policy ----------------------------------------------------


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_a_refused_delete_names_the_permission(
    driver: str, moto_server: Any, s3_bucket: Any, proxy: FaultProxy, denied_action: str
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    backend = _backend(driver, url, proxy)
    try:
        backend.put_atomic("a", b"x")
        proxy.set_faults(_deletes_denied(denied_action))
        with pytest.raises(BackendError) as info:
            backend.delete("a")
    finally:
        backend.close()
    text = str(info.value)
    assert "s3:DeleteObject" in text, text
    assert "keep_last=None" in text, text
    assert "check the credentials" not in text, text  # they work: puts went through
    assert proxy.fired[denied_action] >= 1


def test_a_gc_names_the_delete_permission(
    moto_server: Any,
    s3_bucket: Any,
    proxy: FaultProxy,
    denied_action: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    state = {"w": torch.arange(64, dtype=torch.float32)}
    with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, keep_last=None)]) as ck:
        for step in (1, 2, 3):
            ck.save(state, step).wait(timeout=60)
    proxy.set_faults(_deletes_denied(denied_action))
    rc = main(["gc", url, "--keep-last", "1", "--endpoint-url", proxy.endpoint_url])
    err = capsys.readouterr().err
    assert rc == 1
    assert "s3:DeleteObject" in err, err
    assert "check the credentials" not in err, err


def test_a_retention_failing_on_is_warned_about_again(
    moto_server: Any,
    s3_bucket: Any,
    proxy: FaultProxy,
    denied_action: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    state = {"w": torch.arange(64, dtype=torch.float32)}
    caplog.set_level(logging.WARNING, logger="tierckpt")
    with Checkpointer([S3Tier(url, endpoint_url=proxy.endpoint_url, keep_last=1)]) as ck:
        ck.save(state, 0).wait(timeout=60)
        ck.wait(retention=True)
        proxy.set_faults(_deletes_denied(denied_action))
        for step in range(1, RETENTION_WARN_EVERY + 1):  # each pass fails from here on
            ck.save(state, step).wait(timeout=60)
            ck.wait(retention=True)
        warned = [r.getMessage() for r in caplog.records if "retention on tier" in r.getMessage()]
        proxy.set_faults([])
    assert len(warned) == 2, warned  # the first failed pass, and the 10th in a row
    assert f"failed {RETENTION_WARN_EVERY} passes in a row" in warned[1], warned
    assert "s3:DeleteObject" in warned[1], warned


# -- C: a multipart completion under throttling ---------------------------------------------


class _ThrottleFor(FaultProxy):
    """Answers ``503 SlowDown`` to requests whose target holds ``needle`` for ``seconds`` from
    the first such request on, then forwards them."""

    def __init__(self, upstream: str, method: str, needle: str, seconds: float) -> None:
        super().__init__(upstream)
        self._method, self._needle, self._seconds = method, needle, seconds
        self._first: float | None = None
        self._mu = threading.Lock()
        self.throttled = 0

    def _pick(self, method: str, target: str) -> tuple[Fault | None, faultproxy.RequestRecord]:
        fault, record = super()._pick(method, target)
        if method == self._method and self._needle in target:
            with self._mu:
                now = time.monotonic()
                if self._first is None:
                    self._first = now
                if now - self._first < self._seconds:
                    self.throttled += 1
                    return Fault("slowdown"), record
        return fault, record


def _multipart(backend: ObjectStoreBackend, n: int) -> None:
    w = backend.open_writer("big")
    w.write(0, bytes(n))
    w.commit()


def test_c_completion_rides_out_a_throttling_burst(moto_server: Any, s3_bucket: Any) -> None:
    bucket = s3_bucket(moto_server)
    # CompleteMultipartUpload is POST ?uploadId=...; throttled for 0.5 s (object_store's
    # four attempts used to fall within 0.2 s of each other)
    with _ThrottleFor(moto_server.endpoint_url, "POST", "uploadId=", 0.5) as proxy:
        backend = ObjectStoreBackend(
            f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, part_size=5 * MiB
        )
        try:
            _multipart(backend, 6 * MiB)
            assert backend.size("big") == 6 * MiB
        finally:
            backend.close()
        assert proxy.throttled >= 1


def test_c_failed_completion_is_named_not_its_abort(
    moto_server: Any, s3_bucket: Any, proxy: FaultProxy
) -> None:
    bucket = s3_bucket(moto_server)
    backend = ObjectStoreBackend(
        f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, part_size=5 * MiB, max_attempts=1
    )
    proxy.set_faults(
        [
            Fault("slowdown", method="POST", path_contains="uploadId="),  # the completion
            Fault("slowdown", method="DELETE", path_contains="uploadId="),  # its abort
        ]
    )
    try:
        with pytest.raises(BackendError) as info:
            _multipart(backend, 6 * MiB)
    finally:
        backend.close()
    text = str(info.value)
    assert proxy.fired["slowdown"] >= 2
    assert "completing the multipart upload" in text, text
    assert "--abort-incomplete" in text, text
    # the abort comes second, as a note
    assert text.index("CompleteMultipartUpload") < text.index("DELETE"), text


# -- B: a store that throttles says so --------------------------------------------------------


@pytest.mark.parametrize("driver", ["obstore", "boto3"])
def test_b_throttling_is_logged_once_naming_the_knob(
    driver: str,
    moto_server: Any,
    s3_bucket: Any,
    proxy: FaultProxy,
    caplog: pytest.LogCaptureFixture,
) -> None:
    bucket = s3_bucket(moto_server)
    url = f"s3://{bucket}/run"
    backend = _backend(driver, url, proxy)
    caplog.set_level(logging.WARNING)
    try:
        backend.put_atomic("a", b"x")
        for _ in range(2):  # each HEAD throttled once, then answered
            proxy.set_faults([Fault("slowdown", method="HEAD", times=1)])
            assert backend.size("a") == 1
    finally:
        backend.close()
    assert proxy.fired["slowdown"] == 2
    said = [r.getMessage() for r in caplog.records if "throttl" in r.getMessage()]
    assert len(said) == 1, said  # once per location and interval, not per answer
    assert url in said[0] and "503" in said[0] and "max_concurrency" in said[0], said


# -- D: what the endpoint's answer says -----------------------------------------------------


def test_d_https_to_a_plain_http_server_is_named(
    moto_server: Any, s3_bucket: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    bucket = s3_bucket(moto_server)
    https = moto_server.endpoint_url.replace("http://", "https://")
    rc = main(["ls", f"s3://{bucket}/run", "--endpoint-url", https])
    err = capsys.readouterr().err
    assert rc == 1
    assert "speaks plain HTTP" in err, err
    assert "use http://127.0.0.1:" in err, err
    assert "nothing answered" not in err and "reachable" not in err, err


def test_d_an_ignored_range_header_is_not_called_unreachable(
    moto_server: Any, s3_bucket: Any
) -> None:
    bucket = s3_bucket(moto_server)
    # a middlebox that drops the Range header: the server sends the whole object
    with FaultProxy(moto_server.endpoint_url, drop_request_headers=["Range"]) as proxy:
        backend = ObjectStoreBackend(
            f"s3://{bucket}/run", endpoint_url=proxy.endpoint_url, max_attempts=1
        )
        try:
            backend.put_atomic("x", bytes(100_000))
            with pytest.raises(BackendError) as info:
                backend.read("x", 10, 50)
        finally:
            backend.close()
    text = str(info.value)
    assert "reachable" not in text, text
    assert "Range header" in text, text


# -- E: boto3, an answer cut short with consistent headers ---------------------------------


def test_e_a_short_answer_inside_the_object_is_read_on(
    moto_server: Any, s3_bucket: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = s3_bucket(moto_server)
    backend = S3Backend(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    data = bytes(range(256)) * 4096  # 1 MiB
    real = backend._client.get_object
    cut = []

    def get_object(**kwargs: Any) -> Any:
        resp = real(**kwargs)
        rng = kwargs.get("Range", "")
        if rng and not cut:  # the first ranged answer: half of it, headers consistent
            first, last = (int(x) for x in rng.removeprefix("bytes=").split("-"))
            n = (last - first + 1) // 2
            body = resp["Body"].read()[:n]
            resp["Body"].close()
            resp["Body"] = io.BytesIO(body)
            resp["ContentLength"] = n
            resp["ContentRange"] = f"bytes {first}-{first + n - 1}/{len(data)}"
            cut.append(rng)
        return resp

    try:
        backend.put_atomic("x", data)
        monkeypatch.setattr(backend._client, "get_object", get_object)
        got = backend.read("x", 1000, 500_000)
    finally:
        backend.close()
    assert cut, "no ranged GET was cut"
    assert bytes(got) == data[1000:501_000]
