"""Limits and set-up shared by the DCP writer and reader: format constants, a
``checkpoint_id`` parsed as a step, and the tiers built from a policy."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable

import torch

from tierckpt.format import CheckpointId, manifest_name
from tierckpt.pipeline import Tier, open_tiers
from tierckpt.policy import TierPolicy
from tierckpt.urls import TiersLike

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

TiersArg = TiersLike


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


#: a checkpoint location as ``TierWriter`` reports it (``Metadata.storage_meta.checkpoint_id``):
#: ``<tier URL>/steps/<12 digits>`` and ``.t<6 digits>`` on a timeline >= 1
_LOCATION = re.compile(r"^(?P<url>.*)/steps/(?P<step>[0-9]{12})(?:\.t(?P<tl>[0-9]{6}))?/?$")


def _parse_location(checkpoint_id: object) -> tuple[str, CheckpointId] | None:
    """``(tier URL, checkpoint)`` of a location ``TierWriter`` reported, else None."""
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        return None
    m = _LOCATION.match(str(os.fspath(checkpoint_id)))
    if m is None:
        return None
    tl = m.group("tl")
    if tl == "000000":
        return None  # timeline 0 has the suffix-free name
    cid = CheckpointId(int(m.group("step")), int(tl) if tl else 0)
    return m.group("url").rstrip("/"), cid


def _runtimes(policy: TierPolicy, *, create: bool = True) -> list[Tier]:
    return open_tiers(policy, create=create)


#: the checkpoint this process's latest DCP load read, by tier URL (see :func:`take_loaded`)
_LOADED: dict[str, CheckpointId] = {}
_LOADED_LOCK = threading.Lock()


def note_loaded(urls: Iterable[str], cid: CheckpointId) -> None:
    """A ``TierReader`` of tiers ``urls`` read ``cid``."""
    with _LOADED_LOCK:
        for url in urls:
            _LOADED[url] = cid


def take_loaded(urls: Iterable[str]) -> CheckpointId | None:
    """The oldest checkpoint this process loaded from any of ``urls`` since the previous
    call for them (each is told once): the coordinator of a DCP save asks at each save, so a
    load between two saves is seen by the second (a rollback: see ``choose_timeline``)."""
    with _LOADED_LOCK:
        got = [c for url in urls if (c := _LOADED.pop(url, None)) is not None]
    return min(got, default=None)
