"""tierckpt: checkpoint PyTorch training state without stopping training."""

from __future__ import annotations

from tierckpt._version import __version__
from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import (
    BackendError,
    CheckpointExists,
    CheckpointFailed,
    CheckpointNotFound,
    CheckpointSkipped,
    CloseTimeout,
    CommitTimeout,
    CopySkipped,
    CorruptCheckpoint,
    CorruptChunk,
    FormatError,
    InheritedThroughFork,
    LeaseLost,
    NewerFormat,
    RankFailed,
    SaveDeadlineExceeded,
    StaleTimeline,
    StateChanged,
    StateMismatch,
    TierCkptError,
    TiersUnreadable,
    UnknownCodec,
    UnsupportedObject,
    WorldSizeMismatch,
    WriterConflict,
)
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle, TierResult
from tierckpt.noderam import NodeRamTier
from tierckpt.peer import PeerTier
from tierckpt.policy import (
    AzureTier,
    GCSTier,
    LocalTier,
    MemoryTier,
    S3Tier,
    TierPolicy,
    TierSpec,
)
from tierckpt.preemption import Preemption
from tierckpt.stats import CheckpointEvent, CommitStats
from tierckpt.urls import tier

__all__ = [
    "AzureTier",
    "BackendError",
    "CheckpointEvent",
    "CheckpointExists",
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
    "GCSTier",
    "InheritedThroughFork",
    "LeaseLost",
    "LocalTier",
    "MemoryTier",
    "NewerFormat",
    "NodeRamTier",
    "PeerTier",
    "Preemption",
    "RankFailed",
    "S3Tier",
    "SaveDeadlineExceeded",
    "CloseTimeout",
    "SaveHandle",
    "StaleTimeline",
    "StateChanged",
    "StateMismatch",
    "TierCkptError",
    "TierPolicy",
    "TierResult",
    "TierSpec",
    "TiersUnreadable",
    "UnknownCodec",
    "UnsupportedObject",
    "WorldSizeMismatch",
    "WriterConflict",
    "__version__",
    "tier",
]
