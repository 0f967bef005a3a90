"""A fault-injecting HTTP/1.1 reverse proxy for S3 tests.

``FaultProxy(upstream)`` listens on 127.0.0.1 (a free port) and forwards every request to the
S3 endpoint ``upstream`` byte for byte: headers untouched (so SigV4 signatures stay valid),
bodies with ``Content-Length`` or chunked framing (boto3's ``aws-chunked`` uploads ride inside
HTTP chunked framing), keep-alive connections, ``Expect: 100-continue`` answered by the proxy.
A schedule of :class:`Fault` rules picks requests (method, a substring of the request target,
the n-th match, a seeded probability, at most ``times``) and, instead of forwarding them:

``error500`` / ``slowdown``
    answer ``500 InternalError`` / ``503 SlowDown`` with an S3 XML error body;
``reset_request``
    read about half of the request body, then reset the connection (TCP RST);
``reset_response``
    forward the request, send the response headers and half the body, then reset;
``stall_response``
    the same, but send nothing more for ``seconds`` (a store that hangs mid-answer, longer
    than the client's read timeout) before the reset;
``delay``
    wait ``seconds``, then forward normally;
``stall``
    read the request and answer nothing for ``seconds`` (longer than the client's read
    timeout), then close.

Every request is recorded (``requests``: method, target, the fault it met) with when it
arrived and when the upstream's answer began (``time.perf_counter()``), so that a test or a
bench can see which requests overlap and which wait for one another. The proxy's sockets set
``TCP_NODELAY``: a response's head and body are sent apart, which with Nagle's algorithm and
the client's delayed ACK would hold a small body back some 40 ms.

Everything is bounded: sockets have timeouts, waits end when the proxy closes, and
``close()`` stops every thread.
"""

from __future__ import annotations

import random
import secrets
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

__all__ = ["ACTIONS", "Fault", "FaultProxy", "RequestRecord"]

ACTIONS = frozenset(
    {"error500", "slowdown", "reset_request", "reset_response", "stall_response", "delay", "stall"}
)
_MAX_LINE = 65536
_MAX_HEADERS = 256
_PIECE = 256 * 1024


@dataclass(frozen=True, slots=True)
class Fault:
    """One rule of a fault schedule; every given condition must hold for it to fire."""

    action: str
    method: str | None = None
    #: a substring of the request target (path and query), e.g. ``"partNumber="``
    path_contains: str | None = None
    #: fire only on these matches (1-based, counted among requests this rule matches)
    nth: Collection[int] | None = None
    #: fire with this probability (drawn from the proxy's seeded generator)
    probability: float | None = None
    #: fire at most this many times
    times: int | None = None
    #: for ``delay``, ``stall`` and ``stall_response``
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; one of {sorted(ACTIONS)}")


@dataclass(slots=True)
class RequestRecord:
    method: str
    target: str
    fault: str | None
    #: ``time.perf_counter()`` when the request's head arrived at the proxy
    sent: float = 0.0
    #: when the upstream's answer (its status line and headers) arrived; None: no answer came
    #: from upstream (a fault answered it, or the connection failed)
    answered: float | None = None


@dataclass(slots=True)
class _Request:
    method: str
    target: str
    head: bytes  # request line and headers as they go upstream
    content_length: int | None
    chunked: bool
    expect_continue: bool
    close: bool


_ERRORS = {
    "error500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error.",
    ),
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}


def _header_value(headers: list[tuple[str, str]], name: str) -> str | None:
    for k, v in headers:
        if k.lower() == name:
            return v
    return None


class FaultProxy:
    """A reverse proxy in front of ``upstream`` that injects the scheduled faults."""

    def __init__(
        self,
        upstream: str,
        faults: Iterable[Fault] = (),
        *,
        seed: int = 0,
        drop_request_headers: Iterable[str] = (),
        timeout: float = 30.0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self._drop = {h.lower() for h in drop_request_headers}
        self._timeout = timeout
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._matched: list[int] = []
        self._fired: list[int] = []
        self._rng = random.Random(seed)
        self.set_faults(faults, seed=seed)
        self.requests: deque[RequestRecord] = deque(maxlen=10_000)
        self.fired: Counter[str] = Counter()
        #: requests being handled now (from their arrival until the upstream answers), and the
        #: most at once (to check client concurrency)
        self.in_flight = 0
        self.max_in_flight = 0
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy", daemon=True)
        self._acceptor.start()

    # -- public ---------------------------------------------------------------------------
    def set_faults(self, faults: Iterable[Fault], *, seed: int | None = None) -> None:
        """Replace the schedule (and reset its counters)."""
        with self._lock:
            self._faults = list(faults)
            self._matched = [0] * len(self._faults)
            self._fired = [0] * len(self._faults)
            if seed is not None:
                self._rng = random.Random(seed)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            socks = list(self._sockets)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=5)
        for t in list(self._threads):
            t.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------
    def _pick(self, method: str, target: str) -> tuple[Fault | None, RequestRecord]:
        chosen: Fault | None = None
        sent = time.perf_counter()
        with self._lock:
            for i, f in enumerate(self._faults):
                if f.method is not None and f.method.upper() != method:
                    continue
                if f.path_contains is not None and f.path_contains not in target:
                    continue
                self._matched[i] += 1
                if chosen is not None:
                    continue
                if f.times is not None and self._fired[i] >= f.times:
                    continue
                if f.nth is not None and self._matched[i] not in f.nth:
                    continue
                if f.probability is not None and self._rng.random() >= f.probability:
                    continue
                self._fired[i] += 1
                chosen = f
            record = RequestRecord(method, target, chosen.action if chosen else None, sent)
            self.requests.append(record)
            if chosen is not None:
                self.fired[chosen.action] += 1
        return chosen, record

    def _busy(self, delta: int) -> None:
        with self._lock:
            self.in_flight += delta
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._sockets.add(s)
        if self._closed.is_set():
            s.close()

    def _untrack_close(self, s: socket.socket | None, *, reset: bool = False) -> None:
        if s is None:
            return
        with self._lock:
            self._sockets.discard(s)
        try:
            if reset:  # SO_LINGER 0: close sends RST instead of FIN
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(self._timeout)
            _no_delay(conn)
            self._track(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)
            t.start()

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        reset = False
        try:
            rfile = client.makefile("rb")
            ufile: BinaryIO | None = None
            while not self._closed.is_set():
                req = self._read_request(rfile)
                if req is None:
                    return
                self._busy(+1)
                busy = [True]  # until the upstream's answer arrives (see done())

                def done(busy: list[bool] = busy) -> None:
                    # a request stops counting as in flight when the upstream has answered,
                    # before the answer is relayed: the client may send its next request the
                    # moment it has the last byte, before this thread would count it done
                    if busy[0]:
                        busy[0] = False
                        self._busy(-1)

                try:
                    fault, record = self._pick(req.method, req.target)

                    def answered(record: RequestRecord = record) -> None:
                        record.answered = time.perf_counter()
                        done()

                    action = fault.action if fault else None
                    if fault is not None and action in _ERRORS:
                        if not req.expect_continue:
                            self._relay_body(rfile, req, None)
                        client.sendall(_error_response(action))
                        return
                    if fault is not None and action == "reset_request":
                        if req.expect_continue:
                            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                        self._relay_body(rfile, req, None, half=True)
                        reset = True
                        return
                    if fault is not None and action == "stall":
                        if req.expect_continue:
                            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                        self._relay_body(rfile, req, None)
                        self._closed.wait(fault.seconds)
                        return
                    if fault is not None and action == "delay":
                        self._closed.wait(fault.seconds)
                    if upstream is None:
                        upstream = socket.create_connection(self.upstream, timeout=self._timeout)
                        _no_delay(upstream)
                        self._track(upstream)
                        ufile = upstream.makefile("rb")
                    assert ufile is not None
                    upstream.sendall(req.head)
                    if req.expect_continue:
                        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    self._relay_body(rfile, req, upstream.sendall)
                    keep = self._relay_response(
                        ufile,
                        client,
                        req,
                        cut=action in ("reset_response", "stall_response") and fault is not None,
                        on_head=answered,
                    )
                    if keep is None:  # cut mid-body
                        if fault is not None and action == "stall_response":
                            self._closed.wait(fault.seconds)
                        reset = True
                        return
                    if not keep or req.close:
                        return
                finally:
                    done()
        except (OSError, ValueError):
            return
        finally:
            self._untrack_close(upstream)
            self._untrack_close(client, reset=reset)

    def _read_head(self, f: BinaryIO) -> tuple[str, list[tuple[str, str]]] | None:
        line = f.readline(_MAX_LINE)
        while line in (b"\r\n", b"\n"):  # tolerate stray CRLF between requests
            line = f.readline(_MAX_LINE)
        if not line:
            return None
        if not line.endswith(b"\n"):
            raise ValueError("request line too long")
        headers: list[tuple[str, str]] = []
        for _ in range(_MAX_HEADERS):
            h = f.readline(_MAX_LINE)
            if h in (b"\r\n", b"\n", b""):
                return line.decode("latin-1").rstrip("\r\n"), headers
            name, _, value = h.decode("latin-1").partition(":")
            headers.append((name.strip(), value.strip()))
        raise ValueError("too many headers")

    def _read_request(self, f: BinaryIO) -> _Request | None:
        head = self._read_head(f)
        if head is None:
            return None
        line, headers = head
        method, target, version = line.split(" ", 2)
        expect = (_header_value(headers, "expect") or "").lower() == "100-continue"
        out = [f"{method} {target} {version}"]
        out += [f"{k}: {v}" for k, v in headers if k.lower() not in self._drop | {"expect"}]
        te = (_header_value(headers, "transfer-encoding") or "").lower()
        cl = _header_value(headers, "content-length")
        conn = (_header_value(headers, "connection") or "").lower()
        return _Request(
            method=method.upper(),
            target=target,
            head=("\r\n".join(out) + "\r\n\r\n").encode("latin-1"),
            content_length=int(cl) if cl is not None and "chunked" not in te else None,
            chunked="chunked" in te,
            expect_continue=expect,
            close=conn == "close" or version == "HTTP/1.0",
        )

    def _relay_body(
        self,
        src: BinaryIO,
        req: _Request,
        send: Callable[[bytes], object] | None,
        *,
        half: bool = False,
    ) -> None:
        if req.chunked:
            _copy_chunked(src, send, stop_after_first=half)
        elif req.content_length:
            n = req.content_length // 2 if half else req.content_length
            _copy_exact(src, send, n)

    def _relay_response(
        self,
        ufile: BinaryIO,
        client: socket.socket,
        req: _Request,
        *,
        cut: bool,
        on_head: Callable[[], None],
    ) -> bool | None:
        """Relay one response; True to keep the connection, None when cut mid-body.
        ``on_head``: called once the upstream's final status line and headers are read."""
        while True:
            head = self._read_head(ufile)
            if head is None:
                raise ValueError("upstream closed before responding")
            line, headers = head
            status = int(line.split(" ", 2)[1])
            raw = ("\r\n".join([line, *(f"{k}: {v}" for k, v in headers)]) + "\r\n\r\n").encode(
                "latin-1"
            )
            if 100 <= status < 200:
                continue  # we answered 100 Continue ourselves
            break
        on_head()
        client.sendall(raw)
        te = (_header_value(headers, "transfer-encoding") or "").lower()
        cl = _header_value(headers, "content-length")
        conn = (_header_value(headers, "connection") or "").lower()
        if req.method == "HEAD" or status in (204, 304):
            return None if cut else conn != "close"
        if "chunked" in te:
            _copy_chunked(ufile, client.sendall, stop_after_first=cut)
        elif cl is not None:
            n = int(cl)
            _copy_exact(ufile, client.sendall, n // 2 if cut else n)
        else:  # delimited by close
            while piece := ufile.read(_PIECE):
                client.sendall(piece)
            return False
        return None if cut else conn != "close"


def _no_delay(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # not TCP: nothing to do
        pass


def _copy_exact(src: BinaryIO, send: Callable[[bytes], object] | None, n: int) -> None:
    while n > 0:
        piece = src.read(min(n, _PIECE))
        if not piece:
            raise ValueError("connection closed mid-body")
        if send is not None:
            send(piece)
        n -= len(piece)


def _copy_chunked(
    src: BinaryIO, send: Callable[[bytes], object] | None, *, stop_after_first: bool = False
) -> None:
    while True:
        line = src.readline(_MAX_LINE)
        if not line.endswith(b"\n"):
            raise ValueError("bad chunk header")
        if send is not None:
            send(line)
        size = int(line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers (aws-chunked checksums may ride here), then CRLF
                trailer = src.readline(_MAX_LINE)
                if send is not None:
                    send(trailer)
                if trailer in (b"\r\n", b"\n", b""):
                    return
        if stop_after_first:
            _copy_exact(src, send, size // 2)
            return
        _copy_exact(src, send, size + 2)


def _error_response(action: str) -> bytes:
    status, reason, code, message = _ERRORS[action]
    rid = secrets.token_hex(8).upper()
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<RequestId>{rid}</RequestId><HostId>faultproxy</HostId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {rid}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    return head + body
