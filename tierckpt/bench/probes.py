"""Measuring instruments: host memory of the process tree, a raw write + fsync of the same
bytes, the filesystem under a folder, and the simulated compute of the lazy case."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

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


def fsync_tree(root: Path) -> None:
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


def empty_dir(root: Path) -> None:
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


# -- medians --------------------------------------------------------------------------------


def median(xs: Sequence[float]) -> float | None:
    """The median, or None for no values."""
    return statistics.median(xs) if xs else None


def medians(records: list[dict[str, float]]) -> dict[str, float | None]:
    """Per key, the median over the records that have it."""
    keys = sorted({k for r in records for k in r})
    return {k: median([r[k] for r in records if k in r]) for k in keys}
