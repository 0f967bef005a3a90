"""Which ranks hold whose replicas: nodes told apart, and a ring over them."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Placement", "node_key", "ring_placement"]


def node_key(node_ram_path: str) -> int:
    """This rank's node as an int63: the host name and the node-RAM folder, so that ranks on
    one machine that use different folders (tests, or several tmpfs) count as different
    nodes, and ranks sharing a folder on a machine as one."""
    text = f"{socket.gethostname()}\0{os.path.realpath(node_ram_path)}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True, slots=True)
class Placement:
    """``partners[r]``: the ranks that keep replicas of rank ``r``'s shard, in the order a
    restore asks them."""

    partners: tuple[tuple[int, ...], ...]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps."""
        return [s for s, ps in enumerate(self.partners) if rank in ps]

    def max_sources(self) -> int:
        return max([len(self.sources(r)) for r in range(len(self.partners))] + [0])

    @staticmethod
    def fixed(partners: Sequence[Sequence[int]], world_size: int) -> Placement:
        if len(partners) != world_size:
            raise ValueError(f"placement names partners of {len(partners)} ranks, not {world_size}")
        for r, ps in enumerate(partners):
            for p in ps:
                if not 0 <= p < world_size or p == r:
                    raise ValueError(f"placement: rank {r}'s partner {p} is not another rank")
        return Placement(tuple(tuple(ps) for ps in partners))


def ring_placement(keys: Sequence[int], replicas: int) -> Placement:
    """Nodes in the order of their first rank; rank ``r`` (the ``j``-th on its node) keeps its
    replicas with the ``j``-th rank (modulo) of each of the next ``replicas`` nodes. With
    fewer nodes than ``replicas + 1`` there are fewer replicas (none on a single node)."""
    nodes: list[list[int]] = []
    where: dict[int, int] = {}
    for r, k in enumerate(keys):
        if k not in where:
            where[k] = len(nodes)
            nodes.append([])
        nodes[where[k]].append(r)
    partners: list[tuple[int, ...]] = []
    for r, k in enumerate(keys):
        i = where[k]
        j = nodes[i].index(r)
        ps = []
        for m in range(1, min(replicas, len(nodes) - 1) + 1):
            node = nodes[(i + m) % len(nodes)]
            ps.append(node[j % len(node)])
        partners.append(tuple(ps))
    return Placement(tuple(partners))
