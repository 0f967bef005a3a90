"""Ranged GETs of an S3 object read off the socket straight into the caller's memory.

obstore hands a ranged GET's body to Python as new buffers (joined into one, or streamed as
``bytes`` pieces), which are then copied into the storages: two copies of every byte after the
kernel's, one of them under the GIL. Here a single-range read (a load's data reads: one part of
the file spread over the storages it covers; any ``read_into`` of at most one part) is a signed
request on a plain ``http.client`` connection kept by the backend, and the body is received
with ``recv_into`` into the caller's memory itself, the GIL released while the kernel copies.
Bare GETs of a 256 MiB object from SeaweedFS on 127.0.0.1, 8 MiB x 8 in flight: 0.26 s of
client CPU and 0.37 s against 0.42 and 0.47 s through obstore (docs/benchmarks.md, sixteenth
session). Reads of several parts at once stay one ``get_ranges`` call.

Only for ``s3://`` stores that obstore would reach with the same requests: the endpoint in path
style (object_store's default), the credentials the backend found (its provider, asked again
before they expire), no store settings beyond the backend's own (``config=`` keys such as SSE-C
or virtual-hosted style leave every read to obstore, as do the environment's ``AWS_*``
variables that change obstore's GETs: ``config.OBSTORE_GET_VARIABLES``), and no proxy in the
environment.
``TIERCKPT_S3_DIRECT_READS=0`` turns it off.

It never decides an error. A request that gets no answer it can use before the body (no
connection, a TLS failure, a status other than 206) raises :class:`Unusable`, and the same
attempt is made through obstore, whose answer and error are the read's. A store that refuses
what obstore is allowed (a 4xx but 404, 408, 416 and 429, a 200 without a range, a TLS
failure, headers that disagree) turns the direct reads off for the backend with one log line.
A failure in the body (a timeout, a reset connection) is the first of the read's
``max_attempts``; the others are obstore's. A wrong length (past the object's end) is the
``FormatError`` obstore's reads raise."""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast
from urllib.parse import quote, urlsplit

from tierckpt.errors import FormatError

__all__ = ["DirectReads", "SigV4", "Unusable", "make_direct"]

log = logging.getLogger("tierckpt.backends.objstore")

#: SHA-256 of an empty body: what a GET's ``x-amz-content-sha256`` says
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: credentials are asked for again this long before the provider says they expire
REFRESH_MARGIN = timedelta(seconds=60)
#: store settings (``config=``) under which the reads are still obstore's own requests
SAME_REQUESTS = frozenset({"unsigned_payload", "aws_unsigned_payload", "conditional_put"})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Unusable(Exception):
    """The request got no answer usable before its body; ``disable``: the store refuses what
    obstore is allowed, so the backend stops reading this way."""

    def __init__(self, why: str, *, disable: bool) -> None:
        super().__init__(why)
        self.disable = disable


class SigV4:
    """AWS Signature Version 4 of an S3 request without a body, with the credentials
    ``provider()`` gives (obstore's provider: ``access_key_id``, ``secret_access_key``,
    ``token``, ``expires_at``), asked for again shortly before they expire."""

    def __init__(self, region: str, provider: Callable[[], dict[str, Any]]) -> None:
        self.region = region
        self._provider = provider
        self._lock = threading.Lock()
        self._creds: dict[str, Any] | None = None
        self._keys: dict[tuple[str, str], bytes] = {}  # (date, secret) -> signing key

    def _credentials(self) -> dict[str, Any]:
        with self._lock:
            creds = self._creds
            expires = None if creds is None else creds.get("expires_at")
            if creds is None or (
                expires is not None and datetime.now(UTC) >= expires - REFRESH_MARGIN
            ):
                creds = self._creds = self._provider()
            return creds

    def _signing_key(self, date: str, secret: str) -> bytes:
        key = self._keys.get((date, secret))
        if key is None:
            key = ("AWS4" + secret).encode()
            for part in (date, self.region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            self._keys = {(date, secret): key}  # one date at a time
        return key

    def headers(
        self, method: str, host: str, path: str, extra: dict[str, str], now: datetime | None = None
    ) -> dict[str, str]:
        """The request's headers (``host``, ``x-amz-*``, ``extra``) with its
        ``authorization``; ``path`` is sent as given (already percent-encoded)."""
        creds = self._credentials()
        stamp = (now or datetime.now(UTC)).strftime("%Y%m%dT%H%M%SZ")
        date = stamp[:8]
        h = {"host": host, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": stamp}
        if creds.get("token"):
            h["x-amz-security-token"] = creds["token"]
        h.update({k.lower(): v for k, v in extra.items()})
        names = sorted(h)
        canonical = "\n".join(
            [
                method,
                path,
                "",  # no query
                "".join(f"{n}:{' '.join(h[n].split())}\n" for n in names),
                ";".join(names),
                EMPTY_SHA256,
            ]
        )
        scope = f"{date}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = self._signing_key(date, creds["secret_access_key"])
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        h["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={creds['access_key_id']}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return h


class DirectReads:
    """Signed ranged GETs of one bucket over pooled ``http.client`` connections (see the
    module docstring). ``endpoint``: ``http(s)://host[:port][/base]``; objects are at
    ``/base/bucket/key`` (path style)."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        signer: SigV4,
        *,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
        request_timeout: float = 600.0,
    ) -> None:
        parts = urlsplit(endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) endpoint: {endpoint!r}")
        self._tls = parts.scheme == "https"
        self._hostname = parts.hostname
        default = 443 if self._tls else 80
        self._port = parts.port or default
        name = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        # the Host header http.client would send, which the signature covers
        self._host = name if self._port == default else f"{name}:{self._port}"
        self._base = parts.path.rstrip("/") + "/" + quote(bucket, safe="") + "/"
        self._signer = signer
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        self._request_timeout = request_timeout
        self._pool_size = max(1, pool_size)
        self._pool: list[http.client.HTTPConnection] = []
        self._pid = os.getpid()
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None

    def path(self, key: str) -> str:
        """The request path of ``key`` (percent-encoded as S3 signs it)."""
        return self._base + quote(key, safe="/~")

    def _take(self, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        """A pooled connection (reused: True) unless ``fresh``, else a new, unconnected one."""
        if os.getpid() != self._pid:  # forked: the parent's sockets are not ours
            self._pool, self._pid = [], os.getpid()
        if not fresh:
            try:
                return self._pool.pop(), True
            except IndexError:
                pass
        if self._tls:
            return http.client.HTTPSConnection(
                self._hostname, self._port, timeout=self._connect_timeout, context=self._ssl
            ), False
        return http.client.HTTPConnection(
            self._hostname, self._port, timeout=self._connect_timeout
        ), False

    def _give(self, conn: http.client.HTTPConnection) -> None:
        if len(self._pool) < self._pool_size and os.getpid() == self._pid:
            self._pool.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        pool, self._pool = self._pool, []
        for conn in pool:
            conn.close()

    def _answer(
        self, key: str, start: int, want: int
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """Send the GET of bytes ``start``..``start + want - 1`` and read its status line and
        headers; a pooled connection the server has closed meanwhile is replaced once."""
        path = self.path(key)
        for fresh in (False, True):
            conn, reused = self._take(fresh)
            try:
                if conn.sock is None:
                    conn.connect()
                    cast(socket.socket, conn.sock).settimeout(self._read_timeout)
                try:
                    headers = self._signer.headers(
                        "GET", self._host, path, {"range": f"bytes={start}-{start + want - 1}"}
                    )
                except Exception as exc:  # the provider failed: obstore's asks and says why
                    raise Unusable(f"credentials: {type(exc).__name__}", disable=False) from exc
                conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
                for k, v in headers.items():
                    conn.putheader(k, v)
                conn.endheaders()
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if not reused:
                    raise Unusable(f"connection dropped: {exc}", disable=False) from exc
            except ssl.SSLError as exc:
                conn.close()
                raise Unusable(f"TLS: {exc}", disable=True) from exc
            except (OSError, http.client.HTTPException) as exc:  # no connection, no answer
                conn.close()
                raise Unusable(f"{type(exc).__name__}: {exc}", disable=False) from exc
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def read(self, key: str, start: int, views: list[memoryview], where: str) -> None:
        """Fill ``views`` (in order, bytes, ``want`` in all) with the bytes at ``start`` of
        ``key``. :class:`Unusable` before the body; ``FormatError`` when the store sends
        fewer or more bytes than asked; ``OSError`` / ``http.client.HTTPException`` (a timeout,
        a cut connection) while the body is read."""
        want = sum(len(v) for v in views)
        conn, resp = self._answer(key, start, want)
        try:
            if resp.status != 206:
                self._refused(resp)
            length = resp.getheader("content-length")
            got = int(length) if length is not None else None
            shown = _CONTENT_RANGE.fullmatch(resp.getheader("content-range") or "")
            if shown is None or int(shown.group(1)) != start:
                raise Unusable(f"206 without the range asked for ({shown})", disable=True)
            span = int(shown.group(2)) - start + 1
            if got is not None and got != span:  # a server or proxy of its own kind
                raise Unusable(f"Content-Length {got} but Content-Range {span}", disable=True)
            if span < want:  # a range past the end: S3 sends what there is
                raise FormatError(
                    f"{where}: read of bytes {start}-{start + want - 1} past its end "
                    f"({start + span})"
                )
            if span > want:
                raise FormatError(
                    f"{where}: read of bytes {start}-{start + want - 1} got more than asked "
                    f"({span} bytes)"
                )
            deadline = time.monotonic() + self._request_timeout
            for v in views:
                pos = 0
                while pos < len(v):
                    n = resp.readinto(v[pos:])
                    if not n:
                        raise http.client.IncompleteRead(b"", want)
                    pos += n
                    if time.monotonic() > deadline:  # bytes keep coming, too slowly
                        raise TimeoutError(
                            f"{where}: not read within {self._request_timeout:.0f} s"
                        )
            if resp.chunked and resp.read(1):
                raise FormatError(f"{where}: read of {want} bytes at {start} got more than asked")
        except BaseException:
            conn.close()
            raise
        self._give(conn)

    def _refused(self, resp: http.client.HTTPResponse) -> None:
        status = resp.status
        try:
            body = resp.read(4096).decode("utf-8", "replace")
        except (OSError, http.client.HTTPException):
            body = ""
        code = re.search(r"<Code>([A-Za-z]+)</Code>", body)
        why = f"HTTP {status} {resp.reason}" + (f" ({code.group(1)})" if code else "")
        # the object's or the range's fault (obstore answers it as the load's error), or the
        # server's moment (obstore retries it): not a reason to stop reading this way
        disable = status not in (404, 408, 416, 429) and not 500 <= status < 600
        raise Unusable(why, disable=disable)


def make_direct(
    bucket: str,
    endpoint: str | None,
    region: str,
    provider: Callable[[], dict[str, Any]],
    extra: dict[str, Any],
    *,
    connect_timeout: float,
    read_timeout: float,
    request_timeout: float,
    pool_size: int,
) -> DirectReads | None:
    """The direct reads of an ``s3://`` store (None where they would not be the requests
    obstore sends: see the module docstring)."""
    from tierckpt import config as knobs

    if not knobs.s3_direct_reads():
        return None
    why = ""
    if set(extra) - SAME_REQUESTS:
        why = f"store settings {sorted(set(extra) - SAME_REQUESTS)}"
    elif proxy := knobs.proxy_in_environment():
        why = f"{proxy} is set (a proxy)"
    elif changed := knobs.obstore_get_settings():
        why = f"{', '.join(changed)} set"
    if why:
        log.debug(
            "s3://%s: direct ranged reads off (%s); reading through object_store", bucket, why
        )
        return None
    base = endpoint or f"https://s3.{region}.amazonaws.com"
    try:
        return DirectReads(
            base,
            bucket,
            SigV4(region, provider),
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            request_timeout=request_timeout,
            pool_size=pool_size,
        )
    except ValueError as exc:
        log.debug("s3://%s: direct ranged reads off (%s)", bucket, exc)
        return None
