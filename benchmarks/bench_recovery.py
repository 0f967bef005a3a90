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

Baselines measured in the same run, in the same processes, in the same rounds as the
contenders (each round: memory copy, loopback, every failure kind, loopback into fresh node
RAM, the pulls alone, loopback again, S3; ``--repeat`` rounds), so that a busy moment of a
shared machine (or this VM's disk, served from host memory, changing speed) slows the
contender and its baseline alike: a plain memory copy of each rank's state into fresh memory
(what a restore into new tensors cannot beat), all ranks at once; and the loopback bandwidth
of a gloo send of the same bytes between two ranks (rank 0 to rank 1, one message, after a
warm-up send), into a buffer whose pages the warm-up already allocated (the best case of the
wire), and into a new tmpfs file in the receiver's node-RAM folder, mapped shared, whose
pages the receive allocates. The partner pull (``RestoreReport.pull_seconds``: rank 1's
exchange with its partner, handshakes and the file's rename included, not the agreement) is
timed alone (every rank runs the load's agreement and pulls, then nothing: the other ranks
idle, as in the loopback sends; this is the figure set against the loopback) three ways: into
the spare segment allocated when the ``Checkpointer`` was built (waited for before the time
starts: on a real node the job builds its model meanwhile; its allocation time is printed),
without a spare (pages allocated as the bytes arrive, a thread populating ahead of them), and
without a spare or that thread; and inside the "node lost" restore, where the other ranks
read their own shards meanwhile, on this machine's shared CPUs, where each node would have
its own. Every figure is printed as the median (and the fastest) of its tries; the targets
are judged on the ratio of the medians.

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
import statistics
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

    # -- baselines (measured inside the loop below, interleaved with the contenders) -------
    copies: list[Any] = []

    def memcpy() -> None:
        copies.append({k: v.clone() for k, v in state.items()})

    group = dist.new_group(backend="gloo")
    flat = torch.cat([v.view(-1) for v in state.values()]).view(torch.uint8)
    buf = torch.empty_like(flat)

    def loopback() -> None:
        if rank == 0:
            dist.send(flat, 1, group=group)
        elif rank == 1:
            dist.recv(buf, 0, group=group)

    loopback()  # warm the pair's connection
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

    def free_landed() -> None:
        copies.clear()
        for path, fd, mm in landed:  # freeing the pages is outside the time
            try:
                mm.close()
            except BufferError:
                pass
            os.close(fd)
            os.unlink(path)
        landed.clear()

    cpu_log: list[float] = []

    def load_with(tiers: list[Any], check: bool = True) -> tuple[tuple[float, float], Any]:
        """(restore, restore + a read of every restored byte), each the slowest rank's."""
        c = Checkpointer(tiers, **kw)
        dist.barrier()
        cpu0 = os.times()
        t0 = time.perf_counter()
        got = c.load()
        t1 = time.perf_counter()
        cpu1 = os.times()
        for v in got.values():  # touch every byte once: sum() reads each element
            v.sum()
        t2 = time.perf_counter()
        t = torch.tensor([t1 - t0, t2 - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the job's time: its slowest rank
        # the CPU seconds the load took in this process (every thread), summed over the
        # ranks: a measure that a busy machine disturbs less than the clock
        cpu = cpu1.user + cpu1.system - cpu0.user - cpu0.system
        ct = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(ct)
        cpu_log.append(float(ct.item()))
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

    from tierckpt.peer import _wire

    def pull_alone(mode: str) -> tuple[float, float]:
        """Rank 1's partner pull with the other ranks idle, as in the loopback sends (in the
        node-lost restore, the other ranks read their own shards meanwhile, on the same CPUs
        here, where each node would have its own): every rank runs the load's agreement and
        the pulls (``prepare_load``), and no load. ``mode``: ``spare`` (the spare segment
        allocated at setup, waited for before the time starts: the job's setup, building
        its model, is that time on a real node), ``fresh`` (no spare: the pull's pages are
        allocated as the bytes arrive, a thread populating ahead of them), ``fresh-nofill``
        (no spare, no populating thread). Returns (pull seconds, spare allocation seconds)."""
        dist.barrier()
        lose_node()
        c = Checkpointer(recipe(), **kw)
        assert c._peer is not None
        spare = getattr(c._peer, "spare", None)
        if spare is not None:
            if mode == "spare":
                spare.wait()
            else:
                spare.discard()
                c._peer.spare = None
        filling = getattr(_wire, "POPULATE_AHEAD", None)
        if filling is not None:
            _wire.POPULATE_AHEAD = mode != "fresh-nofill"
        dist.barrier()
        c._peer.prepare_load(None, None)
        if filling is not None:
            _wire.POPULATE_AHEAD = filling
        rep = c._peer.last_restore
        c.close()
        find_node()
        mine = rep.pull_seconds if rep is not None and rank == 1 else 0.0
        alloc = spare.seconds if spare is not None and rank == 1 else 0.0
        t = torch.tensor([mine, alloc], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0]), float(t[1])

    alone: dict[str, list[float]] = {"spare": [], "fresh": [], "fresh-nofill": []}
    spare_alloc: list[float] = []
    base: dict[str, list[float]] = {"memcpy": [], "loopback": [], "loopback_fresh": []}
    s3_only = [S3Tier(s3_url, endpoint_url=cfg["endpoint"])]
    cpu_tries: dict[str, list[float]] = {}
    kinds: dict[str, list[tuple[tuple[float, float], Any]]] = {
        "crash": [],
        "ram_only": [],
        "ram_copy": [],
        "local": [],
        "local_warm": [],
        "lost": [],
        "s3": [],
    }
    cpu_tries.update({k: [] for k in kinds})
    # the kinds, baselines included, take turns, so that a busy moment of the machine slows
    # each the same; every try is kept: the summary gives the median and the fastest
    for _ in range(cfg["repeat"]):
        base["memcpy"].append(timed(memcpy))
        free_landed()
        base["loopback"].append(timed(loopback))
        # process crash: the whole recipe, every shard in its node's RAM
        kinds["crash"].append(once(recipe()))
        cpu_tries["crash"].append(cpu_log[-1])
        # the same read with a policy of node RAM alone: the tier's own cost, without the
        # recipe's listing of the slower tiers and the partners' agreement
        kinds["ram_only"].append(once([ram()]))
        cpu_tries["ram_only"].append(cpu_log[-1])
        # ... and read into fresh tensors (a copy) instead of mapped
        kinds["ram_copy"].append(once([ram(map=False)]))
        cpu_tries["ram_copy"].append(cpu_log[-1])
        # all RAM lost: only the local disk (and S3) left, the disk's pages evicted (cold)...
        disk_only = [LocalTier(disk_path), *s3_only]
        kinds["local"].append(once(disk_only, lambda: _evict(disk_path), "cold"))
        cpu_tries["local"].append(cpu_log[-1])
        # ... and with every page in the page cache (warm)
        kinds["local_warm"].append(once(disk_only, lambda: _warm(disk_path), "warm"))
        cpu_tries["local_warm"].append(cpu_log[-1])
        # node lost: rank 1's RAM and disk gone: its shard from its partner's RAM
        kinds["lost"].append(once(recipe(), lose_node))
        cpu_tries["lost"].append(cpu_log[-1])
        find_node()
        base["loopback_fresh"].append(timed(loopback_fresh))
        free_landed()
        for mode in alone:
            secs, alloc = pull_alone(mode)
            alone[mode].append(secs)
            if mode == "spare":
                spare_alloc.append(alloc)
        base["loopback"].append(timed(loopback))  # twice a round: the pull's own baseline
        # cluster lost: S3 only
        kinds["s3"].append(once(s3_only))
        cpu_tries["s3"].append(cpu_log[-1])
    for k, v in kinds.items():
        out[f"{k}_cpu_tries"] = cpu_tries[k]
        out[f"{k}_tries"] = [r[0][0] for r in v]
        out[f"{k}_touch_tries"] = [r[0][1] for r in v]
    fastest = {k: min(v, key=lambda r: r[0][0]) for k, v in kinds.items()}
    rep = fastest["crash"][1]
    out["crash_sources"] = list(rep.sources)
    out["cache_state"] = cache_state
    rep = fastest["lost"][1]
    out["node_lost_sources"] = list(rep.sources)
    out["pulled_bytes"] = rep.pulled_bytes
    out["pull_tries"] = [r[1].pull_seconds for r in kinds["lost"]]
    for mode, v in alone.items():
        out[f"pull_alone_{mode}_tries"] = v
    out["spare_alloc_tries"] = spare_alloc
    for k, v in base.items():
        out[f"{k}_tries"] = v
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
    ap.add_argument(
        "--repeat", type=int, default=3, help="rounds (tries of every kind and baseline)"
    )
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


def _med(v: list[float]) -> float:
    return float(statistics.median(v))


def _summary(results: list[dict[str, Any]], world: int, size: int, repeat: int) -> dict[str, Any]:
    """Every measure as its median and its fastest try (``{"med": s, "min": s}``); the
    targets are judged on the medians (a ratio of two medians of interleaved tries), the
    fastest tries shown beside them."""
    r0, r1 = results[0], results[1]
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

    def both(v: list[float]) -> dict[str, float]:
        return {"med": _med(v), "min": min(v)}

    t = {key: both(r0[f"{key}_tries"]) for _t, key in rows.values()}
    touch = {key: both(r0[f"{key}_touch_tries"]) for _t, key in rows.values()}
    base = {k: both(r0[f"{k}_tries"]) for k in ("memcpy", "loopback", "loopback_fresh")}
    pulls = {m: both(r0[f"pull_alone_{m}_tries"]) for m in ("spare", "fresh", "fresh-nofill")}
    pulls["in restore"] = both(r1["pull_tries"])
    pulled, sent = r1["pulled_bytes"], r0["bytes"]

    def ratio(num: dict[str, float], den: dict[str, float], scale: float = 1.0) -> dict[str, float]:
        """num / den (seconds over seconds: how many times faster ``den`` is), times scale."""
        return {k: scale * num[k] / den[k] if den[k] else 0.0 for k in ("med", "min")}

    # the pull moves the shard file (state + index), the loopback the state: as bandwidths
    per_byte = pulled / sent if sent else 1.0
    ratios = {
        "node_ram_vs_local": ratio(t["local"], t["crash"]),
        "node_ram_vs_local_warm": ratio(t["local_warm"], t["crash"]),
        "node_ram_alone_vs_local": ratio(t["local"], t["ram_only"]),
        "node_ram_touched_vs_local_touched": ratio(touch["local"], touch["crash"]),
        "node_ram_touched_vs_local_bare": ratio(t["local"], touch["crash"]),
        "node_ram_copied_vs_local": ratio(t["local"], t["ram_copy"]),
        "node_ram_vs_memcpy": ratio(base["memcpy"], t["crash"]),
        "node_ram_touched_vs_memcpy": ratio(base["memcpy"], touch["crash"]),
        "node_ram_alone_vs_memcpy": ratio(base["memcpy"], t["ram_only"]),
        "node_ram_vs_s3": ratio(t["s3"], t["crash"]),
        **{f"pull_{m}_vs_loopback": ratio(base["loopback"], pulls[m], per_byte) for m in pulls},
        **{
            f"pull_{m}_vs_loopback_fresh": ratio(base["loopback_fresh"], pulls[m], per_byte)
            for m in pulls
        },
    }
    return {
        "ranks": world,
        "arena_bytes": max(256 * MiB, 2 * size),
        "repeat": repeat,
        "bytes_per_rank": size,
        "job_bytes": total,
        "pulled_bytes": pulled,
        "rows": {
            k: {
                "tier": tier,
                "seconds": t[key],
                "touch_seconds": touch[key],
                "cpu_seconds": both(r0[f"{key}_cpu_tries"]),
            }
            for k, (tier, key) in rows.items()
        },
        "baselines": base,
        "pulls": pulls,
        "spare_alloc_s": both(r0["spare_alloc_tries"]) if any(r0["spare_alloc_tries"]) else None,
        "ratios": ratios,
        # bandwidths of the medians (the names earlier versions wrote)
        "memcpy_gbps": total / base["memcpy"]["med"] / 1e9,
        "loopback_gbps": sent / base["loopback"]["med"] / 1e9,
        "loopback_fresh_gbps": sent / base["loopback_fresh"]["med"] / 1e9,
        "pull_alone_gbps": pulled / pulls["spare"]["med"] / 1e9,
        "pull_gbps": pulled / pulls["in restore"]["med"] / 1e9,
        "tries": {k: v for k, v in r0.items() if k.endswith("_tries")},
        "pull_tries_rank1": r1["pull_tries"],
        "crash_sources": r0["crash_sources"],
        "node_lost_sources": r0["node_lost_sources"],
        "cache_state": {f"rank {i}": r["cache_state"] for i, r in enumerate(results)},
        "node_ram_bytes": [r["node_ram_bytes"] for r in results],
        "replica_bytes": [r["replica_bytes"] for r in results],
    }


def _met(x: float, target: float) -> str:
    return "met" if x >= target else "NOT met"


def _mm(d: dict[str, float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(d['med'])} ({fmt.format(d['min'])})"


def _table(s: dict[str, Any]) -> str:
    mib = s["bytes_per_rank"] / MiB
    cold = s["rows"]["all RAM lost, cold"]["seconds"]
    total = s["job_bytes"]
    lines = [
        f"{s['ranks']} ranks x {mib:.0f} MiB = {total / MiB:.0f} MiB job state; restore time ="
        f" slowest rank, from a barrier to load() returning; restore + touch = to the end of a"
        f" read of every restored byte. Every figure: median (fastest) of {s['repeat']} tries,"
        f" baselines measured in the same rounds as the contenders; targets judged on the "
        f"medians. {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}",
        "",
        "| failure | restored from | restore (s) | GB/s (median) | local disk (cold) / this |"
        " restore + touch (s) | CPU s, all ranks |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for kind, row in s["rows"].items():
        sec = row["seconds"]
        lines.append(
            f"| {kind} | {row['tier']} | {_mm(sec)} | {total / sec['med'] / 1e9:.2f} | "
            f"{cold['med'] / sec['med']:.1f}x | {_mm(row['touch_seconds'])} | "
            f"{_mm(row['cpu_seconds'])} |"
        )
    b = s["baselines"]
    lines.append(
        f"| (baseline) | plain memory copy, all ranks at once | {_mm(b['memcpy'])} | "
        f"{total / b['memcpy']['med'] / 1e9:.2f} | {cold['med'] / b['memcpy']['med']:.1f}x | "
        "(a copy touches all) | |"
    )
    r = s["ratios"]

    def rr(key: str, target: float | None = None) -> str:
        v = r[key]
        out = f"{v['med']:.2f}x (fastest tries: {v['min']:.2f}x)"
        return out + (f" [target >= {target}x: {_met(v['med'], target)}]" if target else "")

    p, pulled = s["pulls"], s["pulled_bytes"]

    def gbps(d: dict[str, float], n: int) -> str:
        return f"{n / d['med'] / 1e9:.2f} GB/s"

    spare = s["spare_alloc_s"]
    per_node = max(s["node_ram_bytes"]) / MiB
    replicas = max(s["replica_bytes"]) / MiB
    lines += [
        "",
        f"- node RAM (mapped, the recipe) vs local disk, cold: {rr('node_ram_vs_local', 5)};"
        f" both + touch {rr('node_ram_touched_vs_local_touched')}; strict (node RAM + touch"
        f" vs the disk's bare restore) {rr('node_ram_touched_vs_local_bare')}; warm (files"
        f" in the page cache) {rr('node_ram_vs_local_warm')}; vs S3 {rr('node_ram_vs_s3')}",
        f"- node RAM alone (no slower tier listed) vs local disk, cold: "
        f"{rr('node_ram_alone_vs_local')}; node RAM read into copies (map=False) "
        f"{rr('node_ram_copied_vs_local')}",
        f"- page cache before the local-disk restores (rank 0, each try): cold "
        f"{s['cache_state']['rank 0']['cold']}; warm {s['cache_state']['rank 0']['warm']}",
        f"- node RAM vs a plain memory copy: recipe {rr('node_ram_vs_memcpy', 0.5)}; + touch "
        f"{rr('node_ram_touched_vs_memcpy')}; alone {rr('node_ram_alone_vs_memcpy')}",
        f"- gloo loopback, rank 0 -> 1, {mib:.0f} MiB: into a warm buffer {_mm(b['loopback'])} s"
        f" = {gbps(b['loopback'], s['bytes_per_rank'])} (two tries a round); into fresh node "
        f"RAM (a new tmpfs file) {_mm(b['loopback_fresh'])} s = "
        f"{gbps(b['loopback_fresh'], s['bytes_per_rank'])}",
        f"- partner pull alone (the other ranks idle, as in the loopback sends; {pulled / MiB:.1f}"
        f" MiB): into the spare segment {_mm(p['spare'])} s = {gbps(p['spare'], pulled)}: vs "
        f"loopback {rr('pull_spare_vs_loopback', 0.5)}; vs loopback into fresh node RAM "
        f"{rr('pull_spare_vs_loopback_fresh')}"
        + (
            f"; the spare's allocation at setup {_mm(spare)} s (off the load's path)"
            if spare
            else "; no spare was made (code without spares)"
        ),
        f"- partner pull alone without a spare: populating ahead {_mm(p['fresh'])} s = "
        f"{gbps(p['fresh'], pulled)} ({rr('pull_fresh_vs_loopback')} of loopback); without the"
        f" populating thread {_mm(p['fresh-nofill'])} s = {gbps(p['fresh-nofill'], pulled)} "
        f"({rr('pull_fresh-nofill_vs_loopback')})",
        f"- the pull inside the node-lost restore (the other ranks restoring on the same "
        f"{os.cpu_count()} CPUs meanwhile) {_mm(p['in restore'])} s = "
        f"{gbps(p['in restore'], pulled)}: {rr('pull_in restore_vs_loopback')} of loopback",
        f"- memory per node: {per_node:.0f} MiB of node RAM for its own checkpoint "
        f"(keep_last=2 holds up to 3) + {replicas:.0f} MiB of partner replicas (PeerTier "
        f"keep_last=1): {(per_node + replicas) / mib:.2f}x the node's state; a replacement "
        f"node's spare segment (one shard, until its pull) is counted in the same budget; "
        f"host arena {s['arena_bytes'] / MiB:.0f} MiB besides",
        f"- sources after a crash: {s['crash_sources']}; after a lost node: "
        f"{s['node_lost_sources']}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
