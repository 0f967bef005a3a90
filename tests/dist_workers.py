"""Multi-process helpers for the distributed tests: the launcher and the per-rank functions.

``launch(module, fn, world, ...)`` starts ``world`` processes from a *forkserver* that imported
torch, torch.distributed and tierckpt once (a fresh interpreter per rank costs ~5 s of imports
on two cores; a fork of the server ~0.1 s), initializes a gloo process group on 127.0.0.1 in
each, calls ``module.fn(rank, world, **kwargs)`` and returns every rank's JSON result. A rank
that raises fails the run with its traceback and log; ``expect_killed`` lists ranks that are
meant to die. The other worker modules (``parity_workers``, ``peer_workers``) launch their
functions through it; ``run(fn, world, **kwargs)`` launches the functions of this module.

Run ``python tests/dist_workers.py blocking`` for the rank-0 blocking-time measurement.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tierckpt import Checkpointer, LocalTier, MemoryTier, S3Tier
from tierckpt import distributed as tdist
from tierckpt.distributed import _strategy
from tierckpt.distributed._listcommit import write_listed_record
from tierckpt.errors import CheckpointFailed, CheckpointNotFound, CorruptCheckpoint
from tierckpt.format import manifest_name, shard_name, step_prefix
from tierckpt.layout import parse_record_name, prefixes_for

_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "tierckpt",
    "tierckpt.distributed",
    "tierckpt.dcp",
    "boto3",
    "dist_workers",
    "parity_workers",
    "peer_workers",
]
_ctx: Any = None


def _context() -> Any:
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    fn: str,
    world: int,
    *,
    timeout: float = 90,
    expect_killed: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn`` (a function of this module, or ``"module:function"``) on ``world`` ranks;
    every rank's result."""
    module, _, name = fn.rpartition(":")
    return launch(
        module or "dist_workers",
        name,
        world,
        timeout=timeout,
        expect_killed=expect_killed,
        env=env,
        **kwargs,
    )


def launch(
    module: str,
    fn: str,
    world: int,
    *,
    timeout: float,
    expect_killed: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``module.fn`` on ``world`` ranks; every rank's result. The ranks see this process's
    ``AWS_*`` and ``TIERCKPT_*`` variables, then ``env``."""
    ctx = _context()
    out = Path(tempfile.mkdtemp(prefix=f"tierckpt-{fn}-"))
    child_env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "TIERCKPT_"))}
    child_env.update(env or {})
    port = _free_port()
    procs = [
        ctx.Process(target=_child, args=(module, fn, r, world, port, str(out), child_env, kwargs))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    problems = []
    if hung:
        problems.append(f"ranks {hung} still running after {timeout} s (killed)")
    results: list[Any] = []
    for r, p in enumerate(procs):
        err = out / f"error-{r}.txt"
        res = out / f"result-{r}.json"
        if r in expect_killed:
            if p.exitcode != -signal.SIGKILL:
                problems.append(f"rank {r} should have been killed, exit code {p.exitcode}")
            results.append(None)
            continue
        if err.exists():
            problems.append(f"rank {r} raised:\n{err.read_text()}")
        elif p.exitcode != 0 or not res.exists():
            problems.append(f"rank {r} exit code {p.exitcode}, no result")
        results.append(json.loads(res.read_text()) if res.exists() else None)
    if problems:
        logs = "\n".join(
            f"--- log of rank {r}:\n" + _tail(out / f"log-{r}.txt") for r in range(world)
        )
        raise AssertionError(
            f"{fn} on {world} ranks failed (logs kept in {out}): "
            + "\n".join(problems)
            + "\n"
            + logs
        )
    shutil.rmtree(out, ignore_errors=True)  # results read: the folder is not needed
    return results


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _child(
    module: str,
    fn: str,
    rank: int,
    world: int,
    port: int,
    out: str,
    env: dict[str, str],
    kwargs: Any,
) -> None:
    os.environ.update(env)
    log_path = os.path.join(out, f"log-{rank}.txt")
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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
        result = getattr(importlib.import_module(module), fn)(rank, world, **kwargs)
        Path(out, f"result-{rank}.json.tmp").write_text(json.dumps(result))
        os.replace(Path(out, f"result-{rank}.json.tmp"), Path(out, f"result-{rank}.json"))
    except BaseException:
        Path(out, f"error-{rank}.txt").write_text(traceback.format_exc())
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # skip interpreter teardown: a dead peer can make gloo's destructor wait
    os._exit(code)


# -- shared pieces ---------------------------------------------------------------------


def rank_state(rank: int, step: int, numel: int = 2048) -> dict[str, Any]:
    """A per-rank, per-step state with several dtypes and non-tensor values."""
    g = torch.Generator().manual_seed(100_003 * step + rank)
    w = torch.randn(numel, 8, generator=g)
    return {
        "w": w,
        "w_t": w.t(),  # a view of the same storage
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-(1 << 40), 1 << 40, (77,), generator=g),
        "mask": torch.rand(50, generator=g) > 0.5,
        "meta": {"step": step, "rank": rank, "name": f"rank{rank}", "t": (1, 2.5, None)},
    }


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Differences between two states, bit-exact for tensors."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return [f"{path}: tensor vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        ac, bc = a.contiguous(), b.contiguous()
        if not torch.equal(ac.view(-1).view(torch.uint8), bc.view(-1).view(torch.uint8)):
            return [f"{path}: values differ"]
        return []
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [f"{path}: keys {list(a)[:5]} vs {list(b)[:5] if isinstance(b, dict) else b}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def tiers(
    root: str, s3: dict[str, str] | None, *, memory: bool = False, local: str = "local"
) -> list[Any]:
    out: list[Any] = []
    if memory:
        out.append(MemoryTier(namespace=f"mem-{os.getpid()}", keep_last=2))
    out.append(LocalTier(os.path.join(root, local), keep_last=None))
    if s3:
        out.append(S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=None))
    return out


def _prefixes(b: Any) -> int:
    """The hashed prefixes a tier of this backend writes by default (format v2)."""
    return prefixes_for(None)


def _shared_backends(ck: Checkpointer) -> list[Any]:
    return [ck.backend(n) for n in ck.tier_names if n != "memory"]


# -- native multi-rank save / load -----------------------------------------------------------


def w_save_load(rank: int, world: int, root: str, s3: dict[str, str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = Checkpointer(
            tiers(root, s3, memory=True), host_buffer_bytes=16 << 20, chunk_bytes=64 << 10
        )
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        for b in _shared_backends(ck):
            tdist.wait_committed(b, 1, timeout=60)

        # step 2: rank 0 is the slowest rank (its record, and so its commit, comes 2 s late on
        # the shared tiers); the others finish first
        original = _strategy.write_listed_record  # format v2 tiers: the LIST-only commit
        if rank == 0:

            def slow(*a: Any, **k: Any) -> Any:
                time.sleep(2.0)
                return original(*a, **k)

            _strategy.write_listed_record = slow  # type: ignore[assignment]
        try:
            h2 = ck.save(rank_state(rank, 2), 2)
            h2.wait("local", timeout=60)
            # rank 0's own completion includes the commit; another rank's only its shard
            out["manifest2_after_own_wait"] = ck.backend("local").exists(manifest_name(2))
            h2.wait(timeout=60)
        finally:
            _strategy.write_listed_record = original  # type: ignore[assignment]
        for b in _shared_backends(ck):
            tdist.wait_committed(b, 2, timeout=60)

        # step 3: rank 1 leaves a record and a shard of an earlier, killed attempt first
        if rank == 1:
            for b in _shared_backends(ck):
                stale = tdist.RankRecord(
                    3,
                    1,
                    world,
                    "00000000deadbeef",
                    "x",
                    shard_name(3, 1, prefixes=_prefixes(b)),
                    4096,
                    "0123456789abcdef",
                    1,
                    1,
                    "raw",
                )
                write_listed_record(b, stale, _prefixes(b))
                b.put_atomic(
                    shard_name(3, 1, prefixes=_prefixes(b)),
                    b"stale bytes of a killed attempt",
                    overwrite=True,
                )
        dist.barrier()
        h3 = ck.save(rank_state(rank, 3), 3)
        h3.wait(timeout=60)
        for b in _shared_backends(ck):
            tdist.wait_committed(b, 3, timeout=60)
        # format v2: the record's fields in its name; the stale attempt's record stays
        # beside (another name), ignored, until retention removes the step
        listed = [
            parse_record_name(n.rsplit("/", 1)[1])
            for n in ck.backend("local").list("")
            if f"/{step_prefix(3)}records/" in f"/{n}"
        ]
        out["records3"] = sorted(r.rank for r in listed if r and r.attempt != "00000000deadbeef")
        out["stale3"] = sorted(r.rank for r in listed if r and r.attempt == "00000000deadbeef")
        out["memory_steps"] = ck.steps("memory")
        ck.close()
        dist.barrier()

        # load: all ranks agree on the newest step (from RAM, the fastest tier)
        ck2 = Checkpointer(tiers(root, s3, memory=True))
        got = ck2.load()
        out["loaded_newest"] = got["meta"]["step"]
        out["diff_newest"] = same(got, rank_state(rank, 3))
        out["diff_step2"] = same(ck2.load(step=2), rank_state(rank, 2))
        try:
            ck2.load(step=77)
            out["missing_step"] = "loaded?!"
        except CheckpointNotFound as exc:
            out["missing_step"] = str(exc)
        ck2.close()

        # restore from S3 (else a second local folder) into an empty local folder
        fresh = os.path.join(root, f"fresh-{rank}")
        remote = (
            S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"])
            if s3
            else LocalTier(os.path.join(root, "local"), name="second")
        )
        ck3 = Checkpointer([LocalTier(fresh, name="fresh"), remote])
        got = ck3.load()
        out["fresh_steps"] = ck3.steps("fresh")
        out["diff_restore"] = same(got, rank_state(rank, 3))
        out["restore_step"] = got["meta"]["step"]
        ck3.close()

        # on_busy="skip": one rank still flushing makes every rank skip the next save
        from tierckpt.backends import local

        orig = local._LocalWriter.write
        if rank == 1:

            def slow_write(self: Any, offset: int, data: Any) -> None:
                time.sleep(0.5)
                orig(self, offset, data)

            local._LocalWriter.write = slow_write  # type: ignore[method-assign]
        ck4 = Checkpointer([LocalTier(os.path.join(root, "skip"))], on_busy="skip")
        small = {"x": torch.full((10,), float(rank))}
        h1 = ck4.save(small, 100)
        h2 = ck4.save(small, 101)
        ck4.wait(timeout=60)
        local._LocalWriter.write = orig  # type: ignore[method-assign]
        out["skipped"] = [h1.skipped, h2.skipped]
        out["skip_steps"] = ck4.steps() if rank == 0 else None
        ck4.close()
    return out


def w_kill_save(
    rank: int, world: int, root: str, s3: dict[str, str] | None, victim: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=4, poll_max=0.2):
        ck = Checkpointer(tiers(root, s3), host_buffer_bytes=16 << 20, chunk_bytes=64 << 10)
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        for b in _shared_backends(ck):
            tdist.wait_committed(b, 1, timeout=60)
        dist.barrier()
        if rank == victim:
            # die after the shard is durable, before the completion record: the worst moment
            def die(*_a: Any, **_k: Any) -> None:
                os.kill(os.getpid(), signal.SIGKILL)

            _strategy.write_listed_record = die  # type: ignore[assignment]
        h = ck.save(rank_state(rank, 2), 2)
        t0 = time.monotonic()
        try:
            h.wait(timeout=60)
            out["error"] = None
        except CheckpointFailed as exc:
            out["error"] = str(exc)
            out["error_types"] = sorted({type(e).__name__ for e in exc.errors.values()})
        out["seconds"] = time.monotonic() - t0
        out["manifest2"] = [b.exists(manifest_name(2)) for b in _shared_backends(ck)]
        out["steps"] = ck.steps()
    return out


def w_fail_save(rank: int, world: int, root: str, victim: int) -> dict[str, Any]:
    """The victim's storage fails at step 2 (not a death): every rank hears of it at once."""
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=120, poll_max=0.2):
        ck = Checkpointer(
            tiers(root, None, memory=True), host_buffer_bytes=16 << 20, chunk_bytes=64 << 10
        )
        ck.save(rank_state(rank, 1), 1).wait(timeout=60)
        tdist.wait_committed(ck.backend("local"), 1, timeout=60)
        dist.barrier()
        if rank == victim:
            for name in ck.tier_names:
                backend = ck.backend(name)
                real = backend.open_writer

                def full(file: str, real: Any = real) -> Any:
                    if file == shard_name(2, rank):
                        raise OSError(28, "No space left on device")
                    return real(file)

                backend.open_writer = full  # type: ignore[method-assign]
        h = ck.save(rank_state(rank, 2), 2)
        t0 = time.monotonic()
        try:
            h.wait(timeout=90)
            out["error"] = None
        except CheckpointFailed as exc:
            out["error"] = str(exc)
            out["error_types"] = {t: type(e).__name__ for t, e in exc.errors.items()}
            out["messages"] = {t: str(e) for t, e in exc.errors.items()}
        out["seconds"] = time.monotonic() - t0
        dist.barrier()
        out["manifest2"] = ck.backend("local").exists(manifest_name(2))
        ck.save(rank_state(rank, 3), 3).wait(timeout=60)  # the next step commits again
        tdist.wait_committed(ck.backend("local"), 3, timeout=60)
        dist.barrier()
        out["steps"] = ck.steps()
        out["diff3"] = same(ck.load(), rank_state(rank, 3))
        ck.close()
    return out


def w_repopulate(rank: int, world: int, root: str, s3: dict[str, str] | None) -> dict[str, Any]:
    """Save to local + S3; a new cluster (empty local folders) loads from S3; the load copies
    every rank's shard to the local tier and commits it there once all are in."""
    assert s3 is not None
    out: dict[str, Any] = {}
    s3_tier = S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=None)
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = Checkpointer(
            [LocalTier(os.path.join(root, "old-local"), keep_last=None), s3_tier],
            host_buffer_bytes=16 << 20,
            chunk_bytes=64 << 10,
        )
        for step in (1, 2):
            ck.save(rank_state(rank, step), step).wait(timeout=60)
            tdist.wait_committed(ck.backend("s3"), step, timeout=60)
        ck.close()
        dist.barrier()
        # a new cluster: a shared local folder and per-node folders, all empty
        private = os.path.join(root, f"node-{rank}")
        os.environ["TIERCKPT_PRIVATE_TIERS"] = "nvme"
        tiers = [
            LocalTier(os.path.join(root, "shared-local"), name="shared", keep_last=None),
            LocalTier(private, name="nvme", keep_last=None),
            s3_tier,
        ]
        ck = Checkpointer(tiers, host_buffer_bytes=16 << 20, chunk_bytes=64 << 10)
        # first try: rank 1 reads a flipped bit from S3 and fails; rank 0's read works, but
        # its copies are not committed, since rank 1's are missing, and its load fails too
        # (every rank ends a load alike; nobody hangs)
        if rank == 1:
            backend = ck.backend("s3")
            real = backend.read_into

            def flip(name: str, offset: int, buf: memoryview) -> None:
                real(name, offset, buf)
                if offset == 0:  # the first chunk's bytes; the index and footer stay intact
                    buf[0] ^= 1

            backend.read_into = flip  # type: ignore[method-assign]
        try:
            ck.load()
            out["first_error"] = None
        except Exception as exc:
            out["first_error"] = type(exc).__name__
        if rank == 1:
            del backend.read_into
        dist.barrier()
        out["shared_after_failure"] = ck.steps("shared")
        got = ck.load()
        out["diff_loaded"] = same(got, rank_state(rank, 2))
        dist.barrier()  # rank 0 has written the shared manifest before its load returned
        out["shared_steps"] = ck.steps("shared")
        out["private_steps"] = ck.steps("nvme")
        # format v2: the file under its rank's hashed prefix
        out["private_files"] = sorted(
            os.listdir(os.path.dirname(os.path.join(private, shard_name(2, rank))))
        )
        ck.close()
        dist.barrier()
        # the next restart has only the local folders: the checkpoint is there
        for name, path in (("shared", os.path.join(root, "shared-local")), ("nvme", private)):
            with Checkpointer([LocalTier(path, name=name)], host_buffer_bytes=16 << 20) as only:
                out[f"diff_{name}"] = same(only.load(), rank_state(rank, 2))
    return out


def w_load_after_kill(
    rank: int, world: int, root: str, s3: dict[str, str] | None
) -> dict[str, Any]:
    ck = Checkpointer(tiers(root, s3), host_buffer_bytes=16 << 20, chunk_bytes=64 << 10)
    got = ck.load()
    out: dict[str, Any] = {"step": got["meta"]["step"], "diff": same(got, rank_state(rank, 1))}
    # the next committed save lets rank 0's retention remove the dead attempt's leftovers
    ck.save(rank_state(rank, 3), 3).wait(timeout=60)
    for b in _shared_backends(ck):
        tdist.wait_committed(b, 3, timeout=60)
    dist.barrier()  # rank 0 applied retention before its handle finished
    out["leftover2"] = [bool(b.list(step_prefix(2))) for b in _shared_backends(ck)]
    ck.close()
    return out


# -- blocking time on rank 0 -------------------------------------------------------------------


def w_blocking(
    rank: int,
    world: int,
    root: str,
    steps: int = 30,
    mb: int = 32,
    every: int = 3,
    compute_s: float = 0.05,
    slow_rank: int = -1,
    slow_write_s: float = 0.0,
    tag: str = "",
) -> dict[str, Any]:
    """A training loop that saves ``mb`` MiB every ``every`` steps; per-save blocked time.

    Each step sleeps ``compute_s`` (forward/backward) and all-reduces a small gradient, as
    data-parallel training does, so ranks run in lockstep.
    """
    if rank == slow_rank:
        from tierckpt.backends import local

        orig = local._LocalWriter.write

        def slow_write(self: Any, offset: int, data: Any) -> None:
            time.sleep(slow_write_s)
            orig(self, offset, data)

        local._LocalWriter.write = slow_write  # type: ignore[method-assign]
    state = {"w": torch.randn(mb << 18), "step": 0}
    grad = torch.zeros(1024)
    ck = Checkpointer(
        [LocalTier(os.path.join(root, f"w{world}{tag}"), keep_last=2)],
        host_buffer_bytes=(2 * mb + 8) << 20,
        chunk_bytes=4 << 20,
    )
    ck.save(state, 0).wait()  # warm the host buffer
    dist.barrier()
    handles = []
    t_start = time.perf_counter()
    for i in range(steps):
        if i % every == 0:  # lazy: save() right after the optimizer step ...
            state["step"] = i + 1
            handles.append(ck.save(state, i + 1))
        time.sleep(compute_s)  # ... the copy overlaps forward / backward
        dist.all_reduce(grad)  # data-parallel gradient sync
        ck.wait_captured()  # the optimizer step must not race the capture
        state["w"].add_(1.0)
    loop_s = time.perf_counter() - t_start
    ck.wait()
    failures = [h.step for h in handles if h.errors]
    ck.close()
    blocked = sorted(h.blocked_seconds * 1e3 for h in handles)
    return {
        "rank": rank,
        "world": world,
        "saves": len(handles),
        "failed": failures,
        "blocked_ms_mean": sum(blocked) / len(blocked),
        "blocked_ms_p50": blocked[len(blocked) // 2],
        "blocked_ms_max": blocked[-1],
        "loop_s": loop_s,
        "ideal_loop_s": steps * compute_s,
    }


# -- DCP ------------------------------------------------------------------------------------


def _fsdp(world: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 13), torch.nn.LayerNorm(13)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model: Any, opt: Any, steps: int, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 24, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"model": msd, "optim": osd}


def _sharded(model: Any, opt: Any, epoch: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"epoch": epoch, "tag": "run-a"}}


def _dcp_tiers(root: str, s3: dict[str, str] | None, which: str) -> list[Any]:
    local = LocalTier(os.path.join(root, "dcp-local"), keep_last=None)
    if which == "local" or not s3:
        return [local]
    remote = S3Tier(f"s3://{s3['bucket']}/dcp", endpoint_url=s3["endpoint"], keep_last=None)
    return [remote] if which == "s3" else [local, remote]


def w_dcp_save(
    rank: int,
    world: int,
    root: str,
    s3: dict[str, str] | None,
    step: int,
    async_step: int | None = None,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    model, opt = _fsdp(world, seed=0)
    _train(model, opt, 2)
    writer = TierWriter(_dcp_tiers(root, s3, "both"), chunk_bytes=16 << 10)
    dcp.save(_sharded(model, opt, epoch=3), storage_writer=writer, checkpoint_id=step)
    full = _full(model, opt)
    if rank == 0:
        torch.save(full, os.path.join(root, f"ref-{step}.pt"))
    out: dict[str, Any] = {
        "placement": str(next(iter(_sharded(model, opt, 0)["model"].values())).placements)
    }
    if async_step is not None:
        _train(model, opt, 1, seed=8)
        # DCP's collectives then run on a background thread: give them their own group so
        # they never interleave with training's collectives on the default group
        ckpt_group = dist.new_group(backend="gloo")
        fut = dcp.async_save(
            _sharded(model, opt, epoch=4),
            storage_writer=writer,
            checkpoint_id=async_step,
            process_group=ckpt_group,
        )
        _train(model, opt, 1, seed=9)  # training goes on while the save runs
        fut.result()  # type: ignore[union-attr]
        # the reference is the state at the time of async_save: replay it on a copy
        model2, opt2 = _fsdp(world, seed=0)
        _train(model2, opt2, 2)
        _train(model2, opt2, 1, seed=8)
        full2 = _full(model2, opt2)
        if rank == 0:
            torch.save(full2, os.path.join(root, f"ref-{async_step}.pt"))
    writer.close()
    return out


def w_dcp_load(
    rank: int,
    world: int,
    root: str,
    s3: dict[str, str] | None,
    steps: list[int],
    source: str,
    save_step: int | None = None,
) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from tierckpt.dcp import SafeLoadPlanner, TierReader, TierWriter

    out: dict[str, Any] = {}
    for step in steps:
        model, opt = _fsdp(world, seed=1234)  # different initial values
        _train(model, opt, 1, seed=99)
        sd = _sharded(model, opt, epoch=0)
        reader = TierReader(_dcp_tiers(root, s3, source))
        dcp.load(sd, storage_reader=reader, checkpoint_id=step, planner=SafeLoadPlanner())
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        full = _full(model, opt)
        if rank == 0:
            ref = torch.load(os.path.join(root, f"ref-{step}.pt"), weights_only=False)
            out[f"diff-{step}"] = same(full, ref)
        out[f"extra-{step}"] = sd["extra"]
        if save_step is not None:
            writer = TierWriter(_dcp_tiers(root, s3, "both"), chunk_bytes=16 << 10)
            dcp.save(_sharded(model, opt, epoch=5), storage_writer=writer, checkpoint_id=save_step)
            writer.close()
            if rank == 0:
                torch.save(full, os.path.join(root, f"ref-{save_step}.pt"))
            save_step = None
    # newest step without naming it: every rank agrees
    reader = TierReader(_dcp_tiers(root, s3, source))
    sd = _sharded(*_fsdp(world, seed=5), epoch=0)
    dcp.load(sd, storage_reader=reader)
    out["newest"] = reader.loaded_step
    return out


def w_dcp_private_tier(rank: int, world: int, root: str) -> dict[str, Any]:
    """Three DCP saves with a private tier (this process's RAM) before a shared folder, through
    one writer, then three through a new writer per save (DCP's idiom, whose dropped writers
    hand their pipeline and tiers on): the levels of the "skips tier" records of each."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    said: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "DCP save skips tier" in record.getMessage():
                said.append(record.levelname)

    logger = logging.getLogger("tierckpt")
    logger.addHandler(Catch(logging.DEBUG))
    logger.setLevel(logging.DEBUG)

    def tiers(run: str) -> list[Any]:
        return [
            MemoryTier(namespace=f"{run}-{os.getpid()}"),
            LocalTier(os.path.join(root, run), keep_last=None),
        ]

    state = {f"w{rank}": torch.full((256,), float(rank))}
    out: dict[str, Any] = {}
    with TierWriter(tiers("reused"), chunk_bytes=16 << 10) as writer:
        for step in (1, 2, 3):
            dcp.save(state, storage_writer=writer, checkpoint_id=step)
    out["reused"], said[:] = list(said), []
    for step in (4, 5, 6):
        dcp.save(state, storage_writer=TierWriter(tiers("idiom")), checkpoint_id=step)
    out["new_per_save"] = list(said)
    return out


# -- timelines: a rollback on several ranks --------------------------------------------------


def _timeline_tiers(root: str, rank: int) -> list[Any]:
    """A shared folder and a per-rank "nvme" folder (private: TIERCKPT_PRIVATE_TIERS=nvme)."""
    return [
        LocalTier(os.path.join(root, "shared"), name="shared", keep_last=3),
        LocalTier(os.path.join(root, f"nvme-{rank}"), name="nvme", keep_last=3),
    ]


def _run_state(rank: int, step: int, run: int) -> dict[str, Any]:
    return {"x": rank_state(rank, step, numel=256), "run": run}


def w_timeline_rollback(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``train``: run 1 saves steps 1..5. ``resume``: load step 3, save 4..6 as run 2 (each
    waited for and committed on the shared tier), then a new checkpointer loads the newest.
    Errors of saves are recorded, not raised, so that the test can say what went wrong."""
    out: dict[str, Any] = {"errors": []}
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = Checkpointer(_timeline_tiers(root, rank), chunk_bytes=64 << 10)
        shared = ck.backend("shared")
        if phase == "train":
            for s in range(1, 6):
                ck.save(_run_state(rank, s, 1), s).wait(timeout=60)
                tdist.wait_committed(shared, s, timeout=60)
            ck.close()
            dist.barrier()  # rank 0 holds the store that the other ranks' private commits use
            return out
        got = ck.load(step=3)
        out["loaded_diff"] = same(got, _run_state(rank, 3, 1))
        timelines = []
        for s in range(4, 7):
            h = ck.save(_run_state(rank, s, 2), s)
            timeline = getattr(h, "timeline", 0)
            timelines.append(timeline)
            try:
                h.wait(timeout=60)
                kw = {"timeline": timeline} if timeline else {}
                tdist.wait_committed(shared, s, timeout=60, **kw)
            except (CheckpointFailed, TimeoutError) as exc:
                out["errors"].append(f"step {s}: {type(exc).__name__}: {exc}"[:600])
        out["timelines"] = timelines
        ck.close()
        dist.barrier()
        ck2 = Checkpointer(_timeline_tiers(root, rank))
        newest = ck2.load()
        out["newest_diff"] = same(newest, _run_state(rank, 6, 2))
        if hasattr(ck2, "checkpoints"):
            out["ids"] = {
                t: [[c.step, c.timeline] for c in ck2.checkpoints(t)] for t in ck2.tier_names
            }
        ck2.close()
        dist.barrier()
    return out


def w_stale_timeline(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """``other``: a run saves step 60 on the shared folder. ``new``: a job whose private folders
    are empty (new nodes) cannot list the shared folder at its first save (its first listing
    fails on every rank), saves 10 and 11 (refused on the shared folder: it holds step 60),
    then loads the newest and saves 61 (committed everywhere). Errors recorded per step."""
    from tierckpt import catalog

    out: dict[str, Any] = {"errors": {}}
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = Checkpointer(_timeline_tiers(root, rank), chunk_bytes=64 << 10)
        shared = ck.backend("shared")
        if phase == "other":
            ck.save(_run_state(rank, 60, 1), 60).wait(timeout=60)
            tdist.wait_committed(shared, 60, timeout=60)
            ck.close()
            dist.barrier()
            return out
        listed = catalog.committed_ids
        failed: list[int] = []

        def first_listing_fails(backend: Any) -> Any:
            if backend is shared and not failed:
                failed.append(1)
                raise OSError("the shared folder cannot be listed (test)")
            return listed(backend)

        catalog.committed_ids = first_listing_fails  # what the timeline's choice lists with
        try:
            for s in (10, 11):
                h = ck.save(_run_state(rank, s, 2), s)
                try:
                    h.wait(timeout=60)
                except CheckpointFailed as exc:
                    err = exc.errors.get("shared")
                    out["errors"][s] = f"{type(err).__name__}: {err}"[:600]
                out[f"timeline_{s}"] = h.timeline
        finally:
            catalog.committed_ids = listed
        dist.barrier()
        out["shared_before_load"] = [[c.step, c.timeline] for c in ck.checkpoints("shared")]
        got = ck.load()
        out["loaded_diff"] = same(got, _run_state(rank, 60, 1))
        h = ck.save(_run_state(rank, 61, 2), 61)
        h.wait(timeout=60)
        tdist.wait_committed(shared, 61, timeout=60)
        out["timeline_61"] = h.timeline
        out["shared"] = [[c.step, c.timeline] for c in ck.checkpoints("shared")]
        out["nvme"] = [[c.step, c.timeline] for c in ck.checkpoints("nvme")]
        ck.close()
        dist.barrier()
    return out


def w_one_writer(
    rank: int, world: int, root: str, gate: str, role: str, api: str = "checkpointer"
) -> dict[str, Any]:
    """One writer per location (tests/reliability/test_one_writer.py). ``first`` commits step
    1, touches ``gate/held-<rank>``, waits for ``gate/go`` and commits steps 2 and 3;
    ``second`` tries to save step 1 on the same folder and reports how it was refused (with
    ``api="dcp"``: twice, through one ``dcp.save`` TierWriter)."""
    if role == "second" and api == "dcp":
        return _second_dcp_writer(rank, root)
    ck = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    if role == "second":
        error = None
        try:
            ck.save(rank_state(rank, 1), 1)
        except Exception as exc:
            error = type(exc).__name__
        ck.close()
        return {"error": error}
    committed = []
    for step in (1, 2, 3):
        ck.save(rank_state(rank, step), step).wait(timeout=120)
        tdist.wait_committed(ck.backend("local"), step, timeout=120)
        committed.append(step)
        if step == 1:
            Path(gate, f"held-{rank}").touch()
            deadline = time.monotonic() + 300
            while not Path(gate, "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
    ck.close()
    return {"committed": committed}


def _second_dcp_writer(rank: int, root: str) -> dict[str, Any]:
    """A second job's DCP saves on a live job's folder: what each raised, on this rank."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    writer = TierWriter([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    errors = []
    for step in (100, 100):  # a step the first job never saves; tried again after a refusal
        try:
            dcp.save({"w": rank_state(rank, step)}, storage_writer=writer, checkpoint_id=step)
            errors.append(None)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            errors.append(f"{type(exc).__name__}: {'WriterConflict' in str(exc)}")
    leases = writer._pipeline is not None and writer._pipeline.holds_leases(rank)
    writer.close()
    return {"errors": errors, "holds_leases": leases}


def w_dcp_refused_then_free(rank: int, world: int, root: str, gate: str) -> dict[str, Any]:
    """A DCP job refused while another writer holds rank 0's lease on its folder (rank 1's
    lease was free: taken, then given back), saving again through the same writer once that
    writer has gone: every rank must take its lease again before it writes."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierWriter

    writer = TierWriter([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    errors = []
    for _ in range(2):
        try:
            dcp.save({"w": rank_state(rank, 100)}, storage_writer=writer, checkpoint_id=100)
            errors.append(None)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            errors.append("WriterConflict" in str(exc))
        if errors[-1] is None:
            break
        Path(gate, f"refused-{rank}").touch()
        deadline = time.monotonic() + 120
        while not Path(gate, "free").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    leases = writer._pipeline is not None and writer._pipeline.holds_leases(rank)
    writer.close()
    return {"errors": errors, "holds_leases": leases}


def w_first_save_fails_on_one_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    """Rank 1's first save holds what cannot be saved: it raises, and every other rank's
    first save raises too (none writes; none hangs). The next save, good on every rank,
    commits."""
    ck = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    state: dict[str, Any] = rank_state(rank, 1)
    if rank == 1:
        state["bad"] = object()
    error = None
    try:
        ck.save(state, 1)
    except Exception as exc:
        error = type(exc).__name__
    dist.barrier()
    ck.save(rank_state(rank, 2), 2).wait(timeout=120)
    tdist.wait_committed(ck.backend("local"), 2, timeout=120)
    steps = ck.steps()
    ck.close()
    return {"error": error, "steps": steps}


# -- command line: the blocking measurement -----------------------------------------------


def _blocking_table(root: str, mb: int = 32) -> list[dict[str, Any]]:
    rows = []
    for world, slow in ((1, -1), (2, -1), (2, 1)):
        res = run(
            "w_blocking",
            world,
            timeout=300,
            root=root,
            mb=mb,
            slow_rank=slow,
            slow_write_s=0.05,
            tag=f"slow{slow}",
        )
        case = f"{world} rank(s)" + (", rank 1 flushes slowly" if slow >= 0 else "")
        for r in res if slow >= 0 else res[:1]:
            r["case"] = f"{case}: rank {r['rank']}"
            rows.append(r)
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] != ["blocking"]:
        print("usage: python tests/dist_workers.py blocking [MiB]")
        return 2
    mb = int(argv[1]) if len(argv) > 1 else 32
    with tempfile.TemporaryDirectory() as root:
        for r in _blocking_table(root, mb):
            print(
                f"{r['case']:<42} saves {r['saves']:>3}  blocked per save: mean "
                f"{r['blocked_ms_mean']:.2f} ms  p50 {r['blocked_ms_p50']:.2f} ms  max "
                f"{r['blocked_ms_max']:.2f} ms  loop {r['loop_s']:.2f} s (ideal "
                f"{r['ideal_loop_s']:.2f} s)"
            )
    return 0


if __name__ == "__main__":
    # run through the importable module so the forkserver can find the rank functions
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import dist_workers

    sys.exit(dist_workers.main(sys.argv[1:]))


# -- scale: format v2, LIST-only commit, one manifest read per node (tests/test_scale.py) ----


def w_scale_native(rank: int, world: int, s3: dict[str, str], per_node: int) -> dict[str, Any]:
    """Save two steps to S3 (format v2, 16 prefixes) and load the newest; the ranks form
    nodes of ``per_node`` (TIERCKPT_NODE), whose leaders alone read the manifest."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank // per_node}"
    tier = S3Tier(
        f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=None, prefixes=16
    )
    with (
        tdist.knobs(commit_timeout=60, poll_max=0.2),
        Checkpointer([tier], host_buffer_bytes=16 << 20, chunk_bytes=64 << 10) as ck,
    ):
        for step in (1, 2):
            ck.save(rank_state(rank, step), step).wait(timeout=60)
            tdist.wait_committed(ck.backend("s3"), step, timeout=60)
        dist.barrier()
        got = ck.load()
        dist.barrier()
        return {"diff": same(got, rank_state(rank, 2)), "steps": ck.steps()}


def w_agree_lineage(rank: int, world: int, s3: dict[str, str], per_node: int) -> dict[str, Any]:
    """Save three steps to S3 and load with ``fallback="previous"`` (three candidates): the
    ranks agree on the newest after the leaders read its manifest alone."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank // per_node}"
    tier = S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=None)
    with (
        tdist.knobs(commit_timeout=60, poll_max=0.2),
        Checkpointer([tier], host_buffer_bytes=16 << 20, chunk_bytes=64 << 10) as ck,
    ):
        for step in (1, 2, 3):
            ck.save(rank_state(rank, step), step).wait(timeout=60)
            tdist.wait_committed(ck.backend("s3"), step, timeout=60)
        dist.barrier()
        got = ck.load(fallback="previous")
        dist.barrier()
        return {"diff": same(got, rank_state(rank, 3)), "steps": ck.steps()}


def w_agree_older(rank: int, world: int, root: str) -> dict[str, Any]:
    """Save steps 1 and 2 to one shared folder, then rank 1's shard of step 2 is deleted: rank
    0's newest readable is 2, rank 1's is 1, and both must load step 1."""
    with Checkpointer([LocalTier(root, keep_last=None)], host_buffer_bytes=16 << 20) as ck:
        for step in (1, 2):
            ck.save(rank_state(rank, step), step).wait(timeout=60)
            tdist.wait_committed(ck.backend("local"), step, timeout=60)
        dist.barrier()
        if rank == 0:
            (Path(root) / shard_name(2, 1)).unlink()
        dist.barrier()
        got = ck.load(fallback="previous")
        return {"diff": same(got, rank_state(rank, 1))}


def _outage_s3(bucket: str, endpoint: str) -> S3Tier:
    """The outage workers' S3 tier (behind the test's fault proxy): a held request costs 2
    attempts x 10 s."""
    return S3Tier(
        f"s3://{bucket}/run",
        endpoint_url=endpoint,
        connect_timeout=1,
        read_timeout=10,
        max_attempts=2,
    )


def _outage_begins(rank: int, root: str) -> None:
    """Every rank: rank 0 tells the test the healthy part is done (``ready``), then all wait
    until the test holds every S3 request (``outage-on``)."""
    dist.barrier()
    if rank == 0:
        Path(root, "ready").touch()
    end = time.monotonic() + 60
    while not Path(root, "outage-on").exists():
        assert time.monotonic() < end, "the test never started the outage"
        time.sleep(0.05)


def w_dcp_s3_outage(rank: int, world: int, root: str, endpoint: str, bucket: str) -> dict[str, Any]:
    """Every rank: ``dcp.save`` of step 1 through a ``TierWriter`` of a shared local folder and
    an S3 prefix (the test's fault proxy); then, once the test holds every S3 request (it is
    told by ``ready``, and says ``outage-on``), steps 2 and 3: how long each save took,
    what the local folder committed, and whether each rank loads its step 3 back."""
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter

    s3 = _outage_s3(bucket, endpoint)
    local = os.path.join(root, "shared")
    out: dict[str, Any] = {"took": []}
    w = TierWriter([LocalTier(local), s3])
    w.save_deadline = 2.0
    for step in (1, 2, 3):
        if step == 2:
            _outage_begins(rank, root)
        t0 = time.monotonic()
        w.reset(str(step))
        dcp.save({f"w{rank}": torch.full((256, 64), float(10 * step + rank))}, storage_writer=w)
        out["took"].append(time.monotonic() - t0)
    w.close()
    dist.barrier()
    with Checkpointer([LocalTier(local)]) as ck:
        out["local"] = [[c.step, c.timeline] for c in ck.checkpoints()]
    got = {f"w{rank}": torch.empty(256, 64)}
    dcp.load(got, storage_reader=TierReader([LocalTier(local)]))
    out["loaded_ok"] = bool(torch.equal(got[f"w{rank}"], torch.full((256, 64), float(30 + rank))))
    return out


def w_load_during_s3_outage(
    rank: int, world: int, root: str, endpoint: str, bucket: str
) -> dict[str, Any]:
    """Every rank saves steps 1 and 2 to a private local folder and an S3 prefix (the test's
    fault proxy); once the test holds every S3 request (``ready``, then ``outage-on``), a new
    ``Checkpointer`` per rank (a restarted job) loads the newest: how long it took and what."""
    s3 = _outage_s3(bucket, endpoint)
    tiers = [LocalTier(os.path.join(root, f"nvme-{rank}"), name="nvme"), s3]
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        with Checkpointer(tiers) as ck:
            for step in (1, 2):
                ck.save(_run_state(rank, step, 1), step).wait(timeout=60)
        _outage_begins(rank, root)
        t0 = time.monotonic()
        ck = Checkpointer(tiers)
        got = ck.load()
        took = time.monotonic() - t0
        diff = same(got, _run_state(rank, 2, 1))
        ck.close()
    return {"took": took, "diff": diff}


def _ws_state(rank: int, world: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * world + 10 * rank + step)
    return {"w": torch.randn(4096, generator=g), "step": step, "world": world}


def w_world_size_resume(
    rank: int,
    world: int,
    root: str,
    steps: int,
    step: int | None = None,
    timeline: int | None = None,
    keep_last: int | None = 2,
    fresh: bool = False,
) -> dict[str, Any]:
    """A job's resume as ``examples/torchrun_train.py`` writes it (``except
    CheckpointNotFound``: start from step 0), then ``steps`` saves; with ``step``,
    ``load(step, timeline=)`` instead; ``fresh``: no load (a new run on the folder).
    ``WorldSizeMismatch`` ends it, reported."""
    import tierckpt

    # (a stand-in where it does not exist: the test then fails at its assertions)
    mismatch = getattr(tierckpt, "WorldSizeMismatch", type("NoSuchError", (Exception,), {}))
    ck = Checkpointer([LocalTier(root, keep_last=keep_last)], chunk_bytes=64 << 10)
    out: dict[str, Any] = {}
    start = 0
    try:
        if fresh:
            raise CheckpointNotFound("a new run: nothing loaded")
        got = ck.load(step, timeline=timeline) if step is not None else ck.load()
        start = int(got["step"])
        out["loaded"] = [start, int(got["world"])]
        out["exact"] = torch.equal(got["w"], _ws_state(rank, int(got["world"]), start)["w"])
    except CheckpointNotFound as exc:
        out["not_found"] = str(exc)
    except mismatch as exc:
        out["mismatch"] = str(exc)
        ck.close()
        return out
    for s in range(start + 1, start + 1 + steps):
        ck.save(_ws_state(rank, world, s), s).wait(timeout=120)
    out["saved"] = [start + 1, start + steps]
    ck.close()
    return out


def w_skip_one_save(rank: int, world: int, root: str) -> dict[str, str]:
    """Steps 1-5 on every rank, except that rank 1 skips step 3 (a bug in the caller): how
    each save ended on this rank."""
    ck = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    out: dict[str, str] = {}
    for step in range(1, 6):
        if rank == 1 and step == 3:
            continue
        try:
            ck.save({"w": torch.full((1024,), float(100 * rank + step))}, step).wait(timeout=120)
            out[str(step)] = "ok"
        except CheckpointFailed as exc:
            out[str(step)] = str(exc)
    ck.close()
    return out


def w_load_one_rank_vanishes(rank: int, world: int, root: str, save: bool) -> dict[str, Any]:
    """``save``: steps 1-3 on every rank. Else a load where rank 1's first read of the chosen
    step fails as a shard that retention deleted after the ranks agreed would (once): what
    each rank's load returned or raised."""
    from tierckpt.checkpointer import _loading

    ck = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    if save:
        for step in (1, 2, 3):
            ck.save({"w": torch.full((256,), float(10 * rank + step)), "step": step}, step).wait()
        ck.close()
        return {}
    real = _loading._load_from
    failed = []

    def vanishing(*args: Any, **kwargs: Any) -> Any:
        if rank == 1 and not failed:
            failed.append(1)
            raise CheckpointNotFound("rank-000001's shard does not exist (deleted while read)")
        return real(*args, **kwargs)

    _loading._load_from = vanishing  # type: ignore[assignment]
    try:
        got = ck.load()
        return {"step": int(got["step"]), "w": float(got["w"][0])}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        _loading._load_from = real  # type: ignore[assignment]
        ck.close()


def w_load_into_one_rank_fails(rank: int, world: int, root: str, save: bool) -> dict[str, Any]:
    """``save``: step 1 on every rank. Else ``load(into=...)`` where rank 1's read fails with a
    corrupt shard: what each rank raised, and whether its ``into`` tensor was written."""
    from tierckpt.checkpointer import _loading

    ck = Checkpointer([LocalTier(root, keep_last=None)], chunk_bytes=64 << 10)
    if save:
        ck.save({"w": torch.full((256,), float(10 + rank))}, 1).wait()
        ck.close()
        return {}
    real = _loading._load_from

    def corrupt(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            raise CorruptCheckpoint("rank-000001's shard: checksum mismatch in chunk 0")
        return real(*args, **kwargs)

    _loading._load_from = corrupt  # type: ignore[assignment]
    mine = {"w": torch.zeros(256)}
    try:
        ck.load(into=mine)
        error = ""
    except Exception as exc:
        error = type(exc).__name__
    finally:
        _loading._load_from = real  # type: ignore[assignment]
        ck.close()
    return {"error": error, "written": bool(mine["w"].any())}
