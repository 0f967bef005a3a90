"""The :class:`PeerTier` spec: replicas of each rank's node-RAM shard in partner nodes' RAM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from tierckpt.backends.base import Backend
from tierckpt.policy import TierSpec

__all__ = ["PeerTier"]


@dataclass(frozen=True, slots=True, init=False)
class PeerTier(TierSpec):
    """Each rank's committed node-RAM shard, copied to the node RAM of ``replicas`` partner
    nodes, so that a replacement for a lost node restores from memory instead of from S3.

    Needs a :class:`~tierckpt.NodeRamTier` listed before it (``source``: its name, default
    the first one) and an initialized ``torch.distributed`` group. The copies go, in a
    background thread, over a gloo process group created for them when the
    ``Checkpointer`` is built (every rank builds it together) — never the training group.
    ``keep_last``: replicas kept per partner shard (default 1); ``keep_every_n_steps`` and
    ``keep_best`` (by ``best_metric``, ``best_mode``) keep more, as on the other tiers, decided
    per partner shard from the replicated manifests (they carry ``save(metrics=...)``), all
    inside the partner's node-RAM budget (a replica that does not fit is declined, logged).
    A replica its source's node RAM keeps beyond its newest (pinned with
    ``Checkpointer.pin`` on that rank, or kept by the ``NodeRamTier``'s ``keep_best`` /
    ``keep_every_n_steps``) is kept too. ``placement``: the partner
    ranks of every rank (``placement[r]``: ``replicas`` ranks on other nodes), default a ring
    over the nodes (the same local rank on the next node). ``timeout_s``: how long one
    transfer may wait for its partner before replication is given up for this run (logged).
    See :mod:`tierckpt.peer`.
    """

    replicas: int = 1
    placement: tuple[tuple[int, ...], ...] | None = None
    timeout_s: float = 300.0

    is_replica = True

    def __init__(
        self,
        replicas: int = 1,
        *,
        keep_last: int | None = 1,
        source: str | None = None,
        placement: Sequence[Sequence[int]] | None = None,
        timeout_s: float = 300.0,
        name: str = "peer",
        keep_every_n_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
    ) -> None:
        if type(replicas) is not int or replicas < 1:
            raise ValueError(f"PeerTier replicas must be an int >= 1, got {replicas!r}")
        if not timeout_s > 0:
            raise ValueError(f"PeerTier timeout_s must be > 0 seconds, got {timeout_s!r}")
        fixed = None
        if placement is not None:
            fixed = tuple(tuple(int(p) for p in ps) for ps in placement)
        object.__setattr__(self, "replicas", replicas)
        object.__setattr__(self, "placement", fixed)
        object.__setattr__(self, "timeout_s", float(timeout_s))
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "max_behind", 2)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "keep_last", keep_last)
        object.__setattr__(self, "every", 1)
        object.__setattr__(self, "codec", "raw")
        object.__setattr__(self, "keep_every_n_steps", keep_every_n_steps)
        object.__setattr__(self, "keep_best", keep_best)
        object.__setattr__(self, "best_metric", best_metric)
        object.__setattr__(self, "best_mode", best_mode)
        TierSpec.__post_init__(self)

    def make_backend(self) -> Backend:
        raise TypeError(
            f"tier {self.name!r} is a PeerTier: it has no backend of its own (it copies the "
            "node-RAM tier's commits to partner nodes); only a Checkpointer can drive it"
        )
