"""The synthetic training state every contender saves: bf16 weights and fp32 Adam-style
moments of mixed sizes, with thousands of small tensors, built the same in every process."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.bench.config import GiB


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
