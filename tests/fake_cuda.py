"""A fake CUDA surface for CPU-only tests: replaces the functions of :mod:`tierckpt.devices`
and records, per thread, which device each thread selected, which streams it made and what
each stream waited for. The state itself stays on the CPU (its copies take the CPU path);
the pipeline is told the state lives on ``cuda:<index>`` through its ready events."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from tierckpt import devices


class FakeEvent:
    """A blocking CUDA event; ``synchronize`` waits for ``gate`` when one is given."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.recorded_on: Any = None
        self.synchronized_by: list[str] = []
        #: the recorder's ordered log (set by the fake ``blocking_event``)
        self.log: list[tuple[Any, ...]] | None = None

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream
        if self.log is not None:
            self.log.append(("record", self, stream))

    def synchronize(self) -> None:
        self.synchronized_by.append(threading.current_thread().name)
        if self.log is not None:
            self.log.append(("sync", self))
        if self.gate is not None:
            assert self.gate.wait(30), "test gate never opened"

    def query(self) -> bool:
        return self.gate is None or self.gate.is_set()


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waited_events: list[Any] = []
        self.waited_streams: list[Any] = []
        self.made_by = threading.current_thread().name
        self.cuda_stream = id(self)

    def wait_event(self, ev: Any) -> None:
        self.waited_events.append(ev)

    def wait_stream(self, s: Any) -> None:
        self.waited_streams.append(s)


@dataclass
class FakeCuda:
    """What the threads did, as recorded by the fake surface."""

    set_device: list[tuple[str, int]] = field(default_factory=list)
    streams: list[FakeStream] = field(default_factory=list)
    events: list[FakeEvent] = field(default_factory=list)
    #: (thread, stream) each time a block ran with a stream current
    current: list[tuple[str, Any]] = field(default_factory=list)
    #: (device, event) the training thread's stream was made to wait for
    stream_waits: list[tuple[torch.device, Any]] = field(default_factory=list)
    #: (thread, device, nbytes, stream current) of each device buffer allocated
    device_allocs: list[tuple[str, torch.device, int, Any]] = field(default_factory=list)
    #: the pinned host buffers allocated (host tensors here)
    pinned: list[torch.Tensor] = field(default_factory=list)
    #: in order: ("copy", thread, stream, dst address, src address, nbytes, the thread's
    #: current device) per copy_async,
    #: ("copy_many", thread, stream, count), ("record", event, stream), ("sync", event)
    log: list[tuple[Any, ...]] = field(default_factory=list)
    #: what free_bytes() reports
    free: int = 1 << 40
    lock: threading.Lock = field(default_factory=threading.Lock)

    def devices_of(self, prefix: str) -> set[int]:
        """The device indexes threads whose name starts with ``prefix`` selected."""
        with self.lock:
            return {i for name, i in self.set_device if name.startswith(prefix)}


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Replace tierckpt.devices' CUDA calls with recording fakes (undone by monkeypatch)."""
    rec = FakeCuda()

    current = threading.local()

    def stream_now() -> Any:
        stack = getattr(current, "streams", None)
        return stack[-1] if stack else None

    def set_device(index: int) -> None:
        current.index = index
        with rec.lock:
            rec.set_device.append((threading.current_thread().name, index))

    def current_device() -> int:
        return int(getattr(current, "index", 0))  # a fresh thread's device is 0

    def new_stream(device: torch.device) -> FakeStream:
        s = FakeStream(device)
        with rec.lock:
            rec.streams.append(s)
        return s

    def blocking_event() -> FakeEvent:
        ev = FakeEvent()
        ev.log = rec.log
        with rec.lock:
            rec.events.append(ev)
        return ev

    @contextlib.contextmanager
    def on_streams(streams: Iterable[Any]) -> Iterator[None]:
        streams = list(streams)
        with rec.lock:
            for s in streams:
                rec.current.append((threading.current_thread().name, s))
        stack = current.__dict__.setdefault("streams", [])
        stack.extend(streams)
        try:
            yield
        finally:
            del stack[len(stack) - len(streams) :]

    def device_empty(nbytes: int, device: torch.device) -> torch.Tensor:
        with rec.lock:
            rec.device_allocs.append(
                (threading.current_thread().name, device, nbytes, stream_now())
            )
        return torch.empty(nbytes, dtype=torch.uint8)

    def pinned_empty(nbytes: int) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=torch.uint8)
        with rec.lock:
            rec.pinned.append(t)
        return t

    def copy_async(dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        with rec.lock:
            rec.log.append(
                (
                    "copy",
                    threading.current_thread().name,
                    stream_now(),
                    dst.data_ptr(),
                    src.data_ptr(),
                    src.numel() * src.element_size(),
                    current_device(),
                )
            )

    def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        for d, s_ in zip(dsts, srcs, strict=True):
            d.copy_(s_)
        with rec.lock:
            rec.log.append(("copy_many", threading.current_thread().name, stream_now(), len(dsts)))

    def current_stream_wait(device: torch.device, event: Any) -> None:
        with rec.lock:
            rec.stream_waits.append((device, event))

    monkeypatch.setattr(devices, "set_device", set_device)
    monkeypatch.setattr(devices, "current_device", current_device)
    monkeypatch.setattr(devices, "new_stream", new_stream)
    monkeypatch.setattr(devices, "blocking_event", blocking_event)
    monkeypatch.setattr(devices, "on_streams", on_streams)
    monkeypatch.setattr(devices, "current_stream_wait", current_stream_wait)
    monkeypatch.setattr(devices, "cuda_available", lambda: True)
    monkeypatch.setattr(devices, "device_empty", device_empty)
    monkeypatch.setattr(devices, "pinned_empty", pinned_empty)
    monkeypatch.setattr(devices, "copy_async", copy_async)
    monkeypatch.setattr(devices, "copy_many", copy_many)
    monkeypatch.setattr(devices, "free_bytes", lambda device: rec.free)
    # threads of earlier tests may have cached a device or stream: start clean
    monkeypatch.setattr(devices, "_local", threading.local())
    return rec


def state_on_device(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """Make the checkpointer believe every saved state lives on ``cuda:<index>``: its ready
    events (one per CUDA device of the state) name that device."""
    from tierckpt.checkpointer import _saving

    def ready(_devs: object) -> dict[torch.device, Any]:
        return {torch.device("cuda", index): devices.blocking_event()}

    monkeypatch.setattr(_saving, "record_ready_events", ready)
