"""What the CLI adds around a command: a line on stderr while it waits (an unreachable
endpoint is retried for seconds), a hint naming the likely fix when it fails for missing
credentials, an endpoint nobody answers at or an https:// one answering in plain HTTP, the
tier folder (or object-store prefix) meant when ``ls`` was given one a level off, and the
codecs a checkpoint really stores."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, TextIO
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from tierckpt.backends.base import Backend
    from tierckpt.format import Manifest

#: a command silent for this long gets a "waiting for ..." line on stderr
WAIT_NOTICE_S = 2.0
#: and another one this often while it goes on waiting
WAIT_REPEAT_S = 5.0


class WaitNotice:
    """Prints ``waiting for URL (N s)`` on stderr when the command has shown nothing for
    :data:`WAIT_NOTICE_S` seconds, then every :data:`WAIT_REPEAT_S` — with the attempt while
    a failed request is retried (``(9 s, retrying: attempt 3 of 4)``, see
    :func:`watch_retries`); :meth:`quiet` stops it (a progress bar took over)."""

    def __init__(self, what: str, out: TextIO | None = None) -> None:
        self.what = what
        self.out = out if out is not None else sys.stderr
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tierckpt-wait", daemon=True)
        #: the request being retried now: (its attempt, the most it gets); None: none failed
        self.retrying: tuple[int, int] | None = None

    def attempt_failed(self, attempts: int, max_attempts: int) -> None:
        """A request's attempt number ``attempts`` failed: the line says the next one runs."""
        self.retrying = (min(attempts + 1, max_attempts), max_attempts)

    def line(self) -> str:
        waited = time.monotonic() - self._t0
        retry = self.retrying
        more = f", retrying: attempt {retry[0]} of {retry[1]}" if retry is not None else ""
        return f"tierckpt: waiting for {self.what} ({waited:.0f} s{more})\n"

    def _run(self) -> None:
        delay = WAIT_NOTICE_S
        while not self._stop.wait(delay):
            try:
                self.out.write(self.line())
                self.out.flush()
            except (OSError, ValueError):  # stderr closed: nothing to tell
                return
            delay = WAIT_REPEAT_S

    def quiet(self) -> None:
        self._stop.set()

    def __enter__(self) -> WaitNotice:
        self._thread.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(1.0)


#: the notice of the command running now (the progress bar silences it)
current: WaitNotice | None = None


def watch_retries(backend: Backend) -> None:
    """Tell the current notice when a request of ``backend``'s boto3 client fails and is
    retried, so its line shows the attempt (``retrying: attempt 3 of 4``). botocore retries
    inside one call, for seconds with backoff; without this the wait looks like a hang. The
    obstore backend retries its single requests itself and says so through ``watch_retries``."""
    watch = getattr(backend, "watch_retries", None)
    if callable(watch):

        def on_attempt(failed: int, max_attempts: int) -> None:
            notice = current
            if notice is not None and failed:
                notice.attempt_failed(failed, max_attempts)
            elif notice is not None:
                notice.retrying = None  # answered: no retry going on

        watch(on_attempt)
        return
    client = getattr(backend, "_client", None)
    events = getattr(getattr(client, "meta", None), "events", None)
    if events is None:
        return  # not a boto3 backend: nothing to watch
    max_attempts = int(getattr(backend, "max_attempts", 0) or 0)

    def on_needs_retry(
        attempts: int = 0, response: object = None, caught_exception: object = None, **_: object
    ) -> None:
        status = getattr(response[0], "status_code", 0) if isinstance(response, tuple) else 0
        failed = caught_exception is not None or status in (429, 500, 502, 503, 504)
        notice = current
        if failed and notice is not None and max_attempts and attempts < max_attempts:
            notice.attempt_failed(attempts, max_attempts)
        elif not failed and notice is not None:
            notice.retrying = None  # answered: no retry going on

    # returns None: botocore's own handler still decides whether and when to retry
    events.register("needs-retry.s3", on_needs_retry, unique_id="tierckpt-cli-wait-line")


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def hint_for(exc: BaseException, endpoint_url: str | None, urls: Sequence[str] = ()) -> str:
    """A sentence naming the likely fix for ``exc``, or ``""``. ``endpoint_url``: the
    command's ``--endpoint-url``; ``urls``: the locations it was given (where none was, an
    endpoint of a ``gs://`` or ``s3://`` location comes from an environment variable, which
    the hint then names)."""
    for e in _chain(exc):
        name = type(e).__name__
        text = str(e)
        code = getattr(e, "code", "")  # the obstore backend's errors carry the cause's code
        if name in ("NoCredentialsError", "PartialCredentialsError") or (
            "Unable to locate credentials" in text or code == "NoCredentials"
        ):
            return (
                "hint: no AWS credentials found: set AWS_PROFILE (a profile in ~/.aws/config) "
                "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run where an instance role "
                "applies"
            )
        if "not with TLS" in text or "WRONG_VERSION_NUMBER" in text:
            # obstore's (see its backend's hint) or botocore's SSLError: a server answered
            source, endpoint = endpoint_source(endpoint_url, urls)
            at = _host_port(endpoint)
            if source and at:
                return (
                    f"hint: {source} names https:// but the server at {at} speaks plain "
                    f"HTTP (no TLS): use http://{at}"
                )
            return "hint: the endpoint is https:// but its server speaks plain HTTP (no TLS)"
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionRefusedError") or (
            "Could not connect to the endpoint URL" in text
            or (code and "error sending request" in text)  # obstore: no connection
        ):
            source, endpoint = endpoint_source(endpoint_url, urls)
            where = _host_port(endpoint) or _host_port(
                getattr(e, "kwargs", {}).get("endpoint_url", "")
            )
            at = where or "the endpoint"
            if source:
                return f"hint: is {source} right? nothing answered at {at}"
            return (
                f"hint: nothing answered at {at}: is the network up? (a store of your own is "
                "named with --endpoint-url)"
            )
    return ""


def endpoint_source(endpoint_url: str | None, urls: Sequence[str]) -> tuple[str, str | None]:
    """Where the endpoint of a command given ``--endpoint-url endpoint_url`` (or None) and
    the locations ``urls`` comes from, and that endpoint: ``("--endpoint-url", URL)``, an
    environment variable the store reads where no option was given (``STORAGE_EMULATOR_HOST``
    for ``gs://``, ``AWS_ENDPOINT_URL_S3`` else ``AWS_ENDPOINT_URL`` for ``s3://``: named
    both, as config reads them), or ``("", None)``: the cloud's own."""
    from tierckpt import config

    if endpoint_url:
        return "--endpoint-url", endpoint_url
    schemes = {urlsplit(u).scheme for u in urls if "://" in u}
    if "gs" in schemes and (host := config.gcs_emulator_host()):
        # host:port, as Google's own clients take it, or a URL
        return "STORAGE_EMULATOR_HOST", host if "://" in host else f"http://{host}"
    if "s3" in schemes and (endpoint := config.s3_endpoint_url()):
        return "AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL)", endpoint
    return "", None


def _host_port(url: str | None) -> str:
    if not url:
        return ""
    parts = urlsplit(url)
    if not parts.hostname:
        return ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


def stored_codecs(backend: Backend, manifest: Manifest) -> list[str]:
    """The codec ids the checkpoint's chunks are stored with, from its shard indexes (what
    ``inspect`` shows); the manifest's list where an index cannot be read."""
    from tierckpt.restore import read_index

    ids: set[str] = set()
    try:
        for ref in manifest.shards:
            index, _blob, _footer = read_index(backend, ref, backend.url)
            names = [str(c.get("id", "?")) if isinstance(c, dict) else "?" for c in index["codecs"]]
            ids.update(names[c.codec] for c in index["chunks"])
    except Exception:  # ls must list what it can; inspect / verify say what is wrong
        return list(manifest.codecs)
    return sorted(ids) or ["raw"]


def tier_folders_near(url: str) -> str:
    """Where a local folder with no checkpoint is near tier folders
    (:func:`tierckpt.near.folders_near`); a hint line, or empty."""
    from tierckpt.near import folders_near

    if "://" in url and not url.startswith("file://"):
        return ""
    inside, below = folders_near(url.removeprefix("file://"))
    if inside is not None:
        return f"hint: this folder is inside the tier folder {inside}: tierckpt ls {inside}"
    return "hint: tier folders below this one: " + ", ".join(below) if below else ""


def tier_prefixes_near(backend: Backend, root: Backend) -> str:
    """The object-store form of :func:`tier_folders_near`
    (:func:`tierckpt.near.prefixes_near`); a hint line, or empty."""
    from tierckpt.near import prefixes_near

    inside, below = prefixes_near(backend, root)
    if inside is not None:
        return f"hint: this prefix is inside the tier prefix {inside}: tierckpt ls {inside}"
    return "hint: tier prefixes below this one: " + ", ".join(below) if below else ""
