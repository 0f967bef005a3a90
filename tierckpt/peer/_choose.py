"""Which checkpoint a load restores and where each rank's shard comes from, decided alike
on every rank from what each rank said it holds (the vectors of ``prepare_load``'s
all_gather: its node RAM's newest ids, its slower tiers' newest ids with the tier's index,
the partners' replicas it keeps as ``(source rank, id)`` pairs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierckpt.distributed import checkpoint_of_key
from tierckpt.format import CheckpointId

__all__ = ["choose"]


def choose(
    gathered: Sequence[torch.Tensor],
    k: int,
    names: Sequence[str],
    partners: Sequence[Sequence[int]],
    step: int | None,
    timeline: int | None,
) -> tuple[CheckpointId, list[str], list[tuple[int, int]]] | None:
    """The newest checkpoint every rank can restore (of ``step`` / ``timeline`` where
    given), each rank's source (``"noderam"``, ``"peer:<rank>"`` or a slower tier's name)
    and the pulls ``(holder, receiver)`` it takes; None where no checkpoint is common.
    ``k``: ids per part of a vector; ``names``: the tiers, by index; ``partners[r]``: the
    ranks holding rank r's replicas, preferred in that order."""
    rams: list[set[CheckpointId]] = []
    slows: list[dict[CheckpointId, str]] = []
    holders: dict[tuple[int, CheckpointId], list[int]] = {}
    for h, g in enumerate(gathered):
        v = [int(x) for x in g.tolist()]
        rams.append({checkpoint_of_key(x) for x in v[:k] if x >= 0})
        slows.append(
            {checkpoint_of_key(v[j]): names[v[j + 1]] for j in range(k, 3 * k, 2) if v[j] >= 0}
        )
        for j in range(3 * k, len(v), 2):
            if v[j] >= 0:
                holders.setdefault((v[j], checkpoint_of_key(v[j + 1])), []).append(h)
    avail = [
        rams[r] | set(slows[r]) | {c for (s, c) in holders if s == r} for r in range(len(gathered))
    ]
    common = set.intersection(*avail)
    if step is not None:
        common = {c for c in common if c.step == step}
    if timeline is not None:
        common = {c for c in common if c.timeline == timeline}
    if not common:
        return None
    chosen = max(common)
    sources: list[str] = []
    pulls: list[tuple[int, int]] = []  # (holder, receiver)
    for r in range(len(gathered)):
        if chosen in rams[r]:
            sources.append("noderam")
            continue
        have = holders.get((r, chosen), [])
        order = [p for p in partners[r] if p in have] + sorted(set(have) - set(partners[r]))
        if order:
            pulls.append((order[0], r))
            sources.append(f"peer:{order[0]}")
        else:
            sources.append(slows[r].get(chosen, "?"))
    return chosen, sources, pulls
