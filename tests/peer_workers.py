"""Per-rank functions of the node-RAM and peer-tier tests, and their launcher.

Every rank plays a node of its own: its node RAM is ``<shm>/node-<r>`` and its disk
``<disk>/node-<r>`` (so ``TIERCKPT_PRIVATE_TIERS=local``). ``run(fn, world, ...)`` works like
:func:`dist_workers.run` (gloo on 127.0.0.1, a forkserver that imported torch once), for the
functions of this module. Reads are counted per tier by wrapping each backend's read calls.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
from dist_workers import _free_port, _tail, rank_state, same

from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier, S3Tier
from tierckpt import distributed as tdist

NUMEL = 4096  # 4096 x 8 fp32 and the rest: ~140 KiB per rank
_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(["torch", "torch.distributed", "tierckpt", "peer_workers"])
    return _ctx


def run(
    fn: str,
    world: int,
    *,
    timeout: float = 120,
    expect_killed: tuple[int, ...] = (),
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` (a function of this module) on ``world`` ranks; every rank's result."""
    ctx = _context()
    out = Path(tempfile.mkdtemp(prefix=f"tierckpt-{fn}-"))
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "TIERCKPT_"))}
    env["TIERCKPT_PRIVATE_TIERS"] = "local"
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, port, str(out), env, kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    problems = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(5)
            problems.append(f"rank {r} still running after {timeout} s (killed)")
    results: list[Any] = []
    for r, p in enumerate(procs):
        res = out / f"result-{r}.json"
        if r in expect_killed:
            if p.exitcode != -signal.SIGKILL:
                problems.append(f"rank {r} should have been killed, exit code {p.exitcode}")
            results.append(None)
            continue
        if (out / f"error-{r}.txt").exists():
            problems.append(f"rank {r} raised:\n{(out / f'error-{r}.txt').read_text()}")
        elif p.exitcode != 0 or not res.exists():
            problems.append(f"rank {r} exit code {p.exitcode}, no result")
        results.append(json.loads(res.read_text()) if res.exists() else None)
    if problems:
        logs = "\n".join(f"--- rank {r}:\n" + _tail(out / f"log-{r}.txt") for r in range(world))
        raise AssertionError(f"{fn} on {world} ranks failed: " + "\n".join(problems) + "\n" + logs)
    return results


def _child(
    fn: str, rank: int, world: int, port: int, out: str, env: dict[str, str], kwargs: Any
) -> None:
    os.environ.update(env)
    fd = os.open(os.path.join(out, f"log-{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s rank{rank} %(threadName)s %(levelname)s %(message)s",
        force=True,
    )
    code = 0
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        # "module:function" names a worker of another test module (peer_fault_workers)
        mod, _, name = fn.rpartition(":")
        func = getattr(importlib.import_module(mod), name) if mod else globals()[fn]
        result = func(rank, world, **kwargs)
        Path(out, f"result-{rank}.json.tmp").write_text(json.dumps(result))
        os.replace(Path(out, f"result-{rank}.json.tmp"), Path(out, f"result-{rank}.json"))
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a dead peer can make gloo's destructor wait


# -- pieces ------------------------------------------------------------------------------------


def node_tiers(
    rank: int, shm: str, disk: str, s3: dict[str, str] | None, *, peer: bool = True
) -> list[Any]:
    """The documented recipe, with this rank's node folders."""
    out: list[Any] = [
        NodeRamTier(path=os.path.join(shm, f"node-{rank}"), namespace="job", stale_after_s=None)
    ]
    if peer:
        out.append(PeerTier(replicas=1, timeout_s=60))
    out.append(LocalTier(os.path.join(disk, f"node-{rank}"), keep_last=2))
    if s3:
        out.append(S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"]))
    return out


class ReadCounter:
    """Counts the read calls and bytes of each tier's backend (a wrapper on the instance)."""

    def __init__(self, ck: Checkpointer) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        for name in ck.tier_names:
            self._wrap(name, ck.backend(name))

    def _wrap(self, name: str, backend: Any) -> None:
        self.calls[name] = 0
        self.bytes[name] = 0
        read, read_into, get = backend.read, backend.read_into, backend.get
        pieces = backend.read_into_pieces  # the zero-copy load's scatter read

        def count(n: int) -> None:
            self.calls[name] += 1
            self.bytes[name] += n

        def c_read(obj: str, offset: int, length: int) -> Any:
            count(length)
            return read(obj, offset, length)

        def c_read_into(obj: str, offset: int, out: memoryview) -> None:
            count(out.nbytes)
            read_into(obj, offset, out)

        def c_get(obj: str) -> bytes:
            data = get(obj)
            count(len(data))
            return data

        def c_pieces(obj: str, offset: int, outs: Any) -> None:
            count(sum(memoryview(o).nbytes for o in outs))
            pieces(obj, offset, outs)

        backend.read, backend.read_into, backend.get = c_read, c_read_into, c_get
        backend.read_into_pieces = c_pieces


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- workers -----------------------------------------------------------------------------------


def w_save(
    rank: int,
    world: int,
    shm: str,
    disk: str,
    s3: dict[str, str] | None,
    victim: int,
    peer: bool = True,
) -> dict[str, Any]:
    """Save steps 1 and 2 on every tier, wait for the replicas, then ``victim`` SIGKILLs
    itself; the others end without closing (torchrun kills them)."""
    ck = Checkpointer(node_tiers(rank, shm, disk, s3, peer=peer), chunk_bytes=64 << 10)
    for step in (1, 2):
        ck.save(rank_state(rank, step, NUMEL), step).wait(timeout=60)
    if s3:
        tdist.wait_committed(ck.backend("s3"), 2, timeout=60)
    out: dict[str, Any] = {"steps": ck.tier_steps()}
    if ck._peer is not None:
        assert ck._peer.wait_idle(60)
        out["rounds"] = ck._peer.rounds
        out["received"] = ck._peer.received_bytes
    dist.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return out


def w_load(
    rank: int, world: int, shm: str, disk: str, s3: dict[str, str] | None, peer: bool = True
) -> dict[str, Any]:
    """A restarted rank: load the newest checkpoint, count where the bytes came from."""
    warned = Warnings()
    logging.getLogger("tierckpt").addHandler(warned)
    ck = Checkpointer(node_tiers(rank, shm, disk, s3, peer=peer), chunk_bytes=64 << 10)
    counter = ReadCounter(ck)
    got = ck.load()
    report = ck._peer.last_restore if ck._peer is not None else None
    out = {
        "step": got["meta"]["step"],
        "diff": same(got, rank_state(rank, 2, NUMEL)),
        "calls": dict(counter.calls),  # the load's reads (the save below reads leases)
        "bytes": dict(counter.bytes),
        "sources": list(report.sources) if report else None,
        "pulled": report.pulled_bytes if report else 0,
        "warnings": warned.messages,
    }
    # the restored job saves on: every tier, replicas included, goes on working
    ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=60)
    if ck._peer is not None:
        assert ck._peer.wait_idle(60)
    out["steps_after"] = ck.tier_steps()
    dist.barrier()
    ck.close()
    return out
