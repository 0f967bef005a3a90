"""Rank functions for tests/test_dcp_parity.py: torch's own DCP test scenarios (DTensor save
and resharded load, process-based ``async_save``), run on gloo in real processes against
``TierWriter``/``TierReader`` and, as the control, ``FileSystemWriter``/``FileSystemReader``.

``run(fn, world, **kwargs)`` starts ``world`` ranks with :func:`dist_workers.launch` (a
forkserver that imported torch, DCP and tierckpt once, a gloo process group in each) and returns
every rank's JSON result; a rank that raises fails the run with its traceback.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from dist_workers import launch


def run(fn: str, world: int, *, timeout: float = 120, **kwargs: Any) -> list[Any]:
    """Run ``fn`` (a function of this module) on ``world`` ranks (``dist_workers.launch``);
    every rank's result."""
    return launch("parity_workers", fn, world, timeout=timeout, **kwargs)


# -- writers and readers under test --------------------------------------------------------


def writer(kind: str, root: str, step: int, **kw: Any) -> Any:
    """``kind`` "tier": a TierWriter on ``root`` saving ``step``; "fs": FileSystemWriter on
    the folder ``root/step-<step>`` (DCP's layout: one folder per checkpoint)."""
    if kind == "fs":
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(os.path.join(root, f"step-{step}"), **kw)
    from tierckpt import LocalTier
    from tierckpt.dcp import TierWriter

    return TierWriter([LocalTier(root, keep_last=None)], step, **kw)


def reader(kind: str, root: str, step: int) -> Any:
    if kind == "fs":
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(os.path.join(root, f"step-{step}"))
    from tierckpt import LocalTier
    from tierckpt.dcp import TierReader

    return TierReader([LocalTier(root, keep_last=None)], step)


# -- DTensor: save with one placement, load with another (test_dtensor_resharding) ----------


def _global(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _placements(name: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    return {
        "shard0": [Shard(0)],
        "shard1": [Shard(1)],
        "replicate": [Replicate()],
        "shard0_shard1": [Shard(0), Shard(1)],
        "shard1_replicate": [Shard(1), Replicate()],
        "replicate_shard0": [Replicate(), Shard(0)],
    }[name]


def _mesh(world: int, dims: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,) if dims == 1 else (2, world // 2))


def w_reshard(
    rank: int, world: int, kind: str, root: str, save: str, load: str, dims: int = 1
) -> dict[str, Any]:
    """A DTensor (and a plain tensor and a non-tensor value beside it) saved with placements
    ``save`` and loaded into placements ``load``: every rank's local piece must equal the
    matching slice of the global tensor (torch's test_dtensor_resharding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    mesh = _mesh(world, dims)
    full = _global((8, 12), seed=1)
    sd = {
        "w": distribute_tensor(full, mesh, _placements(save)),
        "plain": torch.arange(6, dtype=torch.float64),
        "step": 17,
    }
    dcp.save(sd, storage_writer=writer(kind, root, 3))
    zero = distribute_tensor(torch.zeros_like(full), mesh, _placements(load))
    target = {"w": zero, "plain": torch.zeros(6, dtype=torch.float64), "step": 0}
    dcp.load(target, storage_reader=reader(kind, root, 3))
    got = target["w"].full_tensor()
    return {
        "equal": bool(torch.equal(got, full)),
        "local_equal": bool(
            torch.equal(
                target["w"].to_local(),
                distribute_tensor(full, mesh, _placements(load)).to_local(),
            )
        ),
        "plain": bool(torch.equal(target["plain"], torch.arange(6, dtype=torch.float64))),
        "step": target["step"],
    }


# -- FSDP2 model + optimizer through get_state_dict / set_state_dict (test_state_dict) --------


def w_fsdp_state_dict(rank: int, world: int, kind: str, root: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    def build(seed: int) -> tuple[Any, Any]:
        mesh = _mesh(world, 1)
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    def train(m: Any, opt: Any, n: int) -> None:
        g = torch.Generator().manual_seed(5)
        for _ in range(n):
            m(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    full_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, opt = build(0)
    train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer(kind, root, 7))
    ref = get_state_dict(model, opt, options=full_opts)
    model2, opt2 = build(1)
    train(model2, opt2, 1)
    msd2, osd2 = get_state_dict(model2, opt2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, storage_reader=reader(kind, root, 7))
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    got = get_state_dict(model2, opt2, options=full_opts)
    diffs = _diff(got, ref)
    # training goes on identically from the loaded state
    train(model, opt, 1)
    train(model2, opt2, 1)
    after = _diff(
        get_state_dict(model2, opt2, options=full_opts)[0],
        get_state_dict(model, opt, options=full_opts)[0],
    )
    return {"diffs": diffs, "after": after}


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path}: keys"]
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path}: length"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, f"{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# -- async_save in a background process (test_async_process_executor) -----------------------


def w_async_process(rank: int, world: int, kind: str, root: str, steps: list[int]) -> Any:
    """Several ``async_save(async_checkpointer_type=PROCESS)`` calls with one writer object,
    each state changed after the call returns; each loads back as it was at the call."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    w = writer(kind, root, steps[0])
    out: dict[str, Any] = {}
    for i, step in enumerate(steps):
        state = {"t": torch.full((64,), float(100 + i)), "i": i}
        if kind == "fs":
            w = writer(kind, root, step)
        fut = dcp.async_save(
            state,
            storage_writer=w,
            checkpoint_id=str(step) if kind == "tier" else None,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )
        state["t"].fill_(-1.0)  # the save holds a staged copy
        md = fut.result()
        out[f"checkpoint_id-{step}"] = (
            str(md.storage_meta.checkpoint_id) if md.storage_meta else None
        )
    dist.barrier()
    for i, step in enumerate(steps):
        target = {"t": torch.zeros(64), "i": -1}
        dcp.load(target, storage_reader=reader(kind, root, step))
        out[f"ok-{step}"] = bool(torch.equal(target["t"], torch.full((64,), float(100 + i))))
        out[f"i-{step}"] = target["i"]
    return out
