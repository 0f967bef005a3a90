"""Time to restore the whole job's state after each kind of failure, from each tier.

``--ranks`` processes (gloo on 127.0.0.1), each a "node" with its own node-RAM folder in
/dev/shm and its own disk folder, save ``--size`` bytes each once through the documented
recipe ``[NodeRamTier, PeerTier(replicas=1), LocalTier, S3Tier]`` (S3: SeaweedFS on
127.0.0.1). Then, in the same processes, each failure kind and the restore it leaves:

==================  =========================================================================
process crash       every rank loads with the whole recipe: each shard from its node's RAM
process crash,      the same read with a policy of only the NodeRamTier: the tier's own cost,
node RAM alone      without listing the slower tiers and the partners' agreement
process crash,      the same, ``NodeRamTier(map=False)``: the shard read (copied) into fresh
node RAM copied     tensors, as before restores mapped the segment copy-on-write
node lost           rank 1's node RAM and disk are wiped: its shard is pulled from its
                    partner's RAM, the others read their own RAM (the job's time is the
                    slowest rank's)
all RAM lost,       a policy of only the local disk and S3, each shard from local disk, the
cold                disk files evicted from the page cache first (``fsync`` then
                    ``posix_fadvise(DONTNEED)``; ``/proc/sys/vm/drop_caches`` where that left
                    pages behind and it is writable), the eviction checked with ``mincore``:
                    what a restarted job reads on a real node, where the training process's
                    memory pressure (and, after a reboot, the reboot) has evicted them
all RAM lost,       the same, the files read once just before (every page resident, checked
warm                with ``mincore``): the best case for the disk, a restart right after a save
cluster lost        a policy of only S3: each shard from SeaweedFS on 127.0.0.1
==================  =========================================================================

Baselines measured in the same run, in the same processes: a plain memory copy of each
rank's state into fresh memory (what a restore into new tensors cannot beat), all ranks at
once; and the loopback bandwidth of a gloo send of the same bytes between two ranks (rank 0
to rank 1, one message, the fastest of ``--repeat`` after a warm-up send), twice: into a
buffer whose pages the warm-up already allocated (the best case of the wire), and into a new
tmpfs file in the receiver's node-RAM folder, mapped shared, whose pages the receive
allocates — what a pull does, since a replacement node's memory is empty. The partner pull
(``RestoreReport.pull_seconds``: rank 1's exchange with its partner, handshakes and the
file's rename included, not the agreement) is timed twice, the fastest of ``--repeat`` each:
alone (every rank runs the load's agreement and pulls, then nothing: the other ranks idle,
as in the loopback sends; this is the figure set against the loopback) and inside the
"node lost" restore, where the other three ranks read their own shards meanwhile — on this
machine's shared CPUs, where each node would have its own.

A restore's time runs from a barrier before ``load()`` to the last rank's return (building the
``Checkpointer`` is outside it). A node-RAM restore maps the segment and verifies every chunk's
checksum (which reads every byte) before ``load()`` returns; so that lazy mapping cannot
flatter it, every restore is also timed to the end of a read of every byte of the restored
state right after it (``restore + touch``, each rank summing its tensors): that figure holds
whatever a mapping defers to the first access. Prints a markdown table; ``--json`` writes the
numbers.

    python benchmarks/bench_recovery.py [--quick] [--ranks 4] [--size 256MiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _state(rank: int, size: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    n = size // 4
    parts = 4  # a few tensors, like layers
    return {f"layer{i}": torch.randn(n // parts, generator=g) for i in range(parts)}


def _files(folder: str) -> list[str]:
    return [os.path.join(d, f) for d, _dirs, files in os.walk(folder) for f in files]


_libc: Any = None


def _mincore_fn() -> Any:
    """libc's ``mmap``, ``mincore`` and ``munmap`` through ctypes (None where unavailable)."""
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            _libc = libc
        except (OSError, AttributeError):
            _libc = False
    return _libc or None


def resident_bytes(folder: str) -> tuple[int, int] | None:
    """(bytes of the folder's files in the page cache, bytes of its files), by ``mincore``
    on a shared read-only map of each file (mapping faults nothing in); None without it."""
    libc = _mincore_fn()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in _files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                continue
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                    return None
                resident += min(size, sum(b & 1 for b in vec) * page)
                total += size
            finally:
                libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
    return resident, total


def _evict(folder: str) -> str:
    """Drop a folder's pages from the page cache, so that a read goes to the disk; returns
    how (``fadvise``, ``drop_caches``) and what ``mincore`` says is left resident."""
    for path in _files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how = "fadvise"
    res = resident_bytes(folder)
    if (
        res is not None
        and res[0] > res[1] // 100
        and os.access("/proc/sys/vm/drop_caches", os.W_OK)
    ):
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")  # the whole machine's clean page cache: only when fadvise did not do
        how = "drop_caches"
        res = resident_bytes(folder)
    return how if res is None else f"{how}, {res[0] / max(1, res[1]):.1%} resident"


def _warm(folder: str) -> str:
    """Read a folder's files once, so that every page is in the page cache."""
    for path in _files(folder):
        with open(path, "rb") as f:
            while f.read(8 << 20):
                pass
    res = resident_bytes(folder)
    return "read once" if res is None else f"read once, {res[0] / max(1, res[1]):.1%} resident"


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], out: str) -> None:
    import faulthandler

    trace = open(os.path.join(out, f"stacks-{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.dump_traceback_later(cfg["timeout"], exit=True, file=trace)
    try:
        res = _phases(rank, world, port, cfg)
        Path(out, f"rank-{rank}.json").write_text(json.dumps(res))
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
    sys.stdout.flush()
    os._exit(0)


def _phases(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from tierckpt import Checkpointer, LocalTier, NodeRamTier, PeerTier, S3Tier
    from tierckpt.distributed import wait_committed
    from tierckpt.noderam import node_ram_usage

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    size, shm, disk = cfg["size"], cfg["shm"], cfg["disk"]
    ram_path = os.path.join(shm, f"node-{rank}")
    disk_path = os.path.join(disk, f"node-{rank}")
    s3_url = f"s3://{cfg['bucket']}/run"
    kw = {"chunk_bytes": 32 * MiB, "host_buffer_bytes": max(256 * MiB, 2 * size)}

    def ram(map: bool = True) -> Any:
        return NodeRamTier(path=ram_path, namespace="job", stale_after_s=None, map=map)

    def recipe() -> list[Any]:
        return [
            ram(),
            PeerTier(replicas=1, timeout_s=120),
            LocalTier(disk_path),
            S3Tier(s3_url, endpoint_url=cfg["endpoint"], codec="raw", max_attempts=10),
        ]

    state = _state(rank, size)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    out: dict[str, Any] = {"bytes": nbytes}

    # -- save once through the recipe, replicas included --------------------------------
    ck = Checkpointer(recipe(), **kw)
    ck.save(state, 1).wait(timeout=600)
    wait_committed(ck.backend("s3"), 1, timeout=600)
    assert ck._peer is not None and ck._peer.wait_idle(600)
    dist.barrier()
    out["replica_bytes"] = node_ram_usage(os.path.join(ram_path, "job.replicas"))
    out["node_ram_bytes"] = node_ram_usage(os.path.join(ram_path, "job")) - out["replica_bytes"]
    ck.close()

    def timed(fn: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        mine = time.perf_counter() - t0
        t = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the job's time: its slowest rank
        return float(t.item())

    # -- baselines ------------------------------------------------------------------------
    copies: list[Any] = []
    memcpy = []
    for _ in range(cfg["repeat"]):
        memcpy.append(timed(lambda: copies.append({k: v.clone() for k, v in state.items()})))
        copies.clear()
    out["memcpy_s"] = min(memcpy)
    group = dist.new_group(backend="gloo")
    flat = torch.cat([v.view(-1) for v in state.values()]).view(torch.uint8)
    buf = torch.empty_like(flat)

    def loopback() -> None:
        if rank == 0:
            dist.send(flat, 1, group=group)
        elif rank == 1:
            dist.recv(buf, 0, group=group)

    loopback()  # warm the pair's connection
    out["loopback_s"] = min(timed(loopback) for _ in range(cfg["repeat"]))
    # the same send into fresh node RAM: a new tmpfs file of the same size, mapped shared,
    # its pages allocated by the receive (a replacement node's memory is empty), as a pull
    # receives; the warm send above reuses a buffer whose pages are already there
    landed: list[Any] = []

    def loopback_fresh() -> None:
        if rank == 0:
            dist.send(flat, 1, group=group)
        elif rank == 1:
            os.makedirs(ram_path, exist_ok=True)
            path = os.path.join(ram_path, f"loopback-{len(landed)}.tmp")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fd, flat.numel())
            mm = mmap.mmap(fd, flat.numel(), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            dist.recv(torch.frombuffer(mm, dtype=torch.uint8), 0, group=group)
            landed.append((path, fd, mm))

    fresh = []
    for _ in range(cfg["repeat"]):
        fresh.append(timed(loopback_fresh))
        for path, fd, mm in landed:  # freeing the pages is outside the time
            try:
                mm.close()
            except BufferError:
                pass
            os.close(fd)
            os.unlink(path)
        landed.clear()
    out["loopback_fresh_s"] = min(fresh)

    def load_with(tiers: list[Any], check: bool = True) -> tuple[tuple[float, float], Any]:
        """(restore, restore + a read of every restored byte), each the slowest rank's."""
        c = Checkpointer(tiers, **kw)
        dist.barrier()
        t0 = time.perf_counter()
        got = c.load()
        t1 = time.perf_counter()
        for v in got.values():  # touch every byte once: sum() reads each element
            v.sum()
        t2 = time.perf_counter()
        t = torch.tensor([t1 - t0, t2 - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the job's time: its slowest rank
        report = c._peer.last_restore if c._peer is not None else None
        c.close()
        if check:
            for k, v in state.items():
                assert torch.equal(got[k], v), k
        return (float(t[0]), float(t[1])), report

    cache_state: dict[str, list[str]] = {"cold": [], "warm": []}

    def once(
        tiers: list[Any], before: Any = None, cache: str = ""
    ) -> tuple[tuple[float, float], Any]:
        dist.barrier()
        if before is not None:
            said = before()
            if cache:
                cache_state[cache].append(said)
        dist.barrier()
        return load_with(tiers)

    def lose_node() -> None:
        if rank == 1:
            shutil.rmtree(ram_path, ignore_errors=True)  # the pulled copy of the last try too
            os.rename(disk_path, disk_path + ".lost")  # put back after, for the next tries

    def find_node() -> None:
        if rank == 1:
            shutil.rmtree(disk_path, ignore_errors=True)
            os.rename(disk_path + ".lost", disk_path)

    def pull_alone() -> float:
        """Rank 1's partner pull with the other ranks idle, as in the loopback sends (in the
        node-lost restore, the other ranks read their own shards meanwhile, on the same CPUs
        here, where each node would have its own): every rank runs the load's agreement and
        the pulls (``prepare_load``), and no load."""
        dist.barrier()
        lose_node()
        c = Checkpointer(recipe(), **kw)
        assert c._peer is not None
        dist.barrier()
        c._peer.prepare_load(None, None)
        rep = c._peer.last_restore
        c.close()
        find_node()
        mine = rep.pull_seconds if rep is not None and rank == 1 else 0.0
        t = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    alone: list[float] = []
    s3_only = [S3Tier(s3_url, endpoint_url=cfg["endpoint"])]
    kinds: dict[str, list[tuple[tuple[float, float], Any]]] = {
        "crash": [],
        "ram_only": [],
        "ram_copy": [],
        "local": [],
        "local_warm": [],
        "lost": [],
        "s3": [],
    }
    # the kinds take turns, so that a busy moment of the machine slows each the same; the
    # fastest try of each counts (a loaded machine only ever slows a restore down)
    for _ in range(cfg["repeat"]):
        # process crash: the whole recipe, every shard in its node's RAM
        kinds["crash"].append(once(recipe()))
        # the same read with a policy of node RAM alone: the tier's own cost, without the
        # recipe's listing of the slower tiers and the partners' agreement
        kinds["ram_only"].append(once([ram()]))
        # ... and read into fresh tensors (a copy) instead of mapped
        kinds["ram_copy"].append(once([ram(map=False)]))
        # all RAM lost: only the local disk (and S3) left, the disk's pages evicted (cold)...
        disk_only = [LocalTier(disk_path), *s3_only]
        kinds["local"].append(once(disk_only, lambda: _evict(disk_path), "cold"))
        # ... and with every page in the page cache (warm)
        kinds["local_warm"].append(once(disk_only, lambda: _warm(disk_path), "warm"))
        # node lost: rank 1's RAM and disk gone: its shard from its partner's RAM
        kinds["lost"].append(once(recipe(), lose_node))
        find_node()
        alone.append(pull_alone())
        # cluster lost: S3 only
        kinds["s3"].append(once(s3_only))
    fastest = {k: min(v, key=lambda r: r[0][0]) for k, v in kinds.items()}
    for k, v in kinds.items():
        out[f"{k}_s"] = fastest[k][0][0]
        out[f"{k}_touch_s"] = min(r[0][1] for r in v)  # fastest restore + touch
    rep = fastest["crash"][1]
    out["crash_sources"] = list(rep.sources)
    out["cache_state"] = cache_state
    rep = fastest["lost"][1]
    out["node_lost_sources"] = list(rep.sources)
    out["pulled_bytes"] = rep.pulled_bytes
    # the fastest pull of the tries (as the loopback sends: the fastest of as many)
    out["pull_s"] = min(r[1].pull_seconds for r in kinds["lost"])
    out["pull_alone_s"] = min(alone)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_s3 import parse_size

    from tierckpt.testing.s3servers import start_seaweedfs

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 ranks x 64 MiB (under a minute)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size", type=parse_size, default=256 * MiB, help="state bytes per rank")
    ap.add_argument("--dir", default=None, help="folder for the disks (default: temp)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--repeat", type=int, default=3, help="restores per kind; the fastest counts")
    ap.add_argument("--timeout", type=float, default=900, help="a rank that hangs ends (s)")
    args = ap.parse_args(argv)
    if args.quick:
        args.ranks, args.size, args.repeat = 2, 64 * MiB, 2
    if args.ranks < 2:
        ap.error("--ranks must be at least 2 (a partner is another rank)")
    shm = f"/dev/shm/tierckpt-bench-{uuid.uuid4().hex[:8]}"
    os.makedirs(shm)
    t_start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-recovery-") as tmp:
            server = start_seaweedfs(Path(tmp) / "weed")
            try:
                server.admin.create_bucket(Bucket="bench")
                os.environ["AWS_ACCESS_KEY_ID"] = server.access_key
                os.environ["AWS_SECRET_ACCESS_KEY"] = server.secret_key
                os.environ["AWS_DEFAULT_REGION"] = server.region
                # each "node" has its own disk folder: the local tier commits per node
                os.environ["TIERCKPT_PRIVATE_TIERS"] = "local"
                cfg = {
                    "size": args.size,
                    "shm": shm,
                    "disk": str(Path(tmp) / "disk"),
                    "bucket": "bench",
                    "endpoint": server.endpoint_url,
                    "timeout": args.timeout,
                    "repeat": args.repeat,
                }
                results = _launch(args.ranks, cfg, Path(tmp) / "out")
            finally:
                server.stop()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    summary = _summary(results, args.ranks, args.size, args.repeat)
    summary["wall_s"] = time.perf_counter() - t_start
    print(_table(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def _launch(world: int, cfg: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, cfg, str(out))) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(cfg["timeout"] + 30)
    stacks = [out / f"stacks-{r}.txt" for r in range(world)]
    hung = [s.read_text() for s in stacks if s.exists() and s.stat().st_size]
    if hung:
        raise RuntimeError("a rank hung:\n" + "\n".join(hung))
    errors = [(out / f"error-{r}.txt") for r in range(world)]
    bad = [e.read_text() for e in errors if e.exists()]
    if bad:
        raise RuntimeError("a rank failed:\n" + "\n".join(bad))
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


def _summary(results: list[dict[str, Any]], world: int, size: int, repeat: int) -> dict[str, Any]:
    r0 = results[0]
    total = sum(r["bytes"] for r in results)
    rows = {
        "process crash": ("NodeRamTier (own node RAM, mapped)", "crash"),
        "process crash, node RAM alone": ("NodeRamTier, no other tier listed", "ram_only"),
        "process crash, node RAM copied": (
            "NodeRamTier(map=False), alone: read into copies",
            "ram_copy",
        ),
        "node lost": ("PeerTier (rank 1 from its partner)", "lost"),
        "all RAM lost, cold": ("LocalTier (local disk, page cache evicted)", "local"),
        "all RAM lost, warm": ("LocalTier (local disk, in the page cache)", "local_warm"),
        "cluster lost": ("S3Tier (SeaweedFS, 127.0.0.1)", "s3"),
    }
    pulled = results[1]
    pull_gbps = pulled["pulled_bytes"] / pulled["pull_s"] / 1e9 if pulled["pull_s"] else 0.0
    alone_gbps = pulled["pulled_bytes"] / r0["pull_alone_s"] / 1e9 if r0["pull_alone_s"] else 0.0
    loop_gbps = r0["bytes"] / r0["loopback_s"] / 1e9
    fresh_gbps = r0["bytes"] / r0["loopback_fresh_s"] / 1e9
    local, local_t = r0["local_s"], r0["local_touch_s"]
    return {
        "ranks": world,
        "arena_bytes": max(256 * MiB, 2 * size),
        "repeat": repeat,
        "bytes_per_rank": size,
        "job_bytes": total,
        "rows": {
            k: {
                "tier": t,
                "seconds": r0[f"{key}_s"],
                "touch_seconds": r0[f"{key}_touch_s"],
                "gbps": total / r0[f"{key}_s"] / 1e9,
            }
            for k, (t, key) in rows.items()
        },
        "memcpy_s": r0["memcpy_s"],
        "memcpy_gbps": total / r0["memcpy_s"] / 1e9,
        "loopback_gbps": loop_gbps,
        "loopback_fresh_gbps": fresh_gbps,
        "pull_gbps": pull_gbps,
        "pull_alone_gbps": alone_gbps,
        "crash_sources": r0["crash_sources"],
        "node_lost_sources": r0["node_lost_sources"],
        "cache_state": {f"rank {i}": r["cache_state"] for i, r in enumerate(results)},
        "node_ram_bytes": [r["node_ram_bytes"] for r in results],
        "replica_bytes": [r["replica_bytes"] for r in results],
        "ratios": {
            "node_ram_vs_local": local / r0["crash_s"],
            "node_ram_vs_local_warm": r0["local_warm_s"] / r0["crash_s"],
            "node_ram_alone_vs_local": local / r0["ram_only_s"],
            "node_ram_alone_vs_local_warm": r0["local_warm_s"] / r0["ram_only_s"],
            # touched: both restores followed by a read of every byte
            "node_ram_vs_local_touched": local_t / r0["crash_touch_s"],
            "node_ram_alone_vs_local_touched": local_t / r0["ram_only_touch_s"],
            # strict: the node-RAM restore + touch against the disk's bare restore
            "node_ram_touched_vs_local_bare": local / r0["crash_touch_s"],
            "node_ram_alone_touched_vs_local_bare": local / r0["ram_only_touch_s"],
            "node_ram_copied_vs_local": local / r0["ram_copy_s"],
            "node_ram_vs_memcpy": r0["memcpy_s"] / r0["crash_s"],
            "node_ram_touched_vs_memcpy": r0["memcpy_s"] / r0["crash_touch_s"],
            "node_ram_alone_vs_memcpy": r0["memcpy_s"] / r0["ram_only_s"],
            "node_ram_alone_touched_vs_memcpy": r0["memcpy_s"] / r0["ram_only_touch_s"],
            "partner_pull_vs_loopback": alone_gbps / loop_gbps if loop_gbps else 0.0,
            "partner_pull_vs_loopback_fresh": alone_gbps / fresh_gbps if fresh_gbps else 0.0,
            "partner_pull_in_restore_vs_loopback": pull_gbps / loop_gbps if loop_gbps else 0.0,
            "node_ram_vs_s3": r0["s3_s"] / r0["crash_s"],
        },
    }


def _met(x: float, target: float) -> str:
    return "met" if x >= target else "NOT met"


def _table(s: dict[str, Any]) -> str:
    mib = s["bytes_per_rank"] / MiB
    cold = s["rows"]["all RAM lost, cold"]
    local_s, local_t = cold["seconds"], cold["touch_seconds"]
    lines = [
        f"{s['ranks']} ranks x {mib:.0f} MiB = {s['job_bytes'] / MiB:.0f} MiB job state; "
        f"restore time = slowest rank, from a barrier to load() returning; restore + touch = "
        f"to the end of a read of every restored byte (fastest of {s['repeat']} each); "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        "",
        "| failure | restored from | restore (s) | GB/s | local disk (cold) / this | "
        "restore + touch (s) | local disk (cold) + touch / this + touch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, row in s["rows"].items():
        lines.append(
            f"| {kind} | {row['tier']} | {row['seconds']:.3f} | {row['gbps']:.2f} | "
            f"{local_s / row['seconds']:.1f}x | {row['touch_seconds']:.3f} | "
            f"{local_t / row['touch_seconds']:.1f}x |"
        )
    lines.append(
        f"| (baseline) | plain memory copy, all ranks at once | {s['memcpy_s']:.3f} | "
        f"{s['memcpy_gbps']:.2f} | {local_s / s['memcpy_s']:.1f}x | (a copy touches all) | "
        f"{local_t / s['memcpy_s']:.1f}x |"
    )
    r = s["ratios"]
    per_node = max(s["node_ram_bytes"]) / MiB
    replicas = max(s["replica_bytes"]) / MiB
    lines += [
        "",
        f"- node RAM (mapped) vs local disk, cold: restore {r['node_ram_vs_local']:.1f}x "
        f"(target >= 5x: {_met(r['node_ram_vs_local'], 5)}); both + touch "
        f"{r['node_ram_vs_local_touched']:.1f}x ({_met(r['node_ram_vs_local_touched'], 5)}); "
        f"strict, node RAM + touch vs the disk's bare restore "
        f"{r['node_ram_touched_vs_local_bare']:.1f}x "
        f"({_met(r['node_ram_touched_vs_local_bare'], 5)}); warm (files in the page cache) "
        f"{r['node_ram_vs_local_warm']:.1f}x; vs S3: {r['node_ram_vs_s3']:.1f}x",
        f"- node RAM alone (no slower tier listed) vs local disk, cold: restore "
        f"{r['node_ram_alone_vs_local']:.1f}x, both + touch "
        f"{r['node_ram_alone_vs_local_touched']:.1f}x, strict "
        f"{r['node_ram_alone_touched_vs_local_bare']:.1f}x; warm "
        f"{r['node_ram_alone_vs_local_warm']:.1f}x; node RAM read into copies (map=False): "
        f"{r['node_ram_copied_vs_local']:.1f}x",
        f"- page cache before the local-disk restores (rank 0, each try): cold "
        f"{s['cache_state']['rank 0']['cold']}; warm {s['cache_state']['rank 0']['warm']}",
        f"- node RAM vs a plain memory copy (target >= 0.5x): recipe {r['node_ram_vs_memcpy']:.2f}x"
        f", + touch {r['node_ram_touched_vs_memcpy']:.2f}x; alone {r['node_ram_alone_vs_memcpy']:.2f}x"
        f", + touch {r['node_ram_alone_touched_vs_memcpy']:.2f}x",
        f"- partner pull (the other ranks idle, as in the loopback sends) "
        f"{s['pull_alone_gbps']:.2f} GB/s vs gloo loopback {s['loopback_gbps']:.2f} GB/s (into"
        f" a warm buffer): {r['partner_pull_vs_loopback']:.2f}x (target >= 0.5x: "
        f"{_met(r['partner_pull_vs_loopback'], 0.5)}); vs the same send into fresh node RAM "
        f"{s['loopback_fresh_gbps']:.2f} GB/s (a new tmpfs file, as a pull receives): "
        f"{r['partner_pull_vs_loopback_fresh']:.2f}x; the pull inside the node-lost restore "
        f"(the other ranks restoring on the same {os.cpu_count()} CPUs meanwhile) "
        f"{s['pull_gbps']:.2f} GB/s: {r['partner_pull_in_restore_vs_loopback']:.2f}x",
        f"- memory per node: {per_node:.0f} MiB of node RAM for its own checkpoint "
        f"(keep_last=2 holds up to 3) + {replicas:.0f} MiB of partner replicas (PeerTier "
        f"keep_last=1): {(per_node + replicas) / mib:.2f}x the node's state; host arena "
        f"{s['arena_bytes'] / MiB:.0f} MiB besides",
        f"- sources after a crash: {s['crash_sources']}; after a lost node: "
        f"{s['node_lost_sources']}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
