"""tierckpt: checkpoint PyTorch training state without stopping training."""

from __future__ import annotations

from tierckpt._version import __version__
from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import (
    BackendError,
    CheckpointFailed,
    CheckpointNotFound,
    CheckpointSkipped,
    CommitTimeout,
    CopySkipped,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    LeaseLost,
    RankFailed,
    SaveDeadlineExceeded,
    StateMismatch,
    TierCkptError,
    UnknownCodec,
    UnsupportedObject,
    WriterConflict,
)
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.policy import LocalTier, MemoryTier, S3Tier, TierPolicy, TierSpec
from tierckpt.stats import CommitStats
from tierckpt.urls import tier

__all__ = [
    "BackendError",
    "CheckpointFailed",
    "CheckpointId",
    "CheckpointNotFound",
    "CheckpointSkipped",
    "Checkpointer",
    "CommitStats",
    "CommitTimeout",
    "CopySkipped",
    "CorruptCheckpoint",
    "CorruptChunk",
    "FormatError",
    "LeaseLost",
    "LocalTier",
    "MemoryTier",
    "RankFailed",
    "S3Tier",
    "SaveDeadlineExceeded",
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
    "tier",
]
