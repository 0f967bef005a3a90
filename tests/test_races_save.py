"""Save paths write, checksum and upload only final bytes, and reuse memory only once done.

The class of bug: a consumer (a checksum, a write, a PUT, the caller's next training step)
touches bytes before the producer that fills them has finished, or a producer reuses memory a
consumer still reads. It only shows when one side is slower than usual, so each test holds one
side back on purpose (a sleep or an event, injected with monkeypatch; a fault proxy that fails
the first attempt of a part) and checks the bytes that were committed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_same, tensors_in

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import _LocalWriter
from tierckpt.backends.objstore._backend import ObjectStoreBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.pipeline import _capture
from tierckpt.testing.faultproxy import Fault, FaultProxy

HOLD = 0.1


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(1 << 20, generator=g),  # 4 MiB: several chunks
        "b": torch.randn(4096, generator=g),
        "opt": {"m": torch.randn(300_000, generator=g), "step": torch.tensor(seed)},
    }


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    return {k: _clone(v) for k, v in x.items()}


def _hold_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every capture copy into the arena waits ``HOLD`` first; returns the list it appends to
    once per copy (a test checks the copies really were held)."""
    copies: list[int] = []
    original = _capture.copy_chunk

    def slow_copy(*a: Any, **kw: Any) -> Any:
        time.sleep(HOLD)
        copies.append(1)
        return original(*a, **kw)

    monkeypatch.setattr(_capture, "copy_chunk", slow_copy)
    return copies


def test_state_may_change_once_wait_captured_returns_even_when_the_copy_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lazy capture: the caller changes its tensors as soon as ``wait_captured()`` returns
    (the next training step). With every chunk's copy into the arena held back, the
    checkpoint must hold the values at ``save()``, and its checksums (verified by the load)
    must be those of the copied bytes."""
    copies = _hold_copies(monkeypatch)
    state = _state(1)
    expected = _clone(state)
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=1 << 20) as ck:
        h = ck.save(state, step=1)
        h.wait_captured(timeout=60)
        for t in tensors_in(state):
            t.fill_(-3)  # the next step
        h.wait(timeout=60)
        assert len(copies) >= 5, "the copies were not held back: the test checks nothing"
        assert_same(expected, ck.load(step=1))


def test_arena_slot_is_not_reused_before_a_slow_writer_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back-to-back saves through a small arena while every write to the disk is held back:
    a slot handed to the next save's copy before the writer finished with it would put the
    next step's bytes (or a half-copied chunk) in this step's file."""
    original = _LocalWriter.write
    held: list[int] = []

    def slow_write(self: Any, offset: int, data: Any) -> None:
        time.sleep(HOLD)
        held.append(1)
        original(self, offset, data)

    monkeypatch.setattr(_LocalWriter, "write", slow_write)
    states = {s: _state(s) for s in (1, 2, 3)}
    # an arena of a few 1 MiB slots: the next save waits for slots the writer gives back
    with Checkpointer(
        [LocalTier(tmp_path, keep_last=None)], chunk_bytes=1 << 20, host_buffer_bytes=4 << 20
    ) as ck:
        handles = []
        live = _clone(states[1])
        for s in (1, 2, 3):
            for t, v in zip(tensors_in(live), tensors_in(states[s]), strict=True):
                t.copy_(v)  # the training state moves on in place
            h = ck.save(live, step=s)
            h.wait_captured(timeout=120)
            handles.append(h)
        for h in handles:
            h.wait(timeout=120)
        assert held, "the writes were not held back"
        for s in (1, 2, 3):
            assert_same(states[s], ck.load(step=s))


# -- multipart uploads: a retried part sends the bytes it was cut from ---------------------


def _make(driver: str, endpoint: str, bucket: str) -> Any:
    opts: dict[str, Any] = {
        "endpoint_url": endpoint,
        "part_size": 5 << 20,
        "max_concurrency": 2,
        "max_attempts": 4,
        "read_timeout": 20,
    }
    cls = S3Backend if driver == "boto3" else ObjectStoreBackend
    return cls(f"s3://{bucket}/races", **opts)


@pytest.mark.s3
@pytest.mark.parametrize("driver", ["boto3", "obstore"])
def test_a_retried_part_sends_the_same_bytes(moto_server: Any, s3_bucket: Any, driver: str) -> None:
    """A writer whose caller reuses its buffer as soon as ``write()`` returns, while the
    first attempt of several parts fails (500, and delayed so that later writes come in
    meanwhile): the object must be exactly what was written."""
    bucket = s3_bucket(moto_server)
    size = 5 << 20
    n_parts = 5
    expected = bytearray()
    faults = [
        Fault("delay", method="PUT", path_contains="partNumber=1", nth=[1], seconds=0.5),
        Fault("error500", method="PUT", path_contains="partNumber=2", nth=[1]),
        Fault("error500", method="PUT", path_contains="partNumber=4", nth=[1]),
    ]
    with FaultProxy(moto_server.endpoint_url, faults) as proxy:
        backend = _make(driver, proxy.endpoint_url, bucket)
        w = backend.open_writer("obj")
        piece = bytearray(1 << 20)
        view = memoryview(piece)
        pos = 0
        for i in range(n_parts * size // len(piece) + 1):
            piece[:] = bytes([i % 251]) * len(piece)
            piece[:8] = i.to_bytes(8, "little")
            expected += piece
            w.write(pos, view)
            pos += len(piece)
            piece[:] = b"\xee" * len(piece)  # the caller reuses its memory at once
        w.commit()
        assert proxy.fired["error500"] >= 2, proxy.fired
    got = moto_server.admin.get_object(Bucket=bucket, Key="races/obj")["Body"].read()
    assert len(got) == len(expected)
    assert got == bytes(expected)


def test_team_copy_returns_only_after_every_helper_part(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CopyTeam.run`` returns after every part, the slow helpers' ones included (the slot
    is then released or handed to the writers)."""
    from tierckpt.pipeline._copyteam import CopyTeam

    done: list[int] = []
    gate = threading.Event()

    def part(i: int) -> Any:
        def fn() -> None:
            if i:
                gate.wait(2.0)
                time.sleep(0.05)
            done.append(i)

        return fn

    with CopyTeam(3) as team:
        threading.Timer(0.2, gate.set).start()
        team.run([part(i) for i in range(4)])
        assert sorted(done) == [0, 1, 2, 3]


def test_guard_keeps_the_state_at_save_while_the_capture_is_held_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``guard(optimizer, model)``, training goes on right after ``save()`` (no
    ``wait_captured``): the next forward pass writes the BatchNorm buffers, the optimizer step
    the parameters and their state. With every capture copy held back, the checkpoint must
    still be the state at ``save()``: buffers copied in ``save()`` itself, the step held by
    the guard until the lazy copies are done."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.BatchNorm1d(512), torch.nn.Linear(512, 512)
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def train_step() -> None:
        opt.zero_grad()
        model(torch.randn(32, 64)).square().mean().backward()
        opt.step()

    train_step()
    with Checkpointer([LocalTier(tmp_path, keep_last=None)], chunk_bytes=256 << 10) as ck:
        ck.guard(opt, model)
        copies = _hold_copies(monkeypatch)
        state = {"model": model.state_dict(), "opt": opt.state_dict()}
        expected = {"model": _clone(dict(state["model"])), "opt_state": _clone_opt(opt)}
        h = ck.save(state, step=1)
        train_step()  # forward writes buffers at once; the step waits for the capture
        train_step()
        h.wait(timeout=120)
        assert len(copies) >= 4, "the copies were not held back: the test checks nothing"
        back = ck.load(step=1)
    for k, v in expected["model"].items():
        assert torch.equal(back["model"][k], v), k
    for pid, st in expected["opt_state"].items():
        for name, v in st.items():
            assert torch.equal(back["opt"]["state"][pid][name], v), (pid, name)


def _clone_opt(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    sd = opt.state_dict()["state"]
    return {pid: {k: v.clone() for k, v in st.items()} for pid, st in sd.items()}
