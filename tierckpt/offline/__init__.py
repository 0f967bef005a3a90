"""Offline operations on stored checkpoints: list, inspect, verify, copy, collect garbage.

These work on any tier's storage given its URL (a local folder or ``s3://bucket/prefix``),
with no :class:`~tierckpt.Checkpointer` and no training job. The ``tierckpt`` command is a
thin layer over them; they are also usable from Python::

    from tierckpt import offline
    src = offline.open_backend("s3://bucket/run1")
    for m in offline.list_checkpoints(src):
        print(m.step, m.stored_bytes)
    offline.verify_checkpoint(src, step=1000)         # raises CorruptChunk on a bad chunk
    offline.copy_checkpoint(src, offline.open_backend("/nvme/run1"), step=1000)

A step names the checkpoint of the newest timeline holding it (a run resumed from an older
step saves on a new timeline, see :class:`~tierckpt.format.CheckpointId`); pass ``timeline=``
or a ``CheckpointId`` to name another one.

Behind this module: ``_listing`` (open a URL, list, name a checkpoint), ``_inspect``,
``_verify``, ``_copy``, ``_gc`` and ``_leases``, one per operation; ``_repair`` judges and
replaces a copy already at a ``pull`` / ``push`` destination.
"""

from __future__ import annotations

from tierckpt.offline._copy import (
    copy_checkpoint,
)
from tierckpt.offline._gc import (
    gc,
)
from tierckpt.offline._inspect import (
    GroupStats,
    Inspection,
    TensorInfo,
    inspect_checkpoint,
    tensor_paths,
)
from tierckpt.offline._leases import (
    LeaseInfo,
    leases,
    unlock,
)
from tierckpt.offline._listing import (
    is_s3_url,
    list_checkpoints,
    open_backend,
    resolve_id,
    resolve_step,
)
from tierckpt.offline._verify import (
    verify_checkpoint,
)

# importable from here before this module became a package; not public API (`as`: exported)
# isort: off
from tierckpt.offline._copy import (
    COPY_BLOCK as COPY_BLOCK,
    checkpoint_bytes as checkpoint_bytes,
)
from tierckpt.offline._gc import (
    GcPlan as GcPlan,
)
from tierckpt.offline._listing import (
    ListedCheckpoint as ListedCheckpoint,
    Progress as Progress,
    id_text as id_text,
    uncommitted_ids as uncommitted_ids,
    uncommitted_steps as uncommitted_steps,
)
from tierckpt.offline._verify import (
    VerifyReport as VerifyReport,
)
# isort: on

__all__ = [
    "GroupStats",
    "Inspection",
    "LeaseInfo",
    "TensorInfo",
    "copy_checkpoint",
    "gc",
    "inspect_checkpoint",
    "is_s3_url",
    "leases",
    "list_checkpoints",
    "open_backend",
    "resolve_id",
    "resolve_step",
    "tensor_paths",
    "unlock",
    "verify_checkpoint",
]
