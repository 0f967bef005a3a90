"""What a load that found no checkpoint says about the tiers it read: a local tier's folder
inside a tier folder or above some (:func:`tierckpt.near.folders_near`), an object-store
tier's prefix inside a tier prefix or above some (:func:`tierckpt.near.prefixes_near`). A
job that starts afresh when nothing is found would otherwise say nothing: the hint is logged
as a warning as well as put in the error."""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Collection, Sequence
from urllib.parse import urlsplit

from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.near import folders_near, prefixes_near
from tierckpt.pipeline import Tier
from tierckpt.policy import TierSpec
from tierckpt.redact import redact

log = logging.getLogger("tierckpt")


def first_look(tiers: Sequence[Tier]) -> bool:
    """True the first time a listing of ``tiers`` found nothing (a writer's ``steps()``, once:
    a job that checks ``if ck.steps():`` before ``load()`` is told where checkpoints are)."""
    key = tiers[0].backend if tiers else None
    try:
        if key is None or key in _LOOKED:
            return False
        _LOOKED.add(key)
    except TypeError:  # a backend that cannot be weakly referenced: never looked around
        return False
    return True


_LOOKED: weakref.WeakSet[Backend] = weakref.WeakSet()


def near_tiers(
    tiers: Sequence[Tier], listed: Collection[str], rank: int, doing: str = "load"
) -> str:
    """The hint for a load (or a listing: ``doing``) that found no checkpoint on ``tiers``
    (``listed``: the names of those that could be listed); empty when there is none. Object
    stores are looked around by rank 0 only (a thousand ranks would send a thousand times the
    LIST requests), and only those that answered the load's own listing."""
    said = []
    for t in tiers:
        b = t.backend
        if isinstance(b, LocalBackend) and not b.is_node_local:
            inside, below = folders_near(b.root)
            what, where, outer = "folder", b.root, "tier folder"
            outers = "tier folders"
        elif b.is_remote and rank == 0 and t.name in listed:
            try:
                inside, below = _around_prefix(t.spec, b)
            except Exception as exc:  # no right to list the bucket's root: no hint
                log.debug("load: no hint around %s: %s", redact(b.url), exc)
                continue
            what, where, outer = "prefix", redact(b.url), "tier prefix"
            outers = "tier prefixes"
        else:
            continue
        if inside is not None:
            said.append(f"tier {t.name}'s {what} {where} is inside the {outer} {inside}")
        elif below:
            said.append(f"tier {t.name}'s {what} {where} has {outers} below it: {below}")
    if not said:
        return ""
    hint = "; ".join(said) + " (is the location given to the tier the one the saves went to?)"
    log.warning("%s found no checkpoint: %s", doing, hint)
    return "; " + hint


def _around_prefix(spec: TierSpec, backend: Backend) -> tuple[str | None, list[str]]:
    """:func:`tierckpt.near.prefixes_near` for an object-store tier: its bucket's root is
    opened with the tier's own options (endpoint, credentials, driver)."""
    parts = urlsplit(getattr(spec, "url", ""))
    if not parts.scheme or not parts.netloc or "store" in getattr(spec, "options", {}):
        return None, []  # a store object the caller made is bound to its own prefix
    at_root = copy.copy(spec)  # the spec at the bucket's root, every other field the same
    object.__setattr__(at_root, "url", f"{parts.scheme}://{parts.netloc}")
    root = at_root.make_backend()
    try:
        return prefixes_near(backend, root)
    finally:
        root.close()
