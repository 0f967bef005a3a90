"""The load path: choose tier and step, read ranges in parallel, verify, decode, rebuild.

For the wanted step, tiers are tried fastest first. Each chunk's stored bytes are checked
against the checksum in the index (a chunk that fails names the tier, file and chunk, and the
reader moves on to the next tier holding the same step). Everything is decoded into fresh
storages and verified before a single byte is copied into the caller's tensors, so a failed
load never leaves ``into=`` half overwritten.

Modules: ``_index`` (manifest, index, tensor table), ``_shard`` (one rank's shard),
``_chunks`` (one chunk into its storages), ``_fetch`` (pieced fetch overlapping decode),
``_layout`` (spans and buffers), ``_repopulate`` (copies to faster tiers), ``_into``
(``load(into=)``). The names below are this package's interface; the old single module
``tierckpt.restore`` exported the same.
"""

from __future__ import annotations

import torch  # noqa: F401  (tests patch tierckpt.restore.torch)

from tierckpt.restore._index import (
    EarlyTail,
    TensorRecord,
    as_parameters,
    parse_tensor_entry,
    read_index,
    read_manifest,
    rebuild_tensor,
    start_tail,
)
from tierckpt.restore._into import (
    RECOVERABLE,
    check_into,
    is_recoverable,
    key_hint,
    log_skipped,
    restore_into,
)
from tierckpt.restore._layout import SpanLayout, ThreadBuffers
from tierckpt.restore._repopulate import Repopulation
from tierckpt.restore._shard import LoadedShard, finish_shard, read_shard, refuse_dcp

# the names of the single-module restore.py, kept for importers and tests
_SpanLayout = SpanLayout
_ThreadBuffers = ThreadBuffers
_Repopulation = Repopulation
_rebuild_tensor = rebuild_tensor

__all__ = [
    "RECOVERABLE",
    "EarlyTail",
    "LoadedShard",
    "TensorRecord",
    "as_parameters",
    "check_into",
    "key_hint",
    "log_skipped",
    "finish_shard",
    "is_recoverable",
    "parse_tensor_entry",
    "read_index",
    "read_manifest",
    "read_shard",
    "refuse_dcp",
    "restore_into",
    "start_tail",
]
