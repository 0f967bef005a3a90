"""Replicas in a partner node's RAM: :class:`PeerTier`.

A :class:`~tierckpt.NodeRamTier` survives a crashed process, not a lost node. With a
``PeerTier`` in the policy each rank's node-RAM shard is also copied, after each commit there,
to the node RAM of ``replicas`` partner ranks on other nodes (a ring over the nodes by
default), so that the replacement of a lost node restores from memory instead of from S3::

    Checkpointer([NodeRamTier(keep_last=2), PeerTier(replicas=1),
                  LocalTier("/nvme/run"), S3Tier("s3://bucket/run", every=10)])

Save
    The copies run in a background thread over a gloo process group created for them when the
    ``Checkpointer`` is built — never the training group, never a collective on the training
    stream — straight from the shard file in shared memory into the partner's (no staging
    buffer: the host memory a copy takes is the replica itself, counted in the partner's
    node-RAM budget). A partner keeps ``keep_last`` replicas of each shard it holds.

Load
    Before reading, every rank reports what it holds (its own node RAM, the replicas it keeps
    for others, the checkpoints the slower tiers list) over a second gloo group; all ranks
    agree on the newest checkpoint every rank can restore, and per shard the source is, in
    order: the rank's own node RAM, a partner's replica (pulled into the rank's node RAM, then
    read from there), the local disk, S3. A rank that falls back to a slower tier says so in
    the log (a warning naming the tier); ``PeerReplicator.last_restore`` records every rank's
    source.

Failures
    A round of copies that fails (a partner died: the group's timeout, ``timeout_s``) ends
    replication for the run, logged; saves and loads go on without it.
"""

from __future__ import annotations

from tierckpt.peer._placement import Placement, ring_placement
from tierckpt.peer._replicator import PeerReplicator, RestoreReport, open_peer
from tierckpt.peer._spec import PeerTier

__all__ = [
    "PeerReplicator",
    "PeerTier",
    "Placement",
    "RestoreReport",
    "open_peer",
    "ring_placement",
]
