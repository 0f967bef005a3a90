"""Tier folders near a local folder that holds no checkpoint: the tier folder (one with
``manifests/``) it lies inside, or those below it (two levels); and the same for an
object-store prefix. A path given one level off is the usual reason a load or ``tierckpt ls``
finds nothing; both name what they find."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tierckpt.format import MANIFEST_DIR, parse_manifest_id

if TYPE_CHECKING:
    from tierckpt.backends.base import Backend

#: how many tier folders below one a hint names at most
NEAR_SHOWN = 5
#: how many names a look below an object-store prefix lists at most: a prefix that holds a
#: dataset's million objects costs a load that found nothing ten LIST requests, not a hundred
NEAR_LISTED = 10_000


def folders_near(path: str) -> tuple[str | None, list[str]]:
    """``(inside, below)``: the nearest tier folder above ``path`` (None: none), and the tier
    folders at most two levels below it (at most :data:`NEAR_SHOWN`)."""
    path = os.path.abspath(path)
    up = os.path.dirname(path)
    while up and up != os.path.dirname(up):
        if os.path.isdir(os.path.join(up, "manifests")):
            return up, []
        up = os.path.dirname(up)
    below: list[str] = []
    try:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            if not entry.is_dir(follow_symlinks=False):
                continue
            inner = [entry.path]
            try:
                inner += sorted(e.path for e in os.scandir(entry.path) if e.is_dir())
            except OSError:
                pass
            below += [p for p in inner if os.path.isdir(os.path.join(p, "manifests"))]
            if len(below) >= NEAR_SHOWN:
                break
    except OSError:
        pass
    return None, below[:NEAR_SHOWN]


def prefixes_near(backend: Backend, root: Backend) -> tuple[str | None, list[str]]:
    """The object-store form of :func:`folders_near`, for ``backend`` (opened at a prefix
    that holds no checkpoint) and ``root`` (the same bucket at its root): the URL of the
    nearest tier prefix (one that holds ``manifests/``) above it (None: none), and the tier
    prefixes below it among its first :data:`NEAR_LISTED` names (at most :data:`NEAR_SHOWN`)."""
    parts = urlsplit(backend.url)
    base = f"{parts.scheme}://{parts.netloc}"
    segs = [p for p in parts.path.split("/") if p]
    for i in range(len(segs) - 1, -1, -1):  # the prefixes above this one, nearest first
        up = "/".join(segs[:i])
        listed = root.list_first(f"{up}/{MANIFEST_DIR}/" if up else f"{MANIFEST_DIR}/", 100)
        cut = len(up) + 1 if up else 0
        if any(parse_manifest_id(n[cut:]) for n in listed):
            return (f"{base}/{up}" if up else base), []
    below: list[str] = []
    for name in backend.list_first("", NEAR_LISTED):  # a manifest: <tier>/manifests/..
        head, sep, tail = name.rpartition(f"/{MANIFEST_DIR}/")
        tier = f"{backend.url.rstrip('/')}/{head}"
        if sep and parse_manifest_id(f"{MANIFEST_DIR}/{tail}") and tier not in below:
            below.append(tier)
            if len(below) >= NEAR_SHOWN:
                break
    return None, below
