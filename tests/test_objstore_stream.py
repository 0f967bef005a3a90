"""A scatter read through obstore streams each ranged GET's body into place as it arrives
(``tierckpt.backends.objstore._reads.stream_into``), never joining a part into a buffer of
its own first (the direct reads of ``s3://``, tests/test_objstore_direct.py, are off here). On a real S3 server (moto on 127.0.0.1), through the fault proxy where a
response must be cut."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

pytest.importorskip(
    "obstore", reason="the object-store backend needs obstore (pip install obstore)"
)

import obstore

from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.errors import FormatError
from tierckpt.testing.backends import payload, write_object
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
BucketFactory = Callable[[S3Server], str]

#: piece sizes of one scatter read: tiny and large, crossing the 5 MiB part and the HTTP
#: client's read sizes at odd places
SIZES = [1, 7, 4096, 3 * MiB + 5, 100_003, 2 * MiB - 1, 1, 4 * MiB + 17, 12_345]
#: the same within one part: what a load's segment reads with one ranged GET
ONE_PART = [1, 7, 4096, 3 * MiB + 5, 100_003, MiB - 1, 1, 12_345]


@pytest.fixture(autouse=True)
def _through_obstore(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of obstore's streamed read (``gs://``, ``az://``, and every attempt the
    direct reads leave to obstore): on ``s3://`` the direct reads would serve them instead."""
    monkeypatch.setenv("TIERCKPT_S3_DIRECT_READS", "0")


def _backend(server: S3Server, bucket: str, endpoint: str | None = None) -> ObjectStoreBackend:
    return ObjectStoreBackend(
        f"s3://{bucket}/run",
        endpoint_url=endpoint or server.endpoint_url,
        part_size=PART,
        max_concurrency=4,
        read_timeout=20,
    )


def _pieces(sizes: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    bufs = [bytearray(n) for n in sizes]
    return bufs, [memoryview(b) for b in bufs]


@pytest.mark.s3
def test_scatter_read_streams_a_part_into_its_pieces(
    moto_server: S3Server, s3_bucket: BucketFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load reads each part of a raw chunk with one ``read_into_pieces`` (one ranged GET
    spread over the storages it covers): every byte lands in its piece, and the part goes
    neither through ``obstore.get_range`` nor ``get_ranges``, which join the whole body into
    one fresh buffer before the copy (a page-faulted, zeroed 8 MiB per part of a load)."""
    backend = _backend(moto_server, s3_bucket(moto_server))
    data = payload(3 * PART, seed=71)
    write_object(backend, "obj", data, [PART] * 3)

    def joined(*_a: object, **_k: object) -> None:
        raise AssertionError("a scatter read joined a part's body before copying it")

    monkeypatch.setattr(obstore, "get_range", joined)
    monkeypatch.setattr(obstore, "get_ranges", joined)
    for offset in (0, PART + 99):
        bufs, views = _pieces(ONE_PART)
        backend.read_into_pieces("obj", offset, views)
        assert b"".join(bufs) == data[offset : offset + sum(ONE_PART)]
    backend.close()


@pytest.mark.s3
def test_scatter_read_over_several_parts(moto_server: S3Server, s3_bucket: BucketFactory) -> None:
    """Pieces over several parts (read in batches of ranged GETs) land byte for byte."""
    backend = _backend(moto_server, s3_bucket(moto_server))
    offset = 12_345
    data = payload(offset + sum(SIZES) + 999, seed=74)
    write_object(backend, "obj", data, [PART, len(data) - PART])
    bufs, views = _pieces(SIZES)
    backend.read_into_pieces("obj", offset, views)
    assert b"".join(bufs) == data[offset : offset + sum(SIZES)]
    backend.close()


@pytest.mark.s3
def test_a_body_cut_midway_is_read_again_whole(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """A ranged GET whose answer is reset halfway through its body has already written part
    of its pieces: it is asked again, and the pieces end up holding exactly the object's
    bytes."""
    bucket = s3_bucket(moto_server)
    data = payload(3 * PART, seed=72)
    write_object(_backend(moto_server, bucket), "obj", data, [PART] * 3)
    faults = [Fault("reset_response", method="GET", path_contains="/run/obj", times=2)]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = _backend(moto_server, bucket, proxy.endpoint_url)
        for sizes in (ONE_PART, SIZES):  # one streamed GET; a batch of them
            bufs, views = _pieces(sizes)
            backend.read_into_pieces("obj", 100, views)
            assert b"".join(bufs) == data[100 : 100 + sum(sizes)]
        assert proxy.fired["reset_response"] == 2
        backend.close()


@pytest.mark.s3
def test_a_read_past_the_end_is_refused_and_writes_nothing_beyond(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """The object ends inside the last piece: ``FormatError`` naming the end, and memory
    next to the pieces (the same buffer, past the last view) is never written."""
    backend = _backend(moto_server, s3_bucket(moto_server))
    data = payload(2 * PART, seed=73)
    write_object(backend, "obj", data, [PART, PART])
    for offset, sizes in ((2 * PART - 1000, [500, 600]), (0, [PART, PART + 100])):
        # 100 bytes past the object's end: in one streamed GET; in a batch of them
        n = sum(sizes)
        whole = bytearray(b"\xa5" * (n + 4096))
        mv = memoryview(whole)
        views = [mv[: sizes[0]], mv[sizes[0] : n]]
        with pytest.raises(FormatError, match="past its end"):
            backend.read_into_pieces("obj", offset, views)
        assert whole[n:] == b"\xa5" * 4096
    backend.close()


@pytest.mark.s3
def test_a_body_that_stalls_midway_is_read_again_after_the_read_timeout(
    moto_server: S3Server, s3_bucket: BucketFactory
) -> None:
    """A store that sends the headers and half a ranged GET's body, then nothing (a hang,
    not an error): the client's read timeout ends the wait and the part is read again, so a
    load is held up by the timeout, not forever."""
    bucket = s3_bucket(moto_server)
    data = payload(2 * PART, seed=75)
    write_object(_backend(moto_server, bucket), "obj", data, [PART, PART])
    faults = [Fault("stall_response", method="GET", path_contains="/run/obj", times=1, seconds=30)]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = ObjectStoreBackend(
            f"s3://{bucket}/run",
            endpoint_url=proxy.endpoint_url,
            part_size=PART,
            max_concurrency=4,
            read_timeout=2,
        )
        bufs, views = _pieces(ONE_PART)
        t0 = time.monotonic()
        backend.read_into_pieces("obj", 7, views)
        waited = time.monotonic() - t0
        assert proxy.fired["stall_response"] == 1
        backend.close()
    assert b"".join(bufs) == data[7 : 7 + sum(ONE_PART)]
    assert waited < 25  # the read timeout ended the stall (it would last 30 s)


class _FakeResult:
    def __init__(self, body: bytes, cuts: list[int], kind: type) -> None:
        self._pieces = [kind(body[a:b]) for a, b in zip([0, *cuts], [*cuts, len(body)])]

    def stream(self, min_chunk_size: int = 1) -> object:
        return iter(self._pieces)


class _FakeObstore:
    def __init__(self, result: _FakeResult) -> None:
        self.result = result

    def get(self, store: object, key: str, options: object = None) -> _FakeResult:
        return self.result


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_stream_pieces_land_across_every_boundary(kind: type) -> None:
    """Body pieces of every size (tiny, empty, crossing several destination pieces, as
    ``bytes`` or another buffer type a later obstore may yield) land in order in pieces that
    include empty ones; nothing outside them is written."""
    from tierckpt.backends.objstore._reads import stream_into
    from tierckpt.backends.objstore._spread import _Spread

    body = payload(3 * MiB + 333)
    sizes = [0, 5, 0, MiB + 1, 1, 0, 77_777, MiB, 0]
    sizes.append(len(body) - sum(sizes))
    cuts = [1, 2, 9000, 9000, 2 * MiB + 3, 2 * MiB + 4, 3 * MiB]  # one empty body piece
    whole = bytearray(b"\xee" * (len(body) + 64))
    dest = memoryview(whole)[32 : 32 + len(body)]
    views, at = [], 0
    for n in sizes:
        views.append(dest[at : at + n])
        at += n
    stream_into(_FakeObstore(_FakeResult(body, cuts, kind)), None, "k", 0, _Spread(views), "w")
    assert bytes(whole[32 : 32 + len(body)]) == body
    assert whole[:32] == b"\xee" * 32 and whole[32 + len(body) :] == b"\xee" * 32
    with pytest.raises(FormatError, match="got more than asked"):
        short = [memoryview(bytearray(len(body) - 1))]
        stream_into(_FakeObstore(_FakeResult(body, cuts, kind)), None, "k", 0, _Spread(short), "w")
