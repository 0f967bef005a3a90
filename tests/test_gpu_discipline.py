"""Device and stream discipline of the background threads, proven on the CPU with a fake CUDA
surface (tests/fake_cuda.py): every thread selects the state's device, capture queues on its
own stream after the save point, encoders wait on blocking events, the optimizer's step hook
makes the training stream wait instead of the host, one nvCOMP codec per dtype."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import fake_cuda
import pytest
import torch
from fake_cuda import FakeCuda, FakeEvent, FakeStream

from tierckpt import Checkpointer, LocalTier, MemoryTier, devices
from tierckpt.codecs import nvcomp as nvcomp_mod
from tierckpt.codecs.nvcomp import NvcompCodec
from tierckpt.pipeline import _capture as capture_mod


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return fake_cuda.install(monkeypatch)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g), "n": 3}


@pytest.mark.parametrize("index", [1, 3])
def test_capture_and_encoder_threads_select_the_state_device(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, index: int
) -> None:
    fake_cuda.state_on_device(monkeypatch, index)
    tiers = [MemoryTier(namespace=uuid.uuid4().hex), LocalTier(tmp_path, codec="zstd")]
    with Checkpointer(tiers, chunk_bytes=8192, io_threads=2) as ck:
        ck.save(_state(), step=1).wait()
    assert cuda.devices_of("tierckpt-capture") == {index}
    assert cuda.devices_of("tierckpt-encode") == {index}
    # no thread ever selected another device (GPU 0 in particular)
    assert {i for _, i in cuda.set_device} == {index}


def test_plan_layout_runs_on_the_capture_stream_after_the_save_point(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """resolve_conj / resolve_neg (in layout_plan) run with the capture stream current, and
    that stream first waits for the event recorded at save()."""
    fake_cuda.state_on_device(monkeypatch, 2)
    seen: list[list[tuple[str, Any]]] = []
    real = capture_mod.layout_plan

    def layout(*a: Any, **k: Any) -> Any:
        seen.append(list(cuda.current))
        return real(*a, **k)

    monkeypatch.setattr(capture_mod, "layout_plan", layout)
    state = {"z": torch.randn(16, dtype=torch.complex64).conj(), "x": torch.ones(8)}
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        (got,) = ck.load()["z"].unsqueeze(0)
    assert torch.equal(got, state["z"].resolve_conj())
    assert len(seen) == 1 and seen[0], "layout_plan ran with no capture stream current"
    thread, stream = seen[0][-1]
    assert thread == "tierckpt-capture"
    assert isinstance(stream, FakeStream) and stream.device == torch.device("cuda", 2)
    ready = cuda.events[0]  # the event recorded at save()
    assert stream.waited_events and stream.waited_events[0] is ready


def test_one_capture_stream_per_device_reused_across_saves(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_cuda.state_on_device(monkeypatch, 1)
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        for step in range(3):
            ck.save(_state(), step=step).wait()
    capture_streams = [s for s in cuda.streams if s.made_by == "tierckpt-capture"]
    assert len(capture_streams) == 1
    assert len(capture_streams[0].waited_events) == 3  # one save point per save


def test_guard_makes_the_training_stream_wait_without_a_host_wait(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once every copy of a one-device save is queued, optimizer.step() returns at once: the
    training stream waits for the copy events on the GPU. The copies here never finish until
    the gate opens, so a host wait would hang the step."""
    fake_cuda.state_on_device(monkeypatch, 0)
    gate = threading.Event()
    copy_events: list[FakeEvent] = []
    real_copy = capture_mod.copy_chunk

    def copy(*a: Any, **k: Any) -> FakeEvent:
        real_copy(*a, **k)
        ev = FakeEvent(gate)
        copy_events.append(ev)
        return ev

    monkeypatch.setattr(capture_mod, "copy_chunk", copy)
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=4096) as ck:
        ck.guard(opt, model)
        h = ck.save({"model": model.state_dict()}, step=1)
        pipeline = ck._pipeline
        assert pipeline is not None
        for _ in range(3000):  # until capture has queued every copy (it then waits on the gate)
            if pipeline.in_flight() and pipeline.in_flight()[0].queued_events is not None:
                break
            threading.Event().wait(0.01)
        done = threading.Event()

        def step() -> None:
            model(torch.randn(2, 32)).sum().backward()
            opt.step()
            done.set()

        th = threading.Thread(target=step)
        th.start()
        stepped = done.wait(20)
        gate.set()
        th.join()
        h.wait()
        assert stepped, "optimizer.step() waited on the host for the copies"
        assert not h.blocked_seconds or h.blocked_seconds < 20
    assert copy_events
    assert [ev for _, ev in cuda.stream_waits] == copy_events
    assert {d for d, _ in cuda.stream_waits} == {torch.device("cuda", 0)}
    # encoders and capture wait on blocking events (FakeEvent.synchronize), not by spinning
    assert all(ev.synchronized_by for ev in copy_events)


def test_nvcomp_for_dtype_is_one_codec_per_itemsize() -> None:
    """One codec object per dtype, so each thread's nvCOMP codec objects are reused."""
    c = NvcompCodec("zstd")
    assert c.for_dtype("bfloat16") is c.for_dtype("torch.float16")
    assert c.for_dtype("float32") is c.for_dtype("float32")
    assert c.for_dtype("uint8") is c
    assert c.for_dtype("float32").itemsize == 4


class _FakeTensor:
    def __init__(self) -> None:
        self.recorded: list[Any] = []

    def record_stream(self, s: Any) -> None:
        self.recorded.append(s)


def test_nvcomp_work_runs_on_a_thread_stream_never_the_default(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = torch.device("cuda", 1)
    default = FakeStream(dev)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: default)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d=None: default)
    used: dict[str, Any] = {}

    def work(name: str) -> None:
        inp, out = _FakeTensor(), _FakeTensor()
        with nvcomp_mod._work_stream(dev, inp) as handed:  # type: ignore[arg-type]
            used[name] = cuda.current[-1][1]
            handed.append(out)  # type: ignore[arg-type]
        assert inp.recorded == [used[name]]  # the input is kept for the work stream
        assert out.recorded == [default]  # the output is kept for the caller's stream

    threads = [threading.Thread(target=work, args=(f"t{i}",), name=f"enc{i}") for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert used["t0"] is not used["t1"], "two encoder threads share one stream"
    for s in used.values():
        assert s is not default and s.waited_streams == [default]
    assert default.waited_streams == [used["t0"], used["t1"]] or default.waited_streams == [
        used["t1"],
        used["t0"],
    ]
    assert cuda.devices_of("enc") == {1}


def test_nvcomp_on_a_side_stream_stays_on_it(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Called on the capture stream (a side stream), nvCOMP queues there: no extra stream."""
    dev = torch.device("cuda", 0)
    side, default = FakeStream(dev), FakeStream(dev)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: side)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d=None: default)
    with nvcomp_mod._work_stream(dev) as handed:
        assert handed == []
    assert cuda.streams == [] and side.waited_streams == []


def test_devices_use_device_ignores_cpu_and_sets_only_on_change(cuda: FakeCuda) -> None:
    devices.use_device(None)
    devices.use_device("cpu")
    devices.use_device("cuda:2")
    devices.use_device(torch.device("cuda", 2))
    devices.use_device("cuda:0")
    assert [i for _, i in cuda.set_device] == [2, 0]
