"""Tier folders near a local folder that holds no checkpoint: the tier folder (one with
``manifests/``) it lies inside, or those below it (two levels). A path given one level off is
the usual reason a load or ``tierckpt ls`` finds nothing; both name what they find."""

from __future__ import annotations

import os

#: how many tier folders below one a hint names at most
NEAR_SHOWN = 5


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
