"""One manifest read per node at load: the node's leader reads, its ranks share the bytes.

At 1,000 nodes x 8 GPUs, every rank reading the ~1.1 MB manifest of each checkpoint it
considers is 8.8 GB from one S3 key per load (docs/scale.md). Instead the node's leader (its
lowest rank) reads every manifest the node's ranks would read — the candidates of the load
agreement on each shared tier — and shares the raw bytes with the node's ranks through a
process group of the node (one ``broadcast_object_list``). Every rank still decodes and
validates the bytes itself. Private tiers (each rank's own RAM or disk) are read by each
rank, as before.

:class:`NodeComm` is what the sharing needs from the process group; :class:`TorchNodeComm`
is the real one (node groups from ``TIERCKPT_NODE`` or the host name, made once with
``new_subgroups_by_enumeration`` in the training thread).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tierckpt import config
from tierckpt.errors import (
    BackendError,
    CheckpointNotFound,
    CorruptCheckpoint,
    FormatError,
    TierCkptError,
)
from tierckpt.format import (
    MAX_MANIFEST_BYTES,
    CheckpointId,
    Manifest,
    decode_manifest,
    manifest_name,
)

if TYPE_CHECKING:
    from tierckpt.backends.base import Backend

__all__ = ["ManifestCache", "NodeComm", "TorchNodeComm", "read_manifests_per_node"]

#: errors a leader's read may end in, rebuilt by name on the node's other ranks
_ERRORS: dict[str, type[TierCkptError]] = {
    "CheckpointNotFound": CheckpointNotFound,
    "FormatError": FormatError,
    "CorruptCheckpoint": CorruptCheckpoint,
}


class NodeComm(Protocol):
    """The node's ranks: whether this one leads, and how the leader's bytes reach them."""

    @property
    def is_leader(self) -> bool: ...

    def share(self, payload: bytes | None) -> bytes:
        """Every rank of the node calls this once; the leader passes its bytes, the others
        None; all get the leader's bytes."""
        ...


def node_key() -> str:
    """Which node this process is on: ``TIERCKPT_NODE`` if set, else the host name."""
    return config.node_name() or socket.gethostname()


class TorchNodeComm:
    """:class:`NodeComm` over ``torch.distributed``: one subgroup per node (collective to
    make: every rank of the default group constructs it, in the same order)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        keys: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, node_key())
        nodes: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            nodes.setdefault(str(key), []).append(r)
        groups = list(nodes.values())
        me = dist.get_rank()
        self._members = next(g for g in groups if me in g)
        self._leader = self._members[0]
        self._rank = me
        # collective: every rank makes every node's group, the same on each (even where its
        # own node has one rank)
        self._group: Any = dist.new_subgroups_by_enumeration(groups)[0]  # type: ignore[no-untyped-call]
        self.nodes = len(groups)

    @property
    def is_leader(self) -> bool:
        return self._rank == self._leader

    def share(self, payload: bytes | None) -> bytes:
        if len(self._members) == 1:  # alone on the node
            assert payload is not None
            return payload
        import torch.distributed as dist

        box: list[Any] = [payload if self.is_leader else None]
        dist.broadcast_object_list(box, src=self._leader, group=self._group)
        return bytes(box[0])


def _read_raw(backend: Backend, cid: CheckpointId, tier: str) -> dict[str, Any]:
    name = manifest_name(cid.step, timeline=cid.timeline)
    where = f"tier {tier!r} {backend.url}/{name}"
    try:
        size = backend.size(name)
        if size > MAX_MANIFEST_BYTES:
            raise FormatError(f"{where}: manifest is {size} bytes, more than {MAX_MANIFEST_BYTES}")
        return {"ok": backend.get(name).decode("latin-1")}
    except TierCkptError as exc:
        kind = type(exc).__name__ if type(exc).__name__ in _ERRORS else "BackendError"
        return {"error": kind, "message": str(exc)}


def read_manifests_per_node(
    comm: NodeComm, reads: Sequence[tuple[str, Backend, CheckpointId]]
) -> ManifestCache:
    """The manifests of the leader's ``reads`` (tier name, backend, id), read by the node's
    leader only and shared with the node's ranks (one ``share``: every rank of the node calls
    this once per load). A rank looks up what it needs in the returned cache; what the leader
    did not read (its candidates differed) a rank reads itself."""
    payload: bytes | None = None
    if comm.is_leader:
        payload = json.dumps(
            [
                {
                    "tier": tier,
                    "step": cid.step,
                    "timeline": cid.timeline,
                    **_read_raw(b, cid, tier),
                }
                for tier, b, cid in reads
            ]
        ).encode()
    urls = {tier: b.url for tier, b, _cid in reads}
    cache = ManifestCache()
    for entry in json.loads(comm.share(payload)):
        tier = str(entry.pop("tier"))
        cid = CheckpointId(int(entry.pop("step")), int(entry.pop("timeline")))
        cache.put(tier, urls.get(tier, "?"), cid, entry)
    return cache


class ManifestCache:
    """Manifests (or their read errors) a node's leader read for this load."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, CheckpointId], tuple[str, dict[str, Any]]] = {}

    def put(self, tier: str, url: str, cid: CheckpointId, entry: dict[str, Any]) -> None:
        self._entries[(tier, cid)] = (url, entry)

    def update(self, other: ManifestCache) -> None:
        """Take ``other``'s entries (a later read of more candidates)."""
        self._entries.update(other._entries)

    def __contains__(self, key: tuple[str, CheckpointId]) -> bool:
        return key in self._entries

    def get(self, tier: str, cid: CheckpointId) -> Manifest:
        """The manifest of ``cid`` on ``tier``, decoded and validated here; the read's error
        where the leader's read failed."""
        url, entry = self._entries[(tier, cid)]
        name = manifest_name(cid.step, timeline=cid.timeline)
        where = f"tier {tier!r} {url}/{name}"
        if "error" in entry:
            raise _ERRORS.get(entry["error"], BackendError)(
                f"{entry['message']} (read by this node's leader)"
            )
        m = decode_manifest(entry["ok"].encode("latin-1"), where=where)
        if m.id != cid:
            raise FormatError(f"{where}: the manifest is {m.id}'s, not {cid}'s")
        return m
