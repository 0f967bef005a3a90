"""What the CLI adds around a command: a line on stderr while it waits (an unreachable
endpoint is retried for seconds), a hint naming the likely fix when it fails for missing
credentials or an endpoint nobody answers at, and the codecs a checkpoint really stores."""

from __future__ import annotations

import sys
import threading
import time
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
    :data:`WAIT_NOTICE_S` seconds, then every :data:`WAIT_REPEAT_S`; :meth:`quiet` stops it
    (a progress bar took over)."""

    def __init__(self, what: str, out: TextIO | None = None) -> None:
        self.what = what
        self.out = out if out is not None else sys.stderr
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tierckpt-wait", daemon=True)

    def _run(self) -> None:
        delay = WAIT_NOTICE_S
        while not self._stop.wait(delay):
            waited = time.monotonic() - self._t0
            try:
                self.out.write(f"tierckpt: waiting for {self.what} ({waited:.0f} s)\n")
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


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def hint_for(exc: BaseException, endpoint_url: str | None) -> str:
    """A sentence naming the likely fix for ``exc``, or ``""``."""
    for e in _chain(exc):
        name = type(e).__name__
        text = str(e)
        if name in ("NoCredentialsError", "PartialCredentialsError") or (
            "Unable to locate credentials" in text
        ):
            return (
                "hint: no AWS credentials found: set AWS_PROFILE (a profile in ~/.aws/config) "
                "or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or run where an instance role "
                "applies"
            )
        if name in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionRefusedError") or (
            "Could not connect to the endpoint URL" in text
        ):
            where = _host_port(endpoint_url) or _host_port(
                getattr(e, "kwargs", {}).get("endpoint_url", "")
            )
            return f"hint: is --endpoint-url right? nothing answered at {where or 'the endpoint'}"
    return ""


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
