"""One way to build a tier from a location: ``tier("s3://bucket/run", keep_last=5)``.

The scheme picks the tier class, so a URL a user already passes to Lightning or DCP works
as it is: ``s3://`` → :class:`~tierckpt.policy.S3Tier`, ``file:///path`` or a plain path →
:class:`~tierckpt.policy.LocalTier`, ``memory://namespace`` →
:class:`~tierckpt.policy.MemoryTier`. Stores this version has no backend for are refused
with the schemes it has, never written to a local folder named after the URL.
"""

from __future__ import annotations

import os
from typing import Any

from tierckpt import policy
from tierckpt.policy import LocalTier, MemoryTier, S3Tier, TierSpec
from tierckpt.redact import redact

__all__ = ["tier"]

#: scheme -> the name of the tier class in tierckpt.policy that handles it (classes that a
#: build does not have are refused with a message naming the schemes it does handle)
_SCHEMES = {"s3": "S3Tier", "gs": "GCSTier", "gcs": "GCSTier", "az": "AzureTier"}


def tier(url: str | os.PathLike[str], **options: Any) -> TierSpec:
    """The tier for ``url``; ``options`` go to the tier class (``keep_last``, ``every``,
    ``codec``, ``name``, ``source``, and the store's own: ``endpoint_url``, ``profile``...)."""
    text = os.fspath(url)
    if not isinstance(text, str) or not text:
        raise ValueError("tier() needs a location: a folder path or a URL such as s3://bucket/run")
    if "://" not in text:
        return LocalTier(text, **options)
    scheme = text.partition("://")[0].lower()
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
