"""Shared helpers for tests: states with every dtype, models, bit-exact comparison."""

from __future__ import annotations

import importlib.util
import mmap
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch


def all_dtypes() -> list[torch.dtype]:
    names = [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "complex32",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes reinterpreted as ``dtype`` (covers nan/inf payloads, every bit pattern)."""
    item = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def trained_state(steps: int = 3, seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "rng": torch.get_rng_state(),
        "step": steps,
    }


def zoo_state() -> dict[Any, Any]:
    gen = torch.Generator().manual_seed(1234)
    base = torch.randn(6, 8, generator=gen)
    ints = torch.arange(40, dtype=torch.int64)
    state: dict[Any, Any] = {
        "dtypes": {str(d): random_tensor(d, (3, 5), gen) for d in all_dtypes()},
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "empty_int": torch.empty((2, 0), dtype=torch.int32),
        "transposed": base.t(),
        "stepped": ints[1::3],
        "view_a": base,
        "view_b": base[2:4],
        "nested": {1: [1, 2, (3, "x")], (2, "k"): {None: b"\x00\xff"}, 3.5: True},
        "big": 2**100,
        "neg_big": -(2**70),
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1e-310],
        "meta": (torch.Size([2, 3]), torch.float16, torch.device("cpu")),
        "od": OrderedDict([("b", 1), ("a", 2)]),
        "none": None,
        "text": "héllo",
    }
    return state


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-exact, type-exact equality of two state trees."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, (np.ndarray, np.generic)):  # NumPy: dtype, shape and bytes
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a!r} vs {b!r}"
        assert a.tobytes() == b.tobytes(), f"{path}: bytes differ"
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert a.stride() == b.stride() or a.numel() == 0, (
            f"{path}: strides {a.stride()} {b.stride()}"
        )
        if a.numel():
            ab = a.contiguous().view(-1).view(torch.uint8) if a.element_size() else a
            bb = b.contiguous().view(-1).view(torch.uint8) if b.element_size() else b
            assert torch.equal(ab, bb), f"{path}: bytes differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: nan"
    elif isinstance(a, float):
        assert a == b and str(a) == str(b), f"{path}: {a} vs {b}"
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def tensors_in(x: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a state (dicts, lists and tuples walked in order)."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors_in(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from tensors_in(v)


def new_shared_map(path: str, size: int) -> mmap.mmap:
    """A new file of ``size`` bytes at ``path`` (must not exist), mapped shared read-write, as
    a peer receiver maps its file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (registered as ``name``, once: a benchmark that
    imports another finds it)."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod


def wait_in_a_thread(wait: Any, flag: threading.Event, then: threading.Event) -> None:
    """Call ``wait`` on a thread; once it raised ``flag`` (a save handle's
    ``capture_awaited`` or ``commit_awaited``), set ``then`` (which lets held copies go on)
    and join it."""
    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 60
    while not flag.is_set() and time.monotonic() < deadline:
        time.sleep(0.001)
    then.set()
    waiter.join(60)
