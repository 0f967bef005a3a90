"""Workers (run by ``dist_workers.run("node_lag_workers:...")``): two ranks on two "nodes"
(``TIERCKPT_NODE``), each saving onto its own node-local folder, named private
(``TIERCKPT_PRIVATE_TIERS=nvme``): the manifest of a commit travels through rank 0's store and
every rank writes it onto its own copy."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import rank_state, same

import tierckpt.distributed as tdist
from tierckpt import Checkpointer, LocalTier
from tierckpt.distributed import _private
from tierckpt.errors import TierCkptError


def _tiers(root: str, rank: int) -> list[Any]:
    return [LocalTier(os.path.join(root, f"nvme-{rank}"), name="nvme", keep_last=None)]


def _state(rank: int, step: int) -> dict[str, Any]:
    return {"x": rank_state(rank, step, numel=256), "step": step}


def w_train_then_exit(rank: int, world: int, root: str, slow_fetch_s: float) -> dict[str, Any]:
    """Steps 1..3, each waited for; rank 1 is slow to fetch each manifest from rank 0's store
    (a busy node); rank 0 returns (and its process exits) right after ``close()``."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank}"
    if rank == 1:
        real = _private._store_wait

        def slow(st: Any, keys: list[str], *args: Any, **kwargs: Any) -> None:
            if any(k.endswith("manifest") for k in keys):
                time.sleep(slow_fetch_s)
            real(st, keys, *args, **kwargs)

        _private._store_wait = slow  # type: ignore[assignment]
    out: dict[str, Any] = {"errors": []}
    with tdist.knobs(commit_timeout=30, poll_max=0.2):
        ck = Checkpointer(_tiers(root, rank), chunk_bytes=64 << 10)
        for s in (1, 2, 3):
            try:
                ck.save(_state(rank, s), s).wait(timeout=60)
            except TierCkptError as exc:
                out["errors"].append(f"step {s}: {type(exc).__name__}: {exc}"[:300])
        ck.close()  # rank 0 returns here, and its process exits at once (no barrier)
    return out


def w_load_newest(rank: int, world: int, root: str, fallback: str) -> dict[str, Any]:
    """``load()`` (or ``load(fallback=...)``): the step loaded and its differences from what
    was saved, or the error's type and message."""
    os.environ["TIERCKPT_NODE"] = f"node-{rank}"
    with tdist.knobs(commit_timeout=30, poll_max=0.2):
        ck = Checkpointer(_tiers(root, rank))
        try:
            got = ck.load(fallback=fallback)  # type: ignore[arg-type]
        except TierCkptError as exc:
            out: dict[str, Any] = {"error": type(exc).__name__, "message": str(exc)[:600]}
        else:
            step = int(got["step"])
            out = {"step": step, "diff": same(got, _state(rank, step))}
        ck.close()
    dist.barrier()
    return out


def w_rank_store_fails(rank: int, world: int, root: str) -> dict[str, Any]:
    """A shared folder; from step 2 on, rank 1's writes there fail (its disk, its mount), its
    failure record included: rank 0 hears of it through the process group's store, at once,
    instead of waiting out ``commit_timeout`` (60 s here) for every such step."""
    from tierckpt.backends.local import LocalBackend

    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        ck = Checkpointer([LocalTier(os.path.join(root, "shared"), keep_last=None)])
        ck.save(_state(rank, 1), 1).wait(timeout=60)
        dist.barrier()
        if rank == 1:

            def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
                raise OSError(5, "Input/output error (the test's broken mount)")

            LocalBackend.open_writer = broken  # type: ignore[method-assign]
            LocalBackend.put_atomic = broken  # type: ignore[method-assign]
        t0 = time.monotonic()
        try:
            ck.save(_state(rank, 2), 2).wait(timeout=120)
            out["error"] = None
        except TierCkptError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"[:800]
        out["seconds"] = time.monotonic() - t0
        ck.close(timeout=30)
    dist.barrier()
    return out


def w_racing_listing(rank: int, world: int, root: str, phase: str) -> dict[str, Any]:
    """A shared folder with steps 1..3. ``load``: rank 1's first listing misses step 3 (it
    raced the commit, or its store left it out): every rank must still load step 3 (listing
    again), not step 2. ``mismatch``: rank 1's ``into`` does not fit, with
    ``fallback="previous"``: the load fails at once on every rank, walking back to no older
    checkpoint (a state mismatch is not the data's fault)."""
    from tierckpt import catalog
    from tierckpt.checkpointer import _loading

    folder = os.path.join(root, "shared")
    out: dict[str, Any] = {}
    with tdist.knobs(commit_timeout=60, poll_max=0.2):
        if phase == "save":
            with Checkpointer([LocalTier(folder, keep_last=None)]) as ck:
                for s in (1, 2, 3):
                    ck.save(_state(rank, s), s).wait(timeout=60)
            dist.barrier()
            return out
        ck = Checkpointer([LocalTier(folder, keep_last=None)])
        calls = []
        real_once = _loading._load_once

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return real_once(*args, **kwargs)

        _loading._load_once = counted  # type: ignore[assignment]
        if phase == "load":
            real = catalog.committed_ids
            first = [rank == 1]

            def late(backend: Any) -> Any:
                got = real(backend)
                if first[0]:
                    first[0] = False
                    return [c for c in got if c.step != 3]
                return got

            catalog.committed_ids = late  # type: ignore[assignment]
            got = ck.load()
            out = {"step": int(got["step"]), "diff": same(got, _state(rank, int(got["step"])))}
        else:
            into = {"x": {"w": torch.zeros(3)}, "step": 0} if rank == 1 else None
            try:
                ck.load(into=into, fallback="previous")
                out = {"error": None}
            except BaseException as exc:
                out = {"error": type(exc).__name__}
        out["load_once_calls"] = len(calls)
        ck.close()
    dist.barrier()
    return out
