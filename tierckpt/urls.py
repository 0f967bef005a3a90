"""One way to build a tier from a location: ``tier("s3://bucket/run", keep_last=5)``.

The scheme picks the tier class, so a URL a user already passes to Lightning or DCP works
as it is: ``s3://`` → :class:`~tierckpt.policy.S3Tier`, ``file:///path`` or a plain path →
:class:`~tierckpt.policy.LocalTier`, ``memory://namespace`` →
:class:`~tierckpt.policy.MemoryTier`. Stores this version has no backend for are refused
with the schemes it has, never written to a local folder named after the URL.

:func:`as_policy` is what ``Checkpointer``, ``TierReader`` and ``TierWriter`` do with their
``tiers``: a location alone (``Checkpointer("/nvme/run1")``, ``Checkpointer("s3://b/run1")``)
is one tier, a list may mix tier objects and locations, fastest first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

from tierckpt import policy
from tierckpt.locations import canonical_url
from tierckpt.policy import LocalTier, MemoryTier, S3Tier, TierPolicy, TierSpec
from tierckpt.redact import redact, shown

__all__ = ["TiersLike", "as_policy", "tier"]

#: one location or tier, or several fastest first, or a built policy
TiersLike: TypeAlias = (
    TierPolicy | TierSpec | str | os.PathLike[str] | Iterable[TierSpec | str | os.PathLike[str]]
)

_TAKES = (
    "a tier (MemoryTier, LocalTier, S3Tier, ...), a folder path or URL such as "
    "'/nvme/run1' or 's3://bucket/run1', or a list of them fastest first"
)

#: scheme -> the name of the tier class in tierckpt.policy that handles it (classes that a
#: build does not have are refused with a message naming the schemes it does handle)
_SCHEMES = {"s3": "S3Tier", "gs": "GCSTier", "az": "AzureTier"}


def tier(url: str | os.PathLike[str], **options: Any) -> TierSpec:
    """The tier for ``url``; ``options`` go to the tier class (``keep_last``, ``every``,
    ``codec``, ``name``, ``source``, and the store's own: ``endpoint_url``, ``profile``...)."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ValueError("tier() needs a location: a folder path or a URL such as s3://bucket/run")
    if "://" not in text:
        return LocalTier(text, **options)
    text = canonical_url(text)
    scheme = text.partition("://")[0]
    if scheme == "file":
        return LocalTier(text, **options)
    if scheme == "memory":
        namespace = text.partition("://")[2] or "default"
        return MemoryTier(namespace=namespace, **options)
    cls_name = _SCHEMES.get(scheme)
    cls = getattr(policy, cls_name, None) if cls_name else None
    if cls is None:
        stores = sorted(f"{s}://" for s, n in _SCHEMES.items() if hasattr(policy, n))
        handled = ["a folder path", "file://", "memory://", *stores]
        raise ValueError(
            f"tier({redact(text)!r}): no tier handles {scheme}:// in this version; "
            f"locations it handles: {', '.join(handled)}"
        )
    if cls is S3Tier:
        return S3Tier(text, **options)
    built: TierSpec = cls(text, **options)
    return built


def _one(item: object) -> TierSpec:
    if isinstance(item, TierSpec):
        return item
    if isinstance(item, (str, os.PathLike)):
        return tier(item)
    raise TypeError(f"tiers takes {_TAKES}; got {shown(item)} in the list")


def _hint(given: object) -> str:
    if isinstance(given, Mapping):
        return " (a dict's keys would be taken as folders: pass list(tiers.values()))"
    if type(given).__name__ in ("FileSystemWriter", "FileSystemReader", "FsspecWriter"):
        return (
            " (a DCP storage writer/reader: pass its folder here, or keep DCP with "
            "tierckpt.dcp.TierWriter / TierReader as storage_writer / storage_reader)"
        )
    return ""


def as_policy(tiers: TiersLike) -> TierPolicy:
    """``tiers`` as a :class:`~tierckpt.policy.TierPolicy`: a policy as it is; a tier or a
    location (a path, ``file://``, ``s3://``, ``gs://``, ``az://``, ``memory://``: see
    :func:`tier`) as a policy of that one tier; a list of tiers and locations, fastest first.
    Anything else (a dict, a DCP ``FileSystemWriter``, bytes, ``None``) is refused with what it
    takes."""
    if isinstance(tiers, TierPolicy):
        return tiers
    if isinstance(tiers, (TierSpec, str, os.PathLike)):
        return TierPolicy([_one(tiers)])
    if isinstance(tiers, (Mapping, bytes, bytearray, memoryview)) or not isinstance(
        tiers, Iterable
    ):
        raise TypeError(f"tiers takes {_TAKES}; got {shown(tiers)}{_hint(tiers)}")
    return TierPolicy([_one(t) for t in tiers])
