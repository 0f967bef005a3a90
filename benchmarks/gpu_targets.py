"""Issue 14's GPU targets that gpu_check.py and gpu_codecs.py do not cover, with one JSON line
of results and a non-zero exit when a measured target is missed:

- restore onto the GPU from the local tier (``load(map_location="cuda")``) against the disk's
  sequential read rate measured in the same run (target >= 0.8x);
- restore onto the GPU from host RAM (memory tier) against pinned H2D bandwidth (>= 0.7x);
- restore into existing CUDA tensors (``load(into=...)``) from host RAM: GB/s, exactness;
- ranks on one node: each process makes CUDA contexts only on its own device
  (``nvidia-smi --query-compute-apps``); 2 processes on one GPU when there is only one.

Without CUDA (``--dry-run`` or no GPU) every check reports "not measured" and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

GB = 1e9


def _state(nbytes: int, device: str) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(0)
    n = max(1, nbytes // 2 // (64 << 20))
    big = {f"w{i}": torch.randn(32 << 20, device=device, generator=g).bfloat16() for i in range(n)}
    small = {f"s{i}": torch.randn(1000 + i, device=device, generator=g) for i in range(1000)}
    return {"big": big, "small": small, "step": 1}


def pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / GB


def _drop_cache(folder: Path) -> None:
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_gbps(folder: Path, nbytes: int) -> float:
    path = folder / "seq.bin"
    block = os.urandom(1 << 20) * 64
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
    _drop_cache(folder)
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while n := f.readinto(buf):
            total += n
    seconds = time.perf_counter() - t0
    path.unlink()
    return total / seconds / GB


def restore_checks(nbytes: int, folder: Path) -> dict[str, Any]:
    from tierckpt import Checkpointer, LocalTier, MemoryTier

    out: dict[str, Any] = {}
    state = _state(nbytes, "cuda")
    raw = sum(t.nbytes for d in (state["big"], state["small"]) for t in d.values())
    out["state_bytes"] = raw
    out["disk_read_gbps"] = disk_read_gbps(folder, raw)
    out["pinned_h2d_gbps"] = pinned_h2d_gbps()
    local = folder / "local"
    with Checkpointer([LocalTier(local)]) as ck:
        ck.save(state, step=1).wait()
        _drop_cache(local)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = ck.load(map_location="cuda")
        torch.cuda.synchronize()
        out["restore_local_gbps"] = raw / (time.perf_counter() - t0) / GB
        out["restore_local_exact"] = bool(torch.equal(got["big"]["w0"], state["big"]["w0"]))
        del got
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)]) as ck:
        ck.save(state, step=1).wait()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = ck.load(map_location="cuda")
        torch.cuda.synchronize()
        out["restore_ram_gbps"] = raw / (time.perf_counter() - t0) / GB
        out["restore_ram_exact"] = bool(torch.equal(got["small"]["s7"], state["small"]["s7"]))
        del got
        # into existing CUDA tensors (a resumed job's model): through a fresh device copy,
        # then device to device once everything is verified
        target = {
            "big": {k: torch.empty_like(v) for k, v in state["big"].items()},
            "small": {k: torch.empty_like(v) for k, v in state["small"].items()},
            "step": 0,
        }
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ck.load(into=target)
        torch.cuda.synchronize()
        out["restore_into_gbps"] = raw / (time.perf_counter() - t0) / GB
        out["restore_into_exact"] = bool(
            torch.equal(target["big"]["w0"], state["big"]["w0"])
            and torch.equal(target["small"]["s9"], state["small"]["s9"])
        )
        del target
    out["restore_local_ratio"] = out["restore_local_gbps"] / out["disk_read_gbps"]
    out["restore_ram_ratio"] = out["restore_ram_gbps"] / out["pinned_h2d_gbps"]
    return out


_CHILD = r"""
import os, sys, time, torch, uuid
from tierckpt import Checkpointer, LocalTier
dev = int(sys.argv[1]); folder = sys.argv[2]; flag = sys.argv[3]
torch.cuda.set_device(dev)
state = {"w": torch.randn(8 << 20, device="cuda").bfloat16(), "step": 1}
with Checkpointer([LocalTier(os.path.join(folder, str(os.getpid())), codec="zstd")],
                  chunk_bytes=4 << 20) as ck:
    ck.save(state, step=1).wait()
    print(os.getpid(), flush=True)
    while not os.path.exists(flag):
        time.sleep(0.1)
"""


def context_check(folder: Path) -> dict[str, Any]:
    """Each process's contexts are only on its device (ranks on one node)."""
    n_gpu = torch.cuda.device_count()
    procs_n = min(8, n_gpu) if n_gpu > 1 else 2
    flag = folder / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(i % n_gpu), str(folder), str(flag)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(procs_n)
    ]
    try:
        pids = [int((p.stdout.readline() if p.stdout else "0").strip() or 0) for p in procs]
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        bus_to_index = {
            line.split(",")[1].strip(): int(line.split(",")[0]) for line in q.splitlines()
        }
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    finally:
        flag.touch()
        for p in procs:
            p.wait(60)
    seen: dict[int, set[int]] = {}
    for line in apps.splitlines():
        pid, bus = (x.strip() for x in line.split(","))
        seen.setdefault(int(pid), set()).add(bus_to_index.get(bus, -1))
    wrong = {
        pid: sorted(seen.get(pid, set()))
        for i, pid in enumerate(pids)
        if seen.get(pid, set()) - {i % n_gpu}
    }
    return {"processes": procs_n, "gpus": n_gpu, "pids": pids, "wrong_devices": wrong}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gb", type=float, default=4.0, help="state size for the restore checks")
    p.add_argument("--json", type=Path)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    result: dict[str, Any] = {"checks": {}}
    checks: dict[str, Any] = result["checks"]
    if args.dry_run or not torch.cuda.is_available():
        for name in ("restore_local", "restore_ram", "restore_into", "contexts"):
            checks[name] = {"ok": None, "value": "not measured (no CUDA)"}
    else:
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
            folder = Path(tmp)
            try:
                r = restore_checks(int(args.gb * GB), folder)
                result["restore"] = r
                checks["restore_local"] = {
                    "ok": r["restore_local_ratio"] >= 0.8 and r["restore_local_exact"],
                    "value": f"{r['restore_local_ratio']:.2f}x disk read",
                }
                checks["restore_ram"] = {
                    "ok": r["restore_ram_ratio"] >= 0.7 and r["restore_ram_exact"],
                    "value": f"{r['restore_ram_ratio']:.2f}x pinned H2D",
                }
                checks["restore_into"] = {  # no target: reported, exactness checked
                    "ok": r["restore_into_exact"],
                    "value": f"{r['restore_into_gbps']:.1f} GB/s into CUDA tensors",
                }
            except Exception as exc:
                failed = {"ok": False, "value": repr(exc)}
                for name in ("restore_local", "restore_ram", "restore_into"):
                    checks[name] = failed
            try:
                c = context_check(folder)
                result["contexts"] = c
                checks["contexts"] = {
                    "ok": not c["wrong_devices"],
                    "value": f"{c['processes']} procs on {c['gpus']} GPU(s)",
                }
            except Exception as exc:
                checks["contexts"] = {"ok": False, "value": repr(exc)}
    line = json.dumps(result, default=str)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 1 if any(c["ok"] is False for c in checks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
