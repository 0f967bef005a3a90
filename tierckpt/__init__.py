"""tierckpt: checkpoint PyTorch training state without stopping training."""

from __future__ import annotations

__version__ = "0.1.0"

from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import (
    BackendError,
    CheckpointFailed,
    CheckpointNotFound,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    LeaseLost,
    StateMismatch,
    TierCkptError,
    UnknownCodec,
    UnsupportedObject,
    WriterConflict,
)
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.observe import CommitStats
from tierckpt.policy import LocalTier, MemoryTier, S3Tier, TierPolicy, TierSpec

__all__ = [
    "BackendError",
    "CheckpointFailed",
    "CheckpointNotFound",
    "Checkpointer",
    "CommitStats",
    "CorruptCheckpoint",
    "CorruptChunk",
    "FormatError",
    "LeaseLost",
    "LocalTier",
    "MemoryTier",
    "S3Tier",
    "SaveHandle",
    "StateMismatch",
    "TierCkptError",
    "TierPolicy",
    "TierResult",
    "TierSpec",
    "UnknownCodec",
    "UnsupportedObject",
    "WriterConflict",
    "__version__",
]
