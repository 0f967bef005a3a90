"""Client CPU of a save that is waited for (issue 15, S3 save): who waits for durability
(``h.wait()``, ``h.result()``) waits for every chunk's checksum too, so the capture takes each
chunk's checksum as it copies it (no read-back); who waits for the capture alone
(``h.wait_captured()``, a blocking save) still gets the copy without checksums on its path.
Tested by behaviour: which checksums are read back, and loads that verify every chunk."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same

import tierckpt.pipeline._capture as pipeline_mod
from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt import capture as capture_mod
from tierckpt.testing.s3servers import S3Server

BucketFactory = Callable[[S3Server], str]
CHUNK = 256 << 10
#: generous: a loaded machine
WAIT_S = 120


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(300_001, generator=g),
        "b": torch.randint(0, 256, (77_777,), dtype=torch.uint8, generator=g),
        "h": torch.randn(50_000, generator=g).to(torch.bfloat16),
        "step": seed,
    }


def _n_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def _read_backs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the chunks checksummed after their copy (read back from the arena)."""
    sizes: list[int] = []
    real = pipeline_mod.checksum

    def counting(data: Any) -> str:
        sizes.append(len(memoryview(data).cast("B")))
        return real(data)

    monkeypatch.setattr(pipeline_mod, "checksum", counting)
    return sizes


class _Waited(threading.Event):
    """A tier's done-event that says when someone waits on it."""

    def __init__(self, waiting: threading.Event) -> None:
        super().__init__()
        self._waiting = waiting

    def wait(self, timeout: float | None = None) -> bool:
        self._waiting.set()
        return super().wait(timeout)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Copies wait for this event; a :class:`_Waited` or the test sets it."""
    gate = threading.Event()
    real = pipeline_mod.copy_chunk

    def after_gate(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_mod, "copy_chunk", after_gate)
    return gate


def _save_with_waiter(
    ck: Checkpointer, state: dict[str, Any], step: int, how: str, gate: threading.Event
) -> None:
    """Save ``state``; a thread waits (``how``) before the first chunk is copied: the copies
    start once it is waiting; then wait for the commit."""
    h = ck.save(state, step=step)
    if how == "wait":
        h._tier_events = {t: _Waited(gate) for t in h._tier_events}
        target: Callable[[], object] = lambda: h.wait(timeout=WAIT_S)  # noqa: E731
    else:
        real = h.capture_awaited

        class _Says(threading.Event):
            def set(self) -> None:
                super().set()
                real.set()
                gate.set()

        h.capture_awaited = _Says()
        target = lambda: h.wait_captured(WAIT_S)  # noqa: E731
    waiter = threading.Thread(target=target)
    waiter.start()
    assert gate.wait(WAIT_S)
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    h.wait(timeout=WAIT_S)


def test_save_waited_for_with_wait_takes_checksums_while_copying_local(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gated: threading.Event
) -> None:
    """``h.wait()`` is waiting before the first copy: no chunk is read back for its checksum
    (each is hashed as it is copied), and the load verifies every chunk, bit for bit."""
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", 64 << 10)
    sums = _read_backs(monkeypatch)
    state = _state(1)
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=CHUNK) as ck:
        _save_with_waiter(ck, state, 1, "wait", gated)
        assert sums == []
        assert_same(state, ck.load())  # a wrong checksum fails the load


def test_wait_captured_still_leaves_checksums_until_after_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gated: threading.Event
) -> None:
    """``h.wait_captured()`` (training waits for the copy alone) is waiting before the first
    copy: nothing is hashed while copying; every chunk is read back once for its checksum."""
    sums = _read_backs(monkeypatch)
    state = _state(2)
    with Checkpointer([LocalTier(tmp_path)], chunk_bytes=CHUNK) as ck:
        _save_with_waiter(ck, state, 1, "wait_captured", gated)
        assert len(sums) >= 3  # a chunk per dtype at least
        assert sum(sums) == _n_bytes(state)  # every byte read back once, after its copy
        assert_same(state, ck.load())


@pytest.mark.s3
def test_s3_save_waited_for_with_result_hashes_while_copying_and_loads_verify(
    seaweedfs_server: S3Server,
    s3_bucket: BucketFactory,
    monkeypatch: pytest.MonkeyPatch,
    gated: threading.Event,
) -> None:
    """An S3 save waited for with ``h.wait()`` (what ``h.result()`` does): no read-back
    checksums; a second save of changed bytes into the same arena slots commits its own
    checksums (no stale digest), and both steps load verified and bit-exact."""
    pytest.importorskip("obstore", reason="the S3 tier's default driver needs obstore")
    monkeypatch.setattr(capture_mod, "HASH_BLOCK_BYTES", 64 << 10)
    bucket = s3_bucket(seaweedfs_server)
    sums = _read_backs(monkeypatch)
    tier = S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=seaweedfs_server.endpoint_url,
        codec="raw",
        keep_last=None,
    )
    one, two = _state(3), _state(4)
    with Checkpointer([tier], chunk_bytes=CHUNK, host_buffer_bytes=16 << 20) as ck:
        _save_with_waiter(ck, one, 1, "wait", gated)
        _save_with_waiter(ck, two, 2, "wait", gated)
        assert sums == []
        assert_same(one, ck.load(step=1))
        assert_same(two, ck.load(step=2))
