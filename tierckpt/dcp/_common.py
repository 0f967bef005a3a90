"""Limits and set-up shared by the DCP writer and reader: format constants, a
``checkpoint_id`` parsed as a step, and the tiers built from a policy."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

from tierckpt.format import manifest_name
from tierckpt.pipeline import Tier, open_tiers
from tierckpt.policy import TierPolicy, TierSpec

METADATA_FORMAT = "tierckpt-dcp-metadata"
METADATA_VERSION = 1
MAX_METADATA_BYTES = 1 << 30
MAX_DIMS = 64
_DCP_VERSION = "1.0.0"
#: fqn prefix of the extra per-rank WriteResult that carries the rank's shard refs to finish()
_SHARDS_FQN = "\x00tierckpt-shards/"
_KEY = re.compile(r"^[0-9]{1,12}$")
_LAYOUTS = {str(v): v for v in (torch.strided, torch.sparse_coo, torch.sparse_csr)}
_MEMORY_FORMATS = {
    str(v): v
    for v in (
        torch.contiguous_format,
        torch.channels_last,
        torch.channels_last_3d,
        torch.preserve_format,
    )
}

TiersArg = Sequence[TierSpec] | TierPolicy


def _parse_step(checkpoint_id: object) -> int:
    """A DCP ``checkpoint_id`` names the step: ``100``, ``"100"`` or ``"step-100"``."""
    if type(checkpoint_id) is int:
        s: object = checkpoint_id
    else:
        text = os.fspath(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else ""
        text = str(text).removeprefix("step-")
        s = int(text) if text.isdigit() else None
    if type(s) is not int or s < 0:
        raise ValueError(
            f"a tierckpt DCP checkpoint_id is the step number (100, '100' or 'step-100'), got "
            f"{checkpoint_id!r}"
        )
    manifest_name(s)  # range check
    return s


def _runtimes(policy: TierPolicy) -> list[Tier]:
    return open_tiers(policy)
