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

    def record(self, stream: Any = None) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.synchronized_by.append(threading.current_thread().name)
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
    lock: threading.Lock = field(default_factory=threading.Lock)

    def devices_of(self, prefix: str) -> set[int]:
        """The device indexes threads whose name starts with ``prefix`` selected."""
        with self.lock:
            return {i for name, i in self.set_device if name.startswith(prefix)}


def install(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    """Replace tierckpt.devices' CUDA calls with recording fakes (undone by monkeypatch)."""
    rec = FakeCuda()

    current = threading.local()

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
        with rec.lock:
            rec.events.append(ev)
        return ev

    @contextlib.contextmanager
    def on_streams(streams: Iterable[Any]) -> Iterator[None]:
        with rec.lock:
            for s in streams:
                rec.current.append((threading.current_thread().name, s))
        yield

    def current_stream_wait(device: torch.device, event: Any) -> None:
        with rec.lock:
            rec.stream_waits.append((device, event))

    monkeypatch.setattr(devices, "set_device", set_device)
    monkeypatch.setattr(devices, "current_device", current_device)
    monkeypatch.setattr(devices, "new_stream", new_stream)
    monkeypatch.setattr(devices, "blocking_event", blocking_event)
    monkeypatch.setattr(devices, "on_streams", on_streams)
    monkeypatch.setattr(devices, "current_stream_wait", current_stream_wait)
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
