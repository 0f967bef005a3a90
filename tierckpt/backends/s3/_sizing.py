"""The upload-sizing rule under its old import path: it lives in :mod:`tierckpt.backends.sizing`
(shared with the object-store driver)."""

from __future__ import annotations

from tierckpt.backends.sizing import (
    AUTO_CONCURRENCY,
    AUTO_PART_SIZE,
    BUDGET_SHARE,
    MAX_PART_SIZE,
    MAX_PARTS,
    MiB,
    UploadSizing,
    choose_upload,
    parts_needed,
    shard_size_bound,
)

__all__ = [
    "AUTO_CONCURRENCY",
    "AUTO_PART_SIZE",
    "BUDGET_SHARE",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MiB",
    "UploadSizing",
    "choose_upload",
    "parts_needed",
    "shard_size_bound",
]
