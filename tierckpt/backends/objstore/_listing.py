"""Listing for the obstore backend, and the check that an empty listing came from a store.

object_store parses a listing's XML leniently: an HTML page answered with status 200 (a
captive portal, a web server or a proxy at the endpoint) reads as a listing of no objects, so
``steps()`` on a new node said "nothing saved" and training started again from step 0 while
the run's checkpoints were there. An empty listing is therefore checked once per backend: a
HEAD of a key that cannot exist must be answered "not found", as every store answers it; an
endpoint that answers 200 is not the store (``BackendError``), and anything else (a refusal,
an outage) leaves the listing as it was."""

from __future__ import annotations

import builtins
import logging
import secrets
from typing import Any, Protocol

from tierckpt.backends.base import PROBE_PREFIX, validate_name
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError, TierCkptError


class ObjectStoreBackend(Protocol):
    """What listing uses of :class:`tierckpt.backends.objstore.ObjectStoreBackend`."""

    url: str
    _root: str
    #: an empty listing was seen to come from a store (see :func:`check_endpoint`)
    _answers_as_store: bool

    def _call(self, what: str, key: str, fn: Any, *args: Any, **kwargs: Any) -> Any: ...


__all__ = ["PROBE_PREFIX", "listed"]

log = logging.getLogger("tierckpt.backends.objstore")


def listed(
    backend: ObjectStoreBackend, prefix: str, start_after: str, limit: int | None
) -> builtins.list[str]:
    """The valid object names under ``prefix`` (past ``start_after``; at most ``limit``)."""
    import obstore

    def pages(store: Any) -> builtins.list[Any]:
        out: builtins.list[Any] = []
        for page in obstore.list(store, folder or None, chunk_size=1000, **offset):
            out += page
            if limit is not None and len(out) >= limit:
                break  # the store's order: what a hint needs, not every name
        return out

    root = backend._root
    full = root + prefix
    offset = {"offset": root + start_after} if start_after else {}
    # object_store lists whole path segments: list the folder, keep the names that match
    folder = full if full.endswith("/") or not full else full.rpartition("/")[0]
    cut = len(root)
    names = []
    metas = backend._call("list", full, pages)
    if metas:
        backend._answers_as_store = True
    else:
        check_endpoint(backend)
    for meta in metas:
        path = str(meta["path"])
        if not path.startswith(full):
            continue
        rel = path[cut:]
        if rel.startswith(PROBE_PREFIX) or (start_after and rel <= start_after):
            continue
        try:
            names.append(validate_name(rel))
        except FormatError:
            log.debug("%s: skipping key %r (not a valid object name)", backend.url, rel)
    return sorted(names)[:limit]


def check_endpoint(backend: ObjectStoreBackend) -> None:
    """After an empty listing: raise :class:`BackendError` where the endpoint answers a HEAD of
    a key that cannot exist with an object (it is not the store); once per backend."""
    import obstore

    if backend._answers_as_store:
        return
    key = backend._root + PROBE_PREFIX + "absent-" + secrets.token_hex(8)
    try:
        backend._call("head", key, obstore.head, key)
    except CheckpointNotFound:
        backend._answers_as_store = True
        return
    except TierCkptError:
        return  # refused or not answered: cannot tell, the listing stands
    raise BackendError(
        f"{backend.url}: the endpoint answered a listing with no objects and a read of an "
        "object that does not exist with an object (status 200): it does not answer as an "
        "object store (a web server, captive portal or proxy in the way?). Nothing listed "
        "there can be trusted: check the endpoint URL (AWS_ENDPOINT_URL_S3 / "
        "AWS_ENDPOINT_URL, endpoint_url=) and HTTP(S)_PROXY"
    )
