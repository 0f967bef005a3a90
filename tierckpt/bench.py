"""Save benchmark: how long training is blocked, how soon a checkpoint is durable, how much
host memory it costs — tierckpt against ``torch.save``, ``torch.distributed.checkpoint`` and
``torch-checkpointing``, in one run on this machine.

``python -m tierckpt.bench --sizes 1,4 --runs 5 --json bench.json`` (``tierckpt bench``
calls :func:`main`). For each state size and each contender a fresh subprocess builds the
same synthetic state (bf16 weights and fp32 optimizer moments of mixed sizes, with
thousands of small tensors), creates the contender, runs a warm-up save and then ``--runs``
measured saves, and reports medians. A fresh process per contender is the clean way to
measure its peak host memory: staging buffers a peer keeps between saves would otherwise
stay in the next contender's numbers.

Measured per save, from the moment the save call starts:

``returns``   the save call returned.
``staged``    the state may change again (capture / staging finished), waiting for it at
              once: the *immediate* case. For synchronous savers this is the whole save.
``lazy``      the call, then ``--compute-s`` of simulated forward/backward, then the wait
              for capture: time blocked = time in the call + time in the wait.
``committed`` durable on the local disk (fsync'd, committed). The raw sequential
              write + fsync of the same number of bytes, from a warm buffer, is measured in
              the same process between tierckpt's saves.
``memory``    peak extra host memory of the process tree while the contender exists (its
              staging buffers included), sampled every few milliseconds.

A second part trains a small transformer on the CPU and checkpoints every ``--train-every``
steps with each saver, against not checkpointing at all.

The module is long on purpose: one self-contained file, so the benchmark runs from an
installed package without the repository's ``benchmarks/`` folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

__all__ = ["BenchConfig", "main", "make_state", "param_sizes", "run_bench"]

GiB = 1 << 30
MiB = 1 << 20

#: every contender of the save benchmark, in table order
SAVE_CONTENDERS = (
    "torch_save",
    "dcp_save",
    "dcp_async",
    "dcp_async_stager",
    "tc_async",
    "tierckpt_256m",
    "tierckpt_default",
)
#: the peers that stage the state in host memory before writing it (the others write directly)
STAGING_PEERS = frozenset({"dcp_async", "dcp_async_stager", "tc_async"})
#: every variant of the training benchmark
TRAIN_VARIANTS = ("none", "tierckpt", "torch_save", "dcp_async", "dcp_async_stager")

LABELS = {
    "torch_save": "torch.save + fsync",
    "dcp_save": "dcp.save",
    "dcp_async": "dcp.async_save (defaults)",
    "dcp_async_stager": "dcp.async_save + reused DefaultStager",
    "tc_async": "torch-checkpointing async",
    "tierckpt_256m": "tierckpt (arena 256 MiB)",
    "tierckpt_default": "tierckpt (default arena)",
    "none": "no checkpointing",
    "tierckpt": "tierckpt (guard)",
}


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """Every knob of one benchmark run (the command line maps onto it one to one)."""

    sizes_gib: tuple[float, ...] = (1.0, 4.0)
    runs: int = 5
    warmup: int = 1
    compute_s: float = 1.0
    compute: str = "sleep"  # "sleep" (an accelerator computes) or "busy" (CPU matmuls)
    arena_bytes: int = 256 * MiB
    contenders: tuple[str, ...] = SAVE_CONTENDERS
    train_variants: tuple[str, ...] = TRAIN_VARIANTS
    train_steps: int = 120  # measured steps per variant
    train_every: int = 10
    train_layers: int = 4
    train_dmodel: int = 256
    train_threads: int = 0  # torch intra-op threads of the training loop; 0: torch's default
    directory: str | None = None
    breakdown: bool = True
    worker_timeout_s: float = 3600.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.sizes_gib or any(s <= 0 for s in self.sizes_gib):
            raise ValueError(f"sizes must be positive GiB values, got {self.sizes_gib}")
        if self.runs < 1 or self.warmup < 0:
            raise ValueError("runs must be >= 1 and warmup >= 0")
        if self.compute not in ("sleep", "busy"):
            raise ValueError(f"compute must be 'sleep' or 'busy', got {self.compute!r}")
        if self.arena_bytes < 4096 or self.arena_bytes % 4096:
            raise ValueError("the arena size must be a positive multiple of 4096 bytes")
        for c in self.contenders:
            if c not in SAVE_CONTENDERS:
                raise ValueError(f"unknown contender {c!r}; known: {', '.join(SAVE_CONTENDERS)}")
        for v in self.train_variants:
            if v not in TRAIN_VARIANTS:
                raise ValueError(f"unknown training variant {v!r}; known: {TRAIN_VARIANTS}")
        if self.train_variants and min(self.train_steps, self.train_every) < 1:
            raise ValueError("train steps and train every must be >= 1")


# -- the synthetic state ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateInfo:
    nbytes: int
    tensors: int
    small_tensors: int  # under 64 KiB
    bf16_bytes: int
    fp32_bytes: int
    largest_bytes: int


def param_sizes(gib: float, seed: int, n_small: int | None = None) -> list[int]:
    """Element counts of the synthetic parameters: 6 bytes each (bf16 weight + fp32 moment).

    ``n_small`` parameters of 256 to 4,096 elements (default ``max(600, 600 * gib)``: two
    small tensors each), 4 % of the bytes in 64 Ki to 512 Ki elements, the rest in 2 Mi to
    8 Mi elements; shuffled.
    """
    rng = random.Random(seed)
    total = int(gib * GiB) // 6
    if n_small is None:
        n_small = max(600, int(600 * gib))
    sizes = [rng.randint(256, 4096) for _ in range(n_small)]
    medium_budget = total // 25
    while medium_budget > 0:
        n = min(rng.randint(64 << 10, 512 << 10), medium_budget)
        sizes.append(n)
        medium_budget -= n
    left = total - sum(sizes)
    while left > 0:
        n = min(rng.randint(2 << 20, 8 << 20), left)
        sizes.append(n)
        left -= n
    rng.shuffle(sizes)
    return sizes


def make_state(gib: float, seed: int = 0) -> tuple[dict[str, Any], StateInfo]:
    """A training-like state of about ``gib`` GiB: bf16 weights plus fp32 Adam-style moments.

    ``{"model": {name: bf16}, "optim": {"state": {name: {"exp_avg": fp32}}, "param_groups":
    [...]}, "step": int}`` with tensors from 512 bytes to 32 MiB. Every page is written here
    (with random values), so the first save does not pay for first-touch page faults.
    """
    sizes = param_sizes(gib, seed)
    gen = torch.Generator().manual_seed(seed)
    block32 = torch.randn(16 << 20, generator=gen)
    block16 = block32.to(torch.bfloat16)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0

    def filled(n: int, block: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        t = torch.empty(n, dtype=block.dtype)
        done = 0
        while done < n:
            start = offset % block.numel()
            take = min(n - done, block.numel() - start)
            t[done : done + take].copy_(block[start : start + take])
            done += take
            offset += take + 7
        return t

    for i, n in enumerate(sizes):
        name = f"layers.{i // 8}.p{i % 8}"
        model[name] = filled(n, block16)
        moments[name] = {"exp_avg": filled(n, block32)}
    state: dict[str, Any] = {
        "model": model,
        "optim": {"state": moments, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
        "step": 0,
    }
    tensors = list(model.values()) + [m["exp_avg"] for m in moments.values()]
    info = StateInfo(
        nbytes=sum(t.nbytes for t in tensors),
        tensors=len(tensors),
        small_tensors=sum(1 for t in tensors if t.nbytes < 64 << 10),
        bf16_bytes=sum(t.nbytes for t in model.values()),
        fp32_bytes=sum(m["exp_avg"].nbytes for m in moments.values()),
        largest_bytes=max(t.nbytes for t in tensors),
    )
    return state, info


# -- host memory ----------------------------------------------------------------------------


def _proc_status_bytes(pid: int) -> tuple[int, int]:
    """(RssAnon, RssShmem) of ``pid`` in bytes, from /proc (0, 0 when it is gone)."""
    anon = shm = 0
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    anon = int(line.split()[1]) * 1024
                elif line.startswith(b"RssShmem:"):
                    shm = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return anon, shm


class MemorySampler:
    """Samples the host memory of this process and its children from a thread.

    Memory = sum of anonymous resident memory over the process tree + the largest shared
    memory resident in any one of them (a peer that stages into shared memory for a writer
    process maps the same pages in both; counting them once). Page cache is not counted.
    """

    def __init__(self, interval_s: float = 0.004) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval_s
        self._pids = [os.getpid()]
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._has_proc = os.path.exists(f"/proc/{os.getpid()}/status")

    def current(self) -> int:
        if not self._has_proc:  # pragma: no cover - non-Linux
            return int(self._proc.memory_info().rss)
        anon_total = 0
        shm_max = 0
        for pid in self._pids:
            anon, shm = _proc_status_bytes(pid)
            anon_total += anon
            shm_max = max(shm_max, shm)
        return anon_total + shm_max

    def _refresh_children(self) -> None:
        try:
            kids = [c.pid for c in self._proc.children(recursive=True)]
        except Exception:
            kids = []
        self._pids = [os.getpid(), *kids]

    def _loop(self) -> None:
        n = 0
        while not self._stop.is_set():
            if n % 25 == 0:
                self._refresh_children()
            self._peak = max(self._peak, self.current())
            n += 1
            self._stop.wait(self._interval)

    def start(self) -> None:
        self._refresh_children()
        self._peak = self.current()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-mem", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Stop sampling; the peak seen since :meth:`start`."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._peak = max(self._peak, self.current())
        return self._peak


# -- disk helpers ---------------------------------------------------------------------------


def raw_write(path: Path, nbytes: int, buf: memoryview) -> dict[str, float]:
    """Write ``nbytes`` sequentially from the warm ``buf`` (repeated), fsync, time both."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            n = min(len(buf), nbytes - done)
            done += os.pwrite(fd, buf[:n], done)
        t1 = time.perf_counter()
        os.fsync(fd)
    finally:
        os.close(fd)
    t2 = time.perf_counter()
    path.unlink()
    return {"write_s": t1 - t0, "fsync_s": t2 - t1, "total_s": t2 - t0}


def _fsync_tree(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _empty_dir(root: Path) -> None:
    for p in root.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def filesystem_of(path: str) -> dict[str, str]:
    """Mount point, device and type of the filesystem holding ``path`` (Linux /proc/mounts)."""
    best = {"mount": "/", "device": "?", "type": "?"}
    real = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"mount": mnt, "device": dev, "type": fstype}
    except OSError:  # pragma: no cover - non-Linux
        pass
    return best


def default_bench_dir() -> str:
    """A folder on the disk of the current directory: the temp dir unless it is tmpfs or on
    another filesystem (a RAM-backed temp dir would measure memory, not the disk)."""
    tmp = tempfile.gettempdir()
    cwd = os.getcwd()
    same_dev = os.stat(tmp).st_dev == os.stat(cwd).st_dev
    if same_dev and filesystem_of(tmp)["type"] not in ("tmpfs", "ramfs"):
        return tmp
    return cwd


# -- simulated compute ----------------------------------------------------------------------


def simulated_compute(seconds: float, kind: str) -> None:
    """Stand-in for a forward/backward pass: idle host (``sleep``) or CPU matmuls (``busy``)."""
    if kind == "sleep":
        time.sleep(seconds)
        return
    a = torch.randn(512, 512)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a) * 0.5


# -- contenders -----------------------------------------------------------------------------


class Contender(ABC):
    """One way to save: ``start`` is the save call; the waits mark the later milestones."""

    #: True when staging runs in the background (so a lazy run means something)
    background = False

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        self.out = out
        self.cfg = cfg
        out.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def start(self, state: dict[str, Any], step: int) -> None: ...

    def wait_staged(self) -> None:
        """Return once the state may be modified again."""

    @abstractmethod
    def wait_committed(self) -> None: ...

    def cleanup(self) -> None:
        """Delete what the last save wrote (untimed, between runs)."""
        _empty_dir(self.out)

    def close(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        return {}

    def milestones(self, t0: float) -> dict[str, float]:
        """Extra per-save times (from ``t0``, the start of the save call) a contender knows."""
        return {}


class TorchSave(Contender):
    def start(self, state: dict[str, Any], step: int) -> None:
        path = self.out / f"step-{step}.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def wait_committed(self) -> None:
        pass


class DcpSave(Contender):
    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        dcp.save(state, checkpoint_id=str(self.out / f"step-{step}"))

    def wait_committed(self) -> None:
        pass


class DcpAsync(Contender):
    """``dcp.async_save`` with its defaults (a new, synchronous stager on every call)."""

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        self._future: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        self._future = dcp.async_save(state, checkpoint_id=str(self.out / f"step-{step}"))

    def wait_committed(self) -> None:
        f = self._future
        (f.upload_completion if hasattr(f, "upload_completion") else f).result()


class DcpAsyncStager(Contender):
    """``dcp.async_save`` with one reused ``DefaultStager`` staging in a background thread.

    The strongest DCP setting on a CPU-only machine: pinned memory and non-blocking copies
    need CUDA, shared memory only serves the process-based upload executor.
    """

    background = True

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )
        self._resp: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        self._resp = dcp.async_save(
            state, checkpoint_id=str(self.out / f"step-{step}"), async_stager=self._stager
        )

    def wait_staged(self) -> None:
        self._resp.staging_completion.result()

    def wait_committed(self) -> None:
        self._resp.upload_completion.result()

    def close(self) -> None:
        self._stager.close()


class TorchCheckpointingAsync(Contender):
    """torch-checkpointing's ``CheckpointManager`` in its default async mode.

    Its writer is a child process fed through shared memory; its files are not fsync'd, so
    ``committed`` adds an fsync of every file it wrote (reported apart as ``fsync_s``).
    """

    background = True

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self._mgr = CheckpointManager(
            CheckpointManager.Config(
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
            )
        )
        self._future: Any = None
        self._path = out
        self._fsync_s: list[float] = []

    def start(self, state: dict[str, Any], step: int) -> None:
        self._path = self.out / f"step-{step}"
        self._future = self._mgr.save(str(self._path), state)

    def wait_staged(self) -> None:
        with self._mgr.lock():  # its documented guard for the optimizer step
            pass

    def wait_committed(self) -> None:
        self._future.result()
        t0 = time.perf_counter()
        _fsync_tree(self._path)
        self._fsync_s.append(time.perf_counter() - t0)

    def close(self) -> None:
        self._mgr.close()

    def extra(self) -> dict[str, Any]:
        return {"fsync_s_median": _median(self._fsync_s), "writes_fsync": False}


class Tierckpt(Contender):
    background = True

    def __init__(self, out: Path, cfg: BenchConfig, arena_bytes: int | None) -> None:
        super().__init__(out, cfg)
        from tierckpt import Checkpointer, LocalTier

        self.ck = Checkpointer([LocalTier(out, keep_last=None)], host_buffer_bytes=arena_bytes)
        self._handle: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        self._handle = self.ck.save(state, step)

    def wait_staged(self) -> None:
        self.ck.wait_captured()

    def wait_committed(self) -> None:
        self._handle.wait("local")

    def milestones(self, t0: float) -> dict[str, float]:
        h = self._handle
        return {"captured_at_s": h.captured_at - t0} if h.captured_at is not None else {}

    def cleanup(self) -> None:
        backend = self.ck.backend("local")
        for name in backend.list(""):
            backend.delete(name)

    def close(self) -> None:
        self.ck.close()

    def extra(self) -> dict[str, Any]:
        p = getattr(self.ck, "_pipeline", None)  # internals: report what is there
        arena = getattr(p, "arena", None)
        return {
            "host_buffer_bytes": self.ck.host_buffer_bytes,
            "chunk_bytes": self.ck.chunk_bytes,
            "arena_bytes": arena.nbytes if arena is not None else None,
            "arena_slots": arena.n_slots if arena is not None else None,
            "arena_alloc_s": arena.alloc_seconds if arena is not None else None,
        }


def make_contender(name: str, out: Path, cfg: BenchConfig) -> Contender:
    if name == "torch_save":
        return TorchSave(out, cfg)
    if name == "dcp_save":
        return DcpSave(out, cfg)
    if name == "dcp_async":
        return DcpAsync(out, cfg)
    if name == "dcp_async_stager":
        return DcpAsyncStager(out, cfg)
    if name == "tc_async":
        return TorchCheckpointingAsync(out, cfg)
    if name == "tierckpt_256m":
        return Tierckpt(out, cfg, cfg.arena_bytes)
    if name == "tierckpt_default":
        return Tierckpt(out, cfg, None)
    raise ValueError(f"unknown contender {name!r}")


# -- one save, timed --------------------------------------------------------------------------


def timed_save(
    c: Contender, state: dict[str, Any], step: int, *, lazy: bool, cfg: BenchConfig
) -> dict[str, float]:
    """Run one save; every time is measured from the start of the save call."""
    t0 = time.perf_counter()
    c.start(state, step)
    t1 = time.perf_counter()
    rec = {"returns_s": t1 - t0}
    if lazy:
        simulated_compute(cfg.compute_s, cfg.compute)
        t2 = time.perf_counter()
        c.wait_staged()
        t3 = time.perf_counter()
        rec["lazy_wait_s"] = t3 - t2
        rec["lazy_blocked_s"] = (t1 - t0) + (t3 - t2)
    else:
        c.wait_staged()
        rec["staged_s"] = time.perf_counter() - t0
    c.wait_committed()
    rec["committed_s"] = time.perf_counter() - t0
    rec.update(c.milestones(t0))
    return rec


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _medians(records: list[dict[str, float]]) -> dict[str, float | None]:
    keys = sorted({k for r in records for k in r})
    return {k: _median([r[k] for r in records if k in r]) for k in keys}


# -- time breakdown of one tierckpt save ------------------------------------------------------


@contextlib.contextmanager
def _instrumented(acc: dict[str, float]) -> Iterator[None]:
    """Wrap tierckpt's internal stages with timers (for one diagnostic save only)."""
    import tierckpt.arena as arena_mod
    import tierckpt.backends.local as local_mod
    import tierckpt.checkpointer as ck_mod
    import tierckpt.pipeline as pl_mod

    lock = threading.Lock()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, attr: str, key: str) -> None:
        fn = getattr(owner, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with lock:
                    acc[key] = acc.get(key, 0.0) + time.perf_counter() - t0

        saved.append((owner, attr, fn))
        setattr(owner, attr, timed)

    try:
        wrap(ck_mod, "build_plan", "plan_s")
        wrap(pl_mod, "copy_chunk", "copy_s")
        wrap(pl_mod, "_encode", "checksum_encode_s")
        wrap(arena_mod.HostArena, "acquire", "arena_wait_s")
        wrap(local_mod._LocalWriter, "write", "pwrite_s")
        wrap(local_mod._LocalWriter, "commit", "fsync_rename_s")
        yield
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)


def tierckpt_breakdown(c: Tierckpt, state: dict[str, Any], step: int) -> dict[str, float]:
    """Per-stage busy time of one immediate save, plus plan building timed on its own."""
    from tierckpt.objects import encode_tree
    from tierckpt.plan import build_plan

    plan_times, walk_times, sig_times = [], [], []
    for _ in range(5):
        t0 = time.perf_counter()
        build_plan(state, c.ck.chunk_bytes)
        t1 = time.perf_counter()
        leaves: list[torch.Tensor] = []

        def on_tensor(t: torch.Tensor, _path: object, leaves: list[torch.Tensor] = leaves) -> int:
            leaves.append(t)
            return len(leaves) - 1

        encode_tree(state, on_tensor)
        t2 = time.perf_counter()
        # what a plan cache would have to compare per save: storage, offset, shape, stride, dtype
        sig = [
            (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)
            for t in leaves
        ]
        t3 = time.perf_counter()
        del sig
        plan_times.append(t1 - t0)
        walk_times.append(t2 - t1)
        sig_times.append(t3 - t2)
    acc: dict[str, float] = {}
    try:
        with _instrumented(acc):
            rec = timed_save(c, state, step, lazy=False, cfg=c.cfg)
    except AttributeError as exc:  # internals moved: say so instead of failing the bench
        return {"error": f"breakdown unavailable: {exc}"}  # type: ignore[dict-item]
    c.cleanup()
    return {
        **acc,
        **rec,
        "plan_only_median_s": statistics.median(plan_times),
        "tree_walk_median_s": statistics.median(walk_times),
        "signature_median_s": statistics.median(sig_times),
    }


# -- the save worker (one subprocess per size and contender) ---------------------------------


def save_worker(name: str, gib: float, directory: str, cfg: BenchConfig) -> dict[str, Any]:
    warnings.filterwarnings("ignore", category=UserWarning)
    t_build = time.perf_counter()
    state, info = make_state(gib, cfg.seed)
    build_s = time.perf_counter() - t_build
    out = Path(directory) / f"{name}-{gib:g}"
    raw_buf = torch.empty(64 * MiB, dtype=torch.uint8).fill_(7)
    raw_view = memoryview(raw_buf.numpy())  # type: ignore[arg-type]
    sampler = MemorySampler()
    base_mem = sampler.current()
    sampler.start()
    c = make_contender(name, out, cfg)
    records: list[dict[str, float]] = []
    raw: list[dict[str, float]] = []
    warm: list[dict[str, float]] = []
    step = 0
    try:
        for _ in range(cfg.warmup):
            warm.append(timed_save(c, state, step, lazy=False, cfg=cfg))
            c.cleanup()
            step += 1
        for _ in range(cfg.runs):
            rec = timed_save(c, state, step, lazy=False, cfg=cfg)
            c.cleanup()
            step += 1
            if c.background:
                lazy = timed_save(c, state, step, lazy=True, cfg=cfg)
                c.cleanup()
                step += 1
                rec.update({k: v for k, v in lazy.items() if k.startswith("lazy")})
                rec["lazy_committed_s"] = lazy["committed_s"]
                rec["lazy_returns_s"] = lazy["returns_s"]
                if "captured_at_s" in lazy:
                    rec["lazy_captured_at_s"] = lazy["captured_at_s"]
            else:
                rec["lazy_blocked_s"] = rec["staged_s"]
            if isinstance(c, Tierckpt):
                r = raw_write(out / "raw.bin", info.nbytes, raw_view)
                raw.append(r)
                rec["raw_total_s"] = r["total_s"]
                rec["committed_over_raw"] = rec["committed_s"] / r["total_s"]
            records.append(rec)
        peak = sampler.stop()
        breakdown = (
            tierckpt_breakdown(c, state, step)
            if isinstance(c, Tierckpt) and cfg.breakdown
            else None
        )
        extra = c.extra()
    finally:
        sampler.stop()
        c.close()
        shutil.rmtree(out, ignore_errors=True)
    return {
        "contender": name,
        "label": LABELS[name],
        "gib": gib,
        "state": asdict(info),
        "state_build_s": build_s,
        "warmup": warm,
        "runs": records,
        "median": _medians(records),
        "raw_write": {"runs": raw, "median": _medians(raw)} if raw else None,
        "base_mem_bytes": base_mem,
        "peak_extra_bytes": peak - base_mem,
        "background_staging": c.background,
        "breakdown": breakdown,
        **extra,
    }


# -- the training benchmark -------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """A small decoder-style transformer language model, sized to train on two CPU cores."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d_model))
        layer = torch.nn.TransformerEncoderLayer(
            d_model,
            nhead=max(1, d_model // 64),
            dim_feedforward=4 * d_model,
            batch_first=True,
            norm_first=True,
            dropout=0.0,
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


class _TrainSaver:
    """What one training variant does at a checkpoint, before the optimizer step, and when
    its turn ends (``drain``: wait until everything it started is durable)."""

    def __init__(self, variant: str, out: Path, opt: torch.optim.Optimizer) -> None:
        self.variant = variant
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []
        self.commit_s: list[float] = []
        self.handles: list[Any] = []
        self.ck: Any = None
        self.stager: Any = None
        self.resp: Any = None
        self.blocked_s: list[float] = []  # per checkpoint: the save call + the wait before step
        self._pending_block: float | None = None
        if variant == "tierckpt":
            from tierckpt import Checkpointer, LocalTier

            self.ck = Checkpointer([LocalTier(out, keep_last=2)])
            self.ck.guard(opt)  # a no-op while this Checkpointer has nothing in flight
        elif variant == "dcp_async_stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(False, False, True, False))

    def before_step(self) -> None:
        t0 = time.perf_counter()
        if self.ck is not None and self.handles and not self.handles[-1].captured:
            self.ck.wait_captured()  # what guard() does inside optimizer.step(), timed here
        if self.resp is not None and hasattr(self.resp, "staging_completion"):
            self.resp.staging_completion.result()
        if self._pending_block is not None:
            self.blocked_s.append(self._pending_block + time.perf_counter() - t0)
            self._pending_block = None

    def _prune(self) -> None:
        while len(self.paths) > 2:
            p = self.paths.pop(0)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _finish_previous(self) -> None:
        if self.resp is None:
            return
        getattr(self.resp, "upload_completion", self.resp).result()
        self.resp = None

    def save(self, state: dict[str, Any], step: int) -> None:
        t0 = time.perf_counter()
        self._save(state, step)
        self._pending_block = time.perf_counter() - t0

    def _save(self, state: dict[str, Any], step: int) -> None:
        if self.variant == "tierckpt":
            self.handles.append(self.ck.save(state, step))
            return
        path = self.out / f"step-{step}"
        if self.variant == "torch_save":
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            self.commit_s.append(time.perf_counter() - t0)
        else:
            from torch.distributed.checkpoint import state_dict_saver as dcp

            self._finish_previous()  # DCP's usage: one upload in flight
            t0 = time.perf_counter()
            self.resp = dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
            up = getattr(self.resp, "upload_completion", self.resp)
            up.add_done_callback(lambda _f: self.commit_s.append(time.perf_counter() - t0))
        self.paths.append(path)
        self._prune()

    def drain(self) -> None:
        if self.ck is not None:
            self.ck.wait()
        self._finish_previous()

    def close(self) -> None:
        self.drain()
        if self.ck is not None:
            for h in self.handles:
                r = h.results.get("local")
                if r is not None:
                    self.commit_s.append(r.seconds)
            self.ck.close()
        if self.stager is not None:
            self.stager.close()


def train_schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) blocks: one unmeasured warm-up round (-1), then ``rounds`` rounds in
    ABBA order, so a drift in the machine's load touches every variant alike."""
    out = [(-1, v) for v in variants]
    for r in range(rounds):
        out += [(r, v) for v in (variants if r % 2 == 0 else variants[::-1])]
    return out


def train_worker(directory: str, cfg: BenchConfig) -> dict[str, Any]:
    """Train one model; the variants take turns in blocks of ``train_every`` steps (at least 4).

    Interleaving in one process is what makes the comparison usable on a shared machine:
    separate runs minutes apart differed by 2-4x in iteration time from other tenants' load
    alone. A block's saves land mid-block; at its end the variant's outstanding checkpoint
    work is waited for and that wait is charged to the block's last iteration.
    """
    warnings.filterwarnings("ignore", category=UserWarning)
    if cfg.train_threads > 0:
        torch.set_num_threads(cfg.train_threads)
    torch.manual_seed(cfg.seed)
    vocab, seq, batch = 8192, 128, 8
    model = TinyLM(vocab, cfg.train_dmodel, cfg.train_layers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (64, batch, seq + 1))
    out = Path(directory) / "train"
    savers = {v: _TrainSaver(v, out / v, opt) for v in cfg.train_variants if v != "none"}
    block = cfg.train_every * max(1, -(-4 // cfg.train_every))  # one save or more per block
    rounds = max(1, -(-cfg.train_steps // block))
    times: dict[str, list[float]] = {v: [] for v in cfg.train_variants}
    round_means: dict[str, list[float]] = {v: [] for v in cfg.train_variants}
    saves = dict.fromkeys(cfg.train_variants, 0)
    state_bytes = 0
    step = 0
    try:
        for rnd, v in train_schedule(cfg.train_variants, rounds):
            saver = savers.get(v)
            block_times: list[float] = []
            for j in range(block):
                t0 = time.perf_counter()
                xy = data[step % data.shape[0]]
                logits = model(xy[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, vocab), xy[:, 1:].reshape(-1)
                )
                loss.backward()  # type: ignore[no-untyped-call]
                if saver is not None:
                    saver.before_step()
                opt.step()
                opt.zero_grad(set_to_none=True)
                # after the step, so the state is consistent
                if saver is not None and (j + 1 + cfg.train_every // 2) % cfg.train_every == 0:
                    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                    state_bytes = state_bytes or _tensor_bytes(state)
                    saver.save(state, step)
                    saves[v] += rnd >= 0
                block_times.append(time.perf_counter() - t0)
                step += 1
            if saver is not None:
                t0 = time.perf_counter()
                saver.drain()
                block_times[-1] += time.perf_counter() - t0
            if rnd >= 0:
                times[v].extend(block_times)
                round_means[v].append(statistics.fmean(block_times))
        for s in savers.values():
            s.close()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    variants: dict[str, Any] = {}
    for v, ts in times.items():
        sv = savers.get(v)
        variants[v] = {
            "variant": v,
            "label": LABELS[v],
            "steps": len(ts),
            "saves": saves[v],
            "mean_iter_s": statistics.fmean(ts),
            "median_iter_s": statistics.median(ts),
            "p95_iter_s": sorted(ts)[int(0.95 * (len(ts) - 1))],
            "max_iter_s": max(ts),
            "round_mean_iter_s": round_means[v],
            "commit_s_median": _median(sv.commit_s) if sv is not None else None,
            "blocked_s_median": _median(sv.blocked_s) if sv is not None else None,
            "iter_s": ts,
        }
    return {
        "variants": variants,
        "every": cfg.train_every,
        "block_steps": block,
        "rounds": rounds,
        "state_bytes": state_bytes,
        "torch_threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


# -- orchestration ----------------------------------------------------------------------------


def _spawn(kind: str, name: str, gib: float, directory: str, cfg: BenchConfig) -> dict[str, Any]:
    """Run one worker in a fresh interpreter; its result comes back through a JSON file."""
    fd, result = tempfile.mkstemp(prefix="tierckpt-bench-", suffix=".json", dir=directory)
    os.close(fd)
    spec = {
        "kind": kind,
        "name": name,
        "gib": gib,
        "dir": directory,
        "result": result,
        "cfg": _cfg_to_json(cfg),
    }
    cmd = [sys.executable, "-m", "tierckpt.bench", "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, timeout=cfg.worker_timeout_s, check=False)
        if proc.returncode != 0:
            return {"error": f"worker exited with status {proc.returncode}", "contender": name}
        with open(result) as f:
            out: dict[str, Any] = json.load(f)
        return out
    except subprocess.TimeoutExpired:
        return {"error": f"worker timed out after {cfg.worker_timeout_s:.0f} s", "contender": name}
    finally:
        with contextlib.suppress(OSError):
            os.unlink(result)


def _cfg_to_json(cfg: BenchConfig) -> dict[str, Any]:
    return asdict(cfg)


def _cfg_from_json(d: dict[str, Any]) -> BenchConfig:
    d = dict(d)
    for k in ("sizes_gib", "contenders", "train_variants"):
        d[k] = tuple(d[k])
    return BenchConfig(**d)


def _worker_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    cfg = _cfg_from_json(spec["cfg"])
    load0 = _loadavg()
    if spec["kind"] == "save":
        res = save_worker(spec["name"], float(spec["gib"]), spec["dir"], cfg)
    else:
        res = train_worker(spec["dir"], cfg)
    res["loadavg"] = {"start": load0, "end": _loadavg()}
    with open(spec["result"], "w") as f:
        json.dump(res, f)
    return 0


def _available(name: str) -> str | None:
    """Why ``name`` cannot run here, or None."""
    if name == "tc_async":
        try:
            import torch_checkpointing  # noqa: F401
        except ImportError:
            return "torch-checkpointing is not installed (pip install torch-checkpointing)"
    return None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    import tierckpt

    out: dict[str, str | None] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tierckpt": tierckpt.__version__,
    }
    for pkg in ("torch-checkpointing", "psutil", "xxhash"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _git_revision() -> str | None:
    """The repository's commit (+ "-dirty" with uncommitted changes), when run from a clone."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() or None


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover - not on every platform
        return None


def _machine() -> dict[str, Any]:
    import psutil

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpus": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "gpu": gpu,
        "platform": platform.platform(),
    }


def run_bench(
    cfg: BenchConfig, *, log: Callable[[str], None] = print, argv: Sequence[str] | None = None
) -> dict[str, Any]:
    """Run every contender for every size, then the training loop; return the results."""
    base = cfg.directory or default_bench_dir()
    os.makedirs(base, exist_ok=True)
    work = tempfile.mkdtemp(prefix="tierckpt-bench-", dir=base)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m tierckpt.bench", *(argv or [])]),
            "machine": _machine(),
            "versions": _versions(),
            "git": _git_revision(),
            "loadavg_start": _loadavg(),
            "directory": work,
            "filesystem": filesystem_of(work),
            "config": _cfg_to_json(cfg),
        },
        "sizes": [],
        "train": None,
    }
    try:
        for gib in cfg.sizes_gib:
            entry: dict[str, Any] = {"gib": gib, "contenders": {}, "skipped": {}}
            for name in cfg.contenders:
                why = _available(name)
                if why:
                    entry["skipped"][name] = why
                    log(f"[{gib:g} GiB] {name}: skipped ({why})")
                    continue
                t0 = time.perf_counter()
                log(f"[{gib:g} GiB] {LABELS[name]} ...")
                res = _spawn("save", name, gib, work, cfg)
                if "error" in res:
                    log(f"[{gib:g} GiB] {name}: FAILED: {res['error']}")
                else:
                    log(f"[{gib:g} GiB] {name}: done in {time.perf_counter() - t0:.0f} s")
                entry["contenders"][name] = res
            entry["summary"] = summarize_size(entry)
            result["sizes"].append(entry)
        if cfg.train_variants:
            log(f"[train] {', '.join(cfg.train_variants)}, interleaved ...")
            train: dict[str, Any] = _spawn("train", "train", 0.0, work, cfg)
            if "error" not in train:
                train["summary"] = summarize_train(train)
            result["train"] = train
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    result["meta"]["loadavg_end"] = _loadavg()
    result["targets"] = evaluate_targets(result)
    return result


# -- summaries, targets, table -----------------------------------------------------------------


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize_size(entry: dict[str, Any]) -> dict[str, Any]:
    """Ratios of tierckpt against every baseline, for one size."""
    cs = {k: v for k, v in entry["contenders"].items() if "error" not in v}
    out: dict[str, Any] = {"speedup_immediate": {}, "speedup_lazy": {}}
    for tk in ("tierckpt_256m", "tierckpt_default"):
        t = cs.get(tk)
        if t is None:
            continue
        ti = t["median"]["staged_s"]
        tl = t["median"]["lazy_blocked_s"]
        peers = {b: v for b, v in cs.items() if not b.startswith("tierckpt")}
        out["speedup_immediate"][tk] = {b: v["median"]["staged_s"] / ti for b, v in peers.items()}
        out["speedup_lazy"][tk] = {b: v["median"]["lazy_blocked_s"] / tl for b, v in peers.items()}
    return out


def summarize_train(train: dict[str, Any]) -> dict[str, Any]:
    """Iteration time of every variant over no checkpointing: ratio of the means, and the
    median of the per-round ratios (each round's blocks ran minutes apart at most)."""
    vs = train["variants"]
    if "none" not in vs:
        return {}
    base = vs["none"]
    return {
        "mean_iter_over_none": {k: v["mean_iter_s"] / base["mean_iter_s"] for k, v in vs.items()},
        "paired_median_over_none": {
            k: statistics.median(
                a / b
                for a, b in zip(v["round_mean_iter_s"], base["round_mean_iter_s"], strict=True)
            )
            for k, v in vs.items()
        },
        "median_iter_over_none": {
            k: v["median_iter_s"] / base["median_iter_s"] for k, v in vs.items()
        },
    }


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, each with the measured value and whether it was met."""
    out: list[dict[str, Any]] = []

    def add(
        name: str, value: float | None, limit: float | None, met: bool | None, detail: str
    ) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": met, "detail": detail})

    for e in result["sizes"]:
        gib = e["gib"]
        cs = {k: v for k, v in e["contenders"].items() if "error" not in v}
        for tk in ("tierckpt_256m", "tierckpt_default"):
            t = cs.get(tk)
            if t is None:
                continue
            m = t["median"]
            gib_real = t["state"]["nbytes"] / GiB
            lazy_per_gib = m["lazy_blocked_s"] / gib_real
            add(
                f"{gib:g} GiB {tk}: lazy blocked <= 10 ms/GiB",
                lazy_per_gib * 1e3,
                10.0,
                lazy_per_gib <= 0.010,
                f"{m['lazy_blocked_s'] * 1e3:.1f} ms for {gib_real:.2f} GiB (medians: save() "
                f"{m.get('lazy_returns_s', 0) * 1e3:.1f} ms, wait "
                f"{m.get('lazy_wait_s', 0) * 1e3:.1f} ms)",
            )
            cap_per_gib = m["staged_s"] / gib_real
            add(
                f"{gib:g} GiB {tk}: immediate capture <= 0.1 s/GiB",
                cap_per_gib,
                0.1,
                cap_per_gib <= 0.1,
                f"{m['staged_s']:.3f} s for {gib_real:.2f} GiB",
            )
            peers = {b: v["median"]["staged_s"] for b, v in cs.items() if b in STAGING_PEERS}
            if peers:
                fastest = min(peers, key=lambda b: peers[b])
                add(
                    f"{gib:g} GiB {tk}: immediate capture faster than every peer's staging",
                    m["staged_s"],
                    peers[fastest],
                    m["staged_s"] < peers[fastest],
                    f"tierckpt {m['staged_s']:.3f} s vs fastest peer {fastest} "
                    f"{peers[fastest]:.3f} s",
                )
            ratio = m.get("committed_over_raw")
            if ratio is not None:
                add(
                    f"{gib:g} GiB {tk}: committed <= 1.15x raw write+fsync",
                    ratio,
                    1.15,
                    ratio <= 1.15,
                    f"committed {m['committed_s']:.2f} s vs raw {m['raw_total_s']:.2f} s "
                    "(median of per-run ratios)",
                )
            arena = t.get("arena_bytes") or t.get("host_buffer_bytes")
            extra = t["peak_extra_bytes"]
            if arena:
                add(
                    f"{gib:g} GiB {tk}: extra host memory bounded by the arena",
                    extra / MiB,
                    arena / MiB,
                    extra <= arena * 1.10 + 64 * MiB,
                    f"peak extra {extra / MiB:.0f} MiB, arena {arena / MiB:.0f} MiB, "
                    f"state {t['state']['nbytes'] / MiB:.0f} MiB",
                )
    tr = result.get("train") or {}
    ratio = _get(tr, "summary", "mean_iter_over_none", "tierckpt")
    if ratio is not None:
        v = tr["variants"]["tierckpt"]
        paired = _get(tr, "summary", "paired_median_over_none", "tierckpt")
        budget = tr["every"] * tr["variants"]["none"]["mean_iter_s"]
        keeps_up = (v["commit_s_median"] or 0) < budget
        add(
            "training: iteration time with tierckpt <= 1.10x no checkpointing",
            ratio,
            1.10,
            ratio <= 1.10,
            f"{ratio:.2f}x of the means, {paired:.2f}x median of paired rounds; checkpoint every "
            f"{tr['every']} steps ({tr['state_bytes'] / MiB:.0f} MiB), committed in "
            f"{v['commit_s_median'] or 0:.2f} s vs {tr['every']} steps = {budget:.2f} s: the disk "
            f"{'keeps up' if keeps_up else 'does NOT keep up'}",
        )
    return out


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 0.1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


def format_table(result: dict[str, Any]) -> str:
    """The results as Markdown tables (printed, and pasted into docs/benchmarks.md)."""
    lines: list[str] = []
    cfg = result["meta"]["config"]
    for e in result["sizes"]:
        cs = e["contenders"]
        any_ok = next((v for v in cs.values() if "error" not in v), None)
        if any_ok is None:
            continue
        st = any_ok["state"]
        lines.append(
            f"### {e['gib']:g} GiB state: {st['nbytes'] / GiB:.2f} GiB in {st['tensors']:,} "
            f"tensors ({st['small_tensors']:,} under 64 KiB), {st['bf16_bytes'] / GiB:.2f} GiB "
            f"bf16 + {st['fp32_bytes'] / GiB:.2f} GiB fp32; median of {cfg['runs']} runs"
        )
        lines.append("")
        lines.append(
            "| contender | call returns | staged (immediate) | blocked, lazy "
            f"({cfg['compute_s']:g} s {cfg['compute']}) | committed on disk | "
            "peak extra host memory |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|")
        raw = None
        for name, v in cs.items():
            if "error" in v:
                lines.append(f"| {LABELS[name]} | failed: {v['error']} | | | | |")
                continue
            m = v["median"]
            mem = v["peak_extra_bytes"]
            lines.append(
                f"| {v['label']} | {_fmt_s(m.get('returns_s'))} | {_fmt_s(m.get('staged_s'))} | "
                f"{_fmt_s(m.get('lazy_blocked_s'))} | {_fmt_s(m.get('committed_s'))} | "
                f"{mem / MiB:,.0f} MiB |"
            )
            if v.get("raw_write") and raw is None:
                raw = v["raw_write"]["median"]
        if raw:
            lines.append(f"| raw write + fsync (same bytes) | | | | {_fmt_s(raw['total_s'])} | |")
        for name, why in e.get("skipped", {}).items():
            lines.append(f"| {LABELS[name]} | skipped: {why} | | | | |")
        lines.append("")
        summ = e.get("summary", {})
        for tk, sp in summ.get("speedup_immediate", {}).items():
            lz = summ["speedup_lazy"][tk]
            parts = [f"{b}: {_fmt_x(sp[b])} / {_fmt_x(lz[b])}" for b in sp]
            lines.append(f"{LABELS[tk]} blocks less than (immediate / lazy): " + ", ".join(parts))
            lines.append("")
        for tk in ("tierckpt_256m", "tierckpt_default"):
            t = cs.get(tk)
            if t and "error" not in t:
                m = t["median"]
                lines.append(
                    f"{LABELS[tk]}: arena {(t.get('arena_bytes') or 0) / MiB:,.0f} MiB, "
                    f"committed / raw write+fsync = {m.get('committed_over_raw', 0):.2f}x "
                    f"(median of per-run ratios), raw {_fmt_s(m.get('raw_total_s'))}"
                )
                bd = t.get("breakdown") or {}
                if bd and "error" not in bd:
                    lines.append(
                        "  breakdown of one immediate save (busy seconds per stage): "
                        + ", ".join(
                            f"{k.removesuffix('_s')} {_fmt_s(bd[k])}"
                            for k in (
                                "plan_s",
                                "arena_wait_s",
                                "copy_s",
                                "checksum_encode_s",
                                "pwrite_s",
                                "fsync_rename_s",
                            )
                            if k in bd
                        )
                        + f"; build_plan alone {_fmt_s(bd.get('plan_only_median_s'))}"
                    )
                lines.append("")
    tr = result.get("train")
    if tr and tr.get("variants"):
        vs = tr["variants"]
        lines.append(
            f"### Training loop: {cfg['train_layers']}-layer d={cfg['train_dmodel']} transformer "
            f"({tr['params'] / 1e6:.1f} M parameters, {tr['torch_threads']} torch threads), "
            f"checkpoint every {tr['every']} steps ({tr['state_bytes'] / MiB:.0f} MiB); the "
            f"variants take turns in blocks of {tr['block_steps']} steps, {tr['rounds']} rounds "
            "in ABBA order after a warm-up round"
        )
        lines.append("")
        lines.append(
            "| variant | mean iteration | vs none (means) | vs none (median of rounds) "
            "| median | p95 | max | blocked per checkpoint | committed |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        summ = tr.get("summary", {})
        for name, v in vs.items():
            lines.append(
                f"| {v['label']} | {_fmt_s(v['mean_iter_s'])} | "
                f"{_fmt_x(_get(summ, 'mean_iter_over_none', name))} | "
                f"{_fmt_x(_get(summ, 'paired_median_over_none', name))} | "
                f"{_fmt_s(v['median_iter_s'])} | {_fmt_s(v['p95_iter_s'])} | "
                f"{_fmt_s(v['max_iter_s'])} | {_fmt_s(v.get('blocked_s_median'))} | "
                f"{_fmt_s(v['commit_s_median'])} |"
            )
        lines.append("")
    elif tr:
        lines.append(f"Training loop failed: {tr.get('error')}")
        lines.append("")
    if result.get("targets"):
        lines.append("### Targets")
        lines.append("")
        lines.append("| target | met | measured |")
        lines.append("|---|---|---|")
        for t in result["targets"]:
            lines.append(f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |")
        lines.append("")
    return "\n".join(lines)


# -- command line ---------------------------------------------------------------------------


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _names(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt bench",
        description="Benchmark tierckpt saves against torch.save, DCP and torch-checkpointing.",
    )
    d = BenchConfig()
    p.add_argument(
        "--sizes",
        type=_floats,
        default=d.sizes_gib,
        help="state sizes in GiB, comma separated (fractions allowed; default 1,4)",
    )
    p.add_argument("--runs", type=int, default=d.runs, help="measured saves per contender")
    p.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured saves first")
    p.add_argument(
        "--compute-s",
        type=float,
        default=d.compute_s,
        help="simulated forward/backward of the lazy case, seconds (default 1)",
    )
    p.add_argument(
        "--compute",
        choices=("sleep", "busy"),
        default=d.compute,
        help="lazy-case compute: sleep (host idle, as with a GPU) or busy CPU matmuls",
    )
    p.add_argument(
        "--arena-mib",
        type=int,
        default=d.arena_bytes // MiB,
        help="arena of the bounded-memory tierckpt row (default 256)",
    )
    p.add_argument(
        "--contenders",
        type=_names,
        default=d.contenders,
        help=f"comma separated, from {','.join(SAVE_CONTENDERS)}",
    )
    p.add_argument(
        "--train",
        type=_names,
        default=d.train_variants,
        help=f"training variants from {','.join(TRAIN_VARIANTS)}; '' to skip",
    )
    p.add_argument("--train-steps", type=int, default=d.train_steps)
    p.add_argument(
        "--train-every",
        type=int,
        default=d.train_every,
        help="checkpoint every k steps in the training loop",
    )
    p.add_argument("--train-layers", type=int, default=d.train_layers)
    p.add_argument("--train-dmodel", type=int, default=d.train_dmodel)
    p.add_argument(
        "--train-threads",
        type=int,
        default=d.train_threads,
        help="torch threads of the training loop (default: torch's own choice)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where to write (default: the temp dir if it is on the same disk as "
        "the current directory and not tmpfs, else the current directory)",
    )
    p.add_argument(
        "--no-breakdown",
        action="store_true",
        help="skip the instrumented diagnostic save of tierckpt",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return replace(
        BenchConfig(),
        sizes_gib=tuple(a.sizes),
        runs=a.runs,
        warmup=a.warmup,
        compute_s=a.compute_s,
        compute=a.compute,
        arena_bytes=a.arena_mib * MiB,
        contenders=tuple(a.contenders),
        train_variants=tuple(a.train),
        train_steps=a.train_steps,
        train_every=a.train_every,
        train_layers=a.train_layers,
        train_dmodel=a.train_dmodel,
        train_threads=a.train_threads,
        directory=a.dir,
        breakdown=not a.no_breakdown,
        seed=a.seed,
    )


def main(argv: list[str] | None = None) -> int:
    """``tierckpt bench``: run the benchmark, print the tables, write JSON (``--json``)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    if args.worker is not None:
        return _worker_main(args.worker)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"tierckpt bench: {exc}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run_bench(cfg, log=log, argv=args_list)
    table = format_table(result)
    print(table)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json_path}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    failed = [c for e in result["sizes"] for c, v in e["contenders"].items() if "error" in v]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
