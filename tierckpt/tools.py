"""Old name of :mod:`tierckpt.offline` (offline operations on stored checkpoints: list,
inspect, verify, copy, collect garbage).

Kept so that code and docs that ``import tierckpt.tools`` keep working; new code imports
:mod:`tierckpt.offline`.
"""

from __future__ import annotations

from tierckpt.offline import (
    GroupStats,
    Inspection,
    LeaseInfo,
    TensorInfo,
    copy_checkpoint,
    gc,
    inspect_checkpoint,
    is_s3_url,
    leases,
    list_checkpoints,
    open_backend,
    resolve_id,
    resolve_step,
    tensor_paths,
    unlock,
    verify_checkpoint,
)

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
