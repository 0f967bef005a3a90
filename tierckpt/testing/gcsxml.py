"""The writes of Google Cloud Storage's XML API in front of fake-gcs-server, for tests.

obstore (Rust ``object_store``) speaks GCS's XML API: ``PUT /bucket/key`` for an object
(``x-goog-if-generation-match: 0`` for a create-only put), ``POST ?uploads`` /
``PUT ?partNumber=&uploadId=`` / ``POST ?uploadId=`` / ``DELETE ?uploadId=`` for a multipart
upload. fake-gcs-server serves that API's reads (``GET`` with ``Range``, ``HEAD``, ``DELETE``,
``GET /bucket?list-type=2``) but none of its writes: a ``PUT /bucket/key`` is taken for a JSON
upload and refused with ``400 invalid uploadType`` (fsouza/fake-gcs-server#331, open).

:class:`GcsXmlFront` listens on 127.0.0.1 and forwards every request to the emulator as it
came, except those writes, which it carries out through the emulator's JSON API:

- an object ``PUT`` becomes one media upload (``uploadType=media``); the generation
  precondition header becomes ``ifGenerationMatch=``, which the emulator enforces (``412``);
- a multipart upload's parts are held here, by upload id, until ``POST ?uploadId=`` lists
  them (each checked against its ETag), then the object is one media upload of their
  concatenation, so nothing is visible before completion and an aborted upload leaves
  nothing. :meth:`GcsXmlFront.open_uploads` lists the uploads neither completed nor aborted.

So every object lives in the emulator, which answers every read, list and delete itself.
``x-goog-copy-source`` copies are answered ``501`` (tierckpt never copies).
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import re
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

__all__ = ["GcsXmlFront"]

_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "host", "content-length"})
_PART = re.compile(r"<Part>(.*?)</Part>", re.S)
_NUMBER = re.compile(r"<PartNumber>\s*(\d+)\s*</PartNumber>")
_ETAG = re.compile(r"<ETag>([^<]*)</ETag>")


def _xml(tag: str, **fields: str) -> bytes:
    inner = "".join(f"<{k}>{v}</{k}>" for k, v in fields.items())
    return f'<?xml version="1.0" encoding="UTF-8"?><{tag}>{inner}</{tag}>'.encode()


class GcsXmlFront:
    """An HTTP front for fake-gcs-server at ``upstream``; see the module docstring.

    ``endpoint_url`` is what a GCS client's base URL takes; ``close()`` stops it.
    """

    def __init__(self, upstream: str, *, timeout: float = 60.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.timeout = timeout
        self._lock = threading.Lock()
        #: upload id -> (bucket, key, {part number: (etag, bytes)})
        self._uploads: dict[str, tuple[str, str, dict[int, tuple[str, bytes]]]] = {}
        front = self

        class Handler(_Handler):
            owner = front

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="gcsxml", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> GcsXmlFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def open_uploads(self) -> list[str]:
        """``bucket/key`` of each multipart upload neither completed nor aborted, sorted."""
        with self._lock:
            return sorted(f"{b}/{k}" for b, k, _ in self._uploads.values())

    # -- upstream --------------------------------------------------------------------------
    def request(
        self, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=self.timeout)
        try:
            conn.request(method, target, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.getheaders(), resp.read()
        finally:
            conn.close()

    def media_upload(
        self, bucket: str, key: str, body: bytes, generation_match: str | None
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """One JSON-API upload (``uploadType=multipart``: metadata and bytes in one request,
        the kind whose generation precondition fake-gcs-server enforces); a success is answered
        as the XML API does (in headers)."""
        target = f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=multipart"
        if generation_match is not None:
            target += f"&ifGenerationMatch={quote(generation_match, safe='')}"
        boundary = secrets.token_hex(16)
        meta = json.dumps({"name": key}).encode()
        payload = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                meta,
                f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(),
                body,
                f"\r\n--{boundary}--\r\n".encode(),
            ]
        )
        ctype = f"multipart/related; boundary={boundary}"
        status, headers, data = self.request("POST", target, payload, {"Content-Type": ctype})
        if status != 200:
            return status, headers, data
        reply = json.loads(data)
        etag = hashlib.md5(body).hexdigest()
        return (
            200,
            [("ETag", f'"{etag}"'), ("x-goog-generation", str(reply.get("generation", "1")))],
            b"",
        )


class _Handler(BaseHTTPRequestHandler):
    owner: GcsXmlFront
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: tests read failures from the client

    # -- one request -------------------------------------------------------------------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _answer(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.send_response(status)
        length = str(len(body))
        for k, v in headers:
            if k.lower() not in _HOP:
                self.send_header(k, v)
            elif k.lower() == "content-length" and self.command == "HEAD":
                length = v  # a HEAD's length is the object's, not of the (empty) body
        self.send_header("Content-Length", length)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = _xml("Error", Code=code, Message=message)
        self._answer(status, [("Content-Type", "application/xml")], body)

    def _forward(self, body: bytes) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        status, rh, data = self.owner.request(self.command, self.path, body, headers)
        self._answer(status, rh, data)

    def _route(self) -> None:
        body = self._body()
        split = urlsplit(self.path)
        query = parse_qs(split.query, keep_blank_values=True)
        segments = split.path.lstrip("/").split("/", 1)
        if (
            len(segments) != 2
            or not segments[1]
            or split.path.startswith(("/storage/", "/upload/"))
        ):
            self._forward(body)
            return
        bucket, key = unquote(segments[0]), unquote(segments[1])
        method = self.command
        if method == "PUT" and "uploadId" in query:
            self._put_part(query, body)
        elif method == "PUT":
            if self.headers.get("x-goog-copy-source"):
                self._error(501, "NotImplemented", "copies are not served by this front")
                return
            generation = self.headers.get("x-goog-if-generation-match")
            self._answer(*self.owner.media_upload(bucket, key, body, generation))
        elif method == "POST" and "uploads" in query:
            self._initiate(bucket, key)
        elif method == "POST" and "uploadId" in query:
            self._complete(bucket, key, query["uploadId"][0], body)
        elif method == "DELETE" and "uploadId" in query:
            with self.owner._lock:
                self.owner._uploads.pop(query["uploadId"][0], None)
            self._answer(204, [], b"")
        else:
            self._forward(body)

    def _initiate(self, bucket: str, key: str) -> None:
        status = self.owner.request("GET", f"/storage/v1/b/{quote(bucket)}")[0]
        if status != 200:
            self._error(status, "NoSuchBucket", "The specified bucket does not exist.")
            return
        upload_id = secrets.token_hex(12)
        with self.owner._lock:
            self.owner._uploads[upload_id] = (bucket, key, {})
        body = _xml("InitiateMultipartUploadResult", Bucket=bucket, Key=key, UploadId=upload_id)
        self._answer(200, [("Content-Type", "application/xml")], body)

    def _put_part(self, query: dict[str, list[str]], body: bytes) -> None:
        upload_id, number = query["uploadId"][0], int(query.get("partNumber", ["0"])[0])
        etag = f'"{hashlib.md5(body).hexdigest()}"'
        with self.owner._lock:
            upload = self.owner._uploads.get(upload_id)
            if upload is not None:
                upload[2][number] = (etag, body)
        if upload is None:
            self._error(404, "NoSuchUpload", "The requested upload was not found.")
            return
        self._answer(200, [("ETag", etag)], b"")

    def _complete(self, bucket: str, key: str, upload_id: str, body: bytes) -> None:
        listed = []
        for part in _PART.findall(body.decode()):
            found_number, found_etag = _NUMBER.search(part), _ETAG.search(part)
            if found_number and found_etag:
                listed.append((int(found_number.group(1)), found_etag.group(1)))
        if not listed:
            self._error(400, "MalformedXML", f"no parts listed in {body[:200]!r}")
            return
        with self.owner._lock:
            upload = self.owner._uploads.get(upload_id)
            parts = dict(upload[2]) if upload is not None else {}
        if upload is None:
            self._error(404, "NoSuchUpload", "The requested upload was not found.")
            return
        pieces = []
        for number, etag in listed:
            have = parts.get(number)
            if have is None or have[0].strip('"') != etag.strip('"'):
                self._error(400, "InvalidPart", f"part {number} is missing or its ETag differs")
                return
            pieces.append(have[1])
        status, headers, data = self.owner.media_upload(bucket, key, b"".join(pieces), None)
        if status != 200:
            self._answer(status, headers, data)
            return
        with self.owner._lock:
            self.owner._uploads.pop(upload_id, None)
        etag = dict(headers)["ETag"]
        result = _xml("CompleteMultipartUploadResult", Bucket=bucket, Key=key, ETag=etag)
        self._answer(200, [*headers, ("Content-Type", "application/xml")], result)

    def _handle(self) -> None:
        try:
            self._route()
        except (ConnectionError, TimeoutError, OSError) as exc:
            with contextlib.suppress(OSError):
                self._error(502, "BadGateway", f"fake-gcs-server: {exc}")

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _handle
