"""The object-store writer's request pattern (issue 15, S3 save): however large the writes it
is given, an upload keeps at most ``max_concurrency`` parts in flight, each a whole part.
obstore's writer waits for a free slot once per write and then sends every part that write
completes: handed a chunk of many parts in one write, it sent them all on one free slot (on
SeaweedFS, 15 parts of 8 MiB in flight instead of 8, sent and finished in bursts), costing the
server more and the upload time. The writer now hands obstore one part per write."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("obstore", reason="the object-store backend needs obstore")

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.objstore import ObjectStoreBackend
from tierckpt.backends.objstore import _writer as writer_mod
from tierckpt.testing.backends import payload
from tierckpt.testing.faultproxy import Fault, FaultProxy
from tierckpt.testing.s3servers import S3Server

MiB = 2**20
PART = 5 * MiB
CONCURRENCY = 2
BucketFactory = Callable[[S3Server], str]
#: generous: on a loaded machine a part may take seconds
WAIT_S = 120
#: each part is held back this long by the proxy, so that parts sent together overlap there
DELAY = [Fault("delay", method="PUT", path_contains="partNumber=", seconds=0.4)]


class _Recorder:
    """obstore's writer, recording where each write it is handed starts and ends."""

    def __init__(self, file: Any, spans: list[tuple[int, int]]) -> None:
        self._file, self._spans, self._at = file, spans, 0

    def write(self, data: Any) -> Any:
        n = len(memoryview(data).cast("B"))
        self._spans.append((self._at, self._at + n))
        self._at += n
        return self._file.write(data)

    def close(self) -> Any:
        return self._file.close()

    def __exit__(self, *exc: object) -> Any:
        return self._file.__exit__(*exc)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(start, end)`` of every write handed to obstore's writers (in object offsets)."""
    out: list[tuple[int, int]] = []
    open_ = writer_mod._Writer._open
    monkeypatch.setattr(writer_mod._Writer, "_open", lambda self: _Recorder(open_(self), out))
    return out


def within_parts(spans: list[tuple[int, int]], part: int) -> list[tuple[int, int]]:
    """The writes that span more than one part (none: obstore sends one part per write)."""
    return [(a, b) for a, b in spans if b > a and a // part != (b - 1) // part]


def parts_put(proxy: FaultProxy) -> int:
    return sum(1 for r in proxy.requests if r.method == "PUT" and "partNumber=" in r.target)


def most_parts_in_flight(proxy: FaultProxy) -> int:
    """The most part uploads the proxy held at once (from each one's send to its answer)."""
    events = sorted(
        (t, step)
        for r in proxy.requests
        if r.method == "PUT" and "partNumber=" in r.target
        for t, step in ((r.sent, 1), (r.answered if r.answered is not None else 1e18, -1))
    )
    most = now = 0
    for _t, step in events:
        now += step
        most = max(most, now)
    return most


def make(endpoint: str, bucket: str) -> ObjectStoreBackend:
    return ObjectStoreBackend(
        f"s3://{bucket}/pattern",
        endpoint_url=endpoint,
        part_size=PART,
        max_concurrency=CONCURRENCY,
    )


@pytest.mark.s3
@pytest.mark.parametrize("lent", [True, False], ids=["write_lent", "write"])
def test_one_write_of_many_parts_keeps_at_most_max_concurrency_parts_in_flight(
    moto_server: S3Server, s3_bucket: BucketFactory, spans: list[tuple[int, int]], lent: bool
) -> None:
    bucket = s3_bucket(moto_server)
    data = payload(8 * PART + 123, seed=11)
    with FaultProxy(moto_server.endpoint_url, DELAY) as proxy:
        backend = make(proxy.endpoint_url, bucket)
        released = threading.Event()
        w = backend.open_writer("obj")
        if lent:
            w.write_lent(0, bytearray(data), released.set)  # type: ignore[attr-defined]
        else:
            w.write(0, data)
            released.set()
        w.commit()
        assert released.wait(WAIT_S)
        # the other requests (create, complete) come before and after the parts
        assert proxy.max_in_flight <= CONCURRENCY, proxy.max_in_flight
        assert parts_put(proxy) == 9  # eight whole parts and the tail
        assert within_parts(spans, PART) == []
        assert backend.get("obj") == data
        backend.close()


@pytest.mark.s3
def test_writes_that_straddle_parts_still_send_whole_parts_within_the_limit(
    moto_server: S3Server, s3_bucket: BucketFactory, spans: list[tuple[int, int]]
) -> None:
    """Writes of 4.5 parts each, lent and copied in turn (lent: the whole parts they complete;
    copied: the tails): every part but the last is whole and never more than
    ``max_concurrency`` are in flight."""
    bucket = s3_bucket(moto_server)
    pieces = [payload(9 * PART // 2, seed=20 + i) for i in range(4)]
    with FaultProxy(moto_server.endpoint_url, DELAY) as proxy:
        backend = make(proxy.endpoint_url, bucket)
        w = backend.open_writer("obj")
        events = []
        at = 0
        for i, piece in enumerate(pieces):
            done = threading.Event()
            events.append(done)
            if i % 2:
                w.write(at, piece)
                done.set()
            else:
                w.write_lent(at, bytearray(piece), done.set)  # type: ignore[attr-defined]
            at += len(piece)
        w.commit()
        assert all(e.wait(WAIT_S) for e in events)
        assert proxy.max_in_flight <= CONCURRENCY, proxy.max_in_flight
        assert parts_put(proxy) == 18
        assert within_parts(spans, PART) == []
        assert backend.get("obj") == b"".join(pieces)
        backend.close()


@pytest.mark.s3
def test_an_s3_tier_saving_large_chunks_keeps_its_parts_in_flight_within_the_limit(
    moto_server: S3Server, s3_bucket: BucketFactory, spans: list[tuple[int, int]]
) -> None:
    """A tier lends its chunk to the writer in writes of several parts: still one part in
    flight for ``max_concurrency=1`` (the first save's listing and lease take run beside each
    other, before the parts: counted are the parts)."""
    bucket = s3_bucket(moto_server)
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(6 * MiB // 4, generator=gen) for i in range(5)}
    with FaultProxy(moto_server.endpoint_url, DELAY) as proxy:
        tier = S3Tier(
            f"s3://{bucket}/ck",
            endpoint_url=proxy.endpoint_url,
            codec="raw",
            part_size=PART,
            max_concurrency=1,
            keep_last=None,
        )
        with Checkpointer([tier], host_buffer_bytes=64 * MiB, chunk_bytes=32 * MiB) as ck:
            ck.save(state, step=1).result(timeout=WAIT_S)
            parts = parts_put(proxy)
            most = most_parts_in_flight(proxy)
            got = ck.load(step=1)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert parts >= 6
    assert most <= 1, most
    assert within_parts(spans, PART) == []
