"""The direct ranged reads over TLS (every AWS endpoint is ``https://``): the body is decrypted
straight into the caller's memory and the signature holds through a TLS front (a small
terminator on 127.0.0.1 with a self-signed certificate, in front of SeaweedFS, which checks
signatures); a certificate the machine does not trust is a failure before the body, which
leaves the read to obstore and turns the direct reads off."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytest.importorskip("obstore", reason="the object-store backend needs obstore")
pytest.importorskip("cryptography", reason="needs cryptography (moto brings it)")

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.objstore._direct import DirectReads, SigV4, Unusable
from tierckpt.testing.backends import payload, write_object
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
BucketFactory = Callable[[S3Server], str]


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    except (OSError, ssl.SSLError):
        pass
    finally:
        dst.close()


@pytest.fixture
def tls_front(seaweedfs_server: S3Server, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """``(https endpoint, certificate)``: TLS terminated on 127.0.0.1, bytes passed on to
    SeaweedFS as they are (the Host header, and so the signature, unchanged). One asyncio loop
    on a thread: an SSL connection is never read and written from two threads at once (which
    OpenSSL does not allow, and which once cut a body short under load)."""
    cert, key = _self_signed(tmp_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    up = urlsplit(seaweedfs_server.endpoint_url)
    loop = asyncio.new_event_loop()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(up.hostname, up.port)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = loop.run_until_complete(
        asyncio.start_server(relay, "127.0.0.1", 0, ssl=ctx, ssl_handshake_timeout=30)
    )
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{port}", cert
    loop.call_soon_threadsafe(server.close)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _direct(endpoint: str, bucket: str, server: S3Server) -> DirectReads:
    creds = {"access_key_id": server.access_key, "secret_access_key": server.secret_key}
    return DirectReads(
        endpoint,
        bucket,
        SigV4(server.region, lambda: creds),
        connect_timeout=5,
        read_timeout=10,
        pool_size=2,
    )


@pytest.mark.s3
def test_direct_reads_over_tls(
    seaweedfs_server: S3Server,
    s3_bucket: BucketFactory,
    tls_front: tuple[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the front's certificate trusted (``SSL_CERT_FILE``), a part spread over pieces
    lands byte for byte, twice over one kept connection; untrusted, the request fails before
    its body with ``Unusable(disable=True)``."""
    endpoint, cert = tls_front
    bucket = s3_bucket(seaweedfs_server)
    plain = ObjectStoreBackend(f"s3://{bucket}/run", endpoint_url=seaweedfs_server.endpoint_url)
    data = payload(6 * MiB, seed=91)
    write_object(plain, "obj", data, [6 * MiB])
    plain.close()

    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    direct = _direct(endpoint, bucket, seaweedfs_server)
    for start, sizes in ((0, [7, 3 * MiB, 100_001]), (4 * MiB + 3, [1, MiB, 12_345])):
        bufs = [bytearray(n) for n in sizes]
        direct.read("run/obj", start, [memoryview(b) for b in bufs], "where")
        assert b"".join(bufs) == data[start : start + sum(sizes)]
    assert len(direct._pool) == 1 and isinstance(direct._pool[0].sock, ssl.SSLSocket)
    direct.close()

    monkeypatch.delenv("SSL_CERT_FILE")
    untrusting = _direct(endpoint, bucket, seaweedfs_server)
    with pytest.raises(Unusable) as err:
        untrusting.read("run/obj", 0, [memoryview(bytearray(10))], "where")
    assert err.value.disable and "TLS" in str(err.value)
