"""Where a tier writes: a local tier's folder as given (``~`` is the home folder; a mistyped URL
is refused), a key two tiers can be compared by, and the refusal of two tiers of one policy on
the same location.

Two tiers on one folder or prefix write the same names: the shard files of one step (the
second tier's replaces the first's committed one, which then fails its checksum or its size;
with two codecs every save's committed copy is lost this way), the same manifests (the second
tier's save fails), and each tier's retention deletes checkpoints the other was told to keep
(an archive tier with ``keep_last=None`` beside ``keep_last=3`` on the same prefix). So a
policy that lists two tiers on one location is refused when it is made, before anything is
written. A second *job* on a location is the writer lease's work (:mod:`tierckpt.lease`); this
is the same mistake inside one job, whose tiers share one lease owner.

A key errs on the side of "different": object-store tiers are the same location only when
scheme, bucket, key prefix, endpoint, profile, client and ``config`` all agree, so no two
tiers that may be different stores are refused.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Hashable, Mapping, Sequence, Set
from typing import Any, Protocol

from tierckpt.redact import redact

__all__ = [
    "canonical_url",
    "refuse_unknown_store_options",
    "Located",
    "folder_location",
    "local_folder",
    "refuse_mistyped_url",
    "refuse_shared_locations",
    "store_location",
]


def canonical_url(text: str) -> str:
    """``text`` with its scheme as tierckpt names it: lower case (a scheme is case-insensitive,
    RFC 3986: ``S3://b`` is ``s3://b``) and gcsfs's ``gcs://`` as ``gs://``; a path (no
    ``://``) as given. The API's ``tier()`` and the CLI read a location the same way."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    scheme = scheme.lower()
    return f"{'gs' if scheme == 'gcs' else scheme}://{rest}"


class Located(Protocol):
    @property
    def name(self) -> str: ...

    def location(self) -> tuple[str, Hashable] | None: ...


def folder_location(path: str) -> tuple[str, Hashable]:
    """A local folder's key: the folder with links and ``..`` resolved (``/a/run/`` and
    ``/a/x/../run`` are one folder), as the filesystem knows it: the device and inode of
    its nearest existing ancestor and the path below that (the two paths of a bind mount
    are one folder)."""
    real = os.path.realpath(path)
    head = real
    below: tuple[str, ...] = ()
    while True:
        try:
            st = os.stat(head)
        except OSError:
            parent = os.path.dirname(head)
            if parent == head:
                return real, ("folder", real)
            head, below = parent, (os.path.basename(head), *below)
            continue
        return real, ("folder", st.st_dev, st.st_ino, below)


def store_location(url: str, options: Mapping[str, Any]) -> tuple[str, Hashable]:
    """An object-store tier's key: ``(what to call it, key)``."""
    from tierckpt.backends.objstore import parse_url  # the prefix as the backends build it

    scheme, bucket, prefix = parse_url(url, str(options.get("prefix") or ""))
    endpoint = options.get("endpoint_url")
    endpoint = str(endpoint).rstrip("/").lower() if endpoint else None
    client = options.get("client")
    config = options.get("config") or {}
    key = (
        scheme,
        bucket,
        prefix,
        endpoint,
        options.get("profile"),
        None if client is None else id(client),
        repr(sorted((str(k), repr(v)) for k, v in dict(config).items())),
    )
    where = f"{scheme}://{bucket}/{prefix}"
    return (f"{where} at {redact(endpoint)}" if endpoint else where), key


def refuse_shared_locations(tiers: Sequence[Located]) -> None:
    """Raise ValueError when two of ``tiers`` write to one location (module docstring)."""
    seen: dict[Hashable, Located] = {}
    for t in tiers:
        found = t.location()
        if found is None:
            continue
        where, key = found
        other = seen.setdefault(key, t)
        if other is not t:
            raise ValueError(
                f"tiers {other.name!r} and {t.name!r} both write to {where}: two tiers on one "
                "location replace each other's shard files and manifests (a committed "
                "checkpoint is then lost), and each one's retention deletes what the other "
                "keeps. Give each tier its own folder or prefix, side by side (e.g. .../run "
                "and .../run-archive), or keep more checkpoints on one tier with "
                "keep_every_n_steps or keep_best"
            )


#: schemes a location may start with: ``s3:/bucket/run`` (a slash short) or ``s3:bucket`` is a
#: mistyped URL, never a folder ``s3:`` to create in the working directory
_URL_SCHEMES = frozenset({"s3", "gs", "gcs", "az", "file", "memory", "http", "https"})


def refuse_mistyped_url(path: str, who: str) -> None:
    """Raise ValueError when the local path ``path`` is a mistyped URL (``s3:/bucket/run``,
    ``s3//bucket/run``):
    saved there, the checkpoints would go to ``./s3:/bucket/run`` on this machine's disk."""
    head, colon, rest = path.partition(":")
    if not colon:  # a colon short: s3//bucket/run
        head, slashes, rest = path.partition("//")
        colon = slashes if "/" not in head else ""
    if colon and "://" not in path and head.lower() in _URL_SCHEMES:
        meant = f"{head}://{'/' if head.lower() == 'file' else ''}{rest.lstrip('/')}"
        raise ValueError(
            f"{who} {redact(path)!r}: a URL starts with {head}:// (did you mean "
            f"{redact(meant)!r}?); as a path it would be a folder {path.split('/')[0]!r} in the "
            f"working directory (write ./{redact(path)} for a folder really named so)"
        )


def _home_expanded(path: str) -> str:
    """``~/ckpt`` is the home folder's ``ckpt`` (as in a shell), never a folder named ``~`` in
    the working directory (which a later ``rm -rf ~`` would take the home folder for);
    ``./~`` is a folder really named so."""
    if not isinstance(path, str) or not path.startswith("~"):
        return path
    home = os.path.expanduser(path)
    if home.startswith("~"):
        raise ValueError(
            f"LocalTier({path!r}): cannot tell which home folder {path.split('/')[0]!r} is (no "
            "HOME, or no such user); give the folder as an absolute path"
        )
    return home


def local_folder(path: str, who: str = "LocalTier") -> str:
    """The folder a LocalTier writes to: a plain path, or ``file:///abs/path``. Any other
    ``scheme://`` is refused: written as a relative path it would create ``./s3:/bucket``;
    so is a URL a slash short (``s3:/bucket``)."""
    if isinstance(path, str):
        refuse_mistyped_url(path, who)
    if not isinstance(path, str) or "://" not in path:
        return _home_expanded(path)
    scheme, _, rest = path.partition("://")
    if scheme.lower() == "file":
        host, slash, folder = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise ValueError(
                f"{who}({path!r}): a file URL names a folder on this machine: "
                f"file:///absolute/path (file://{host}/... names the host {host!r})"
            )
        return "/" + folder
    raise ValueError(
        f"LocalTier({redact(path)!r}) takes a folder on this machine, not a {scheme}:// URL; "
        f"use tierckpt.tier({redact(path)!r}) (or the tier class of that store, e.g. S3Tier) "
        "to write there"
    )


def refuse_unknown_store_options(
    store: Mapping[str, Any], tier: str, driver: str, shared: Set[str]
) -> None:
    """``TypeError`` naming ``tier`` (and the nearest right name) for a keyword that neither
    the tier (``shared``) nor ``driver``'s backend takes: refused when the tier is made, not
    later, by the backend, when the ``Checkpointer`` opens it."""
    taken = _backend_options(driver)
    unknown = sorted(store.keys() - taken) if taken else []
    if unknown:
        names = taken | shared
        near = [m for k in unknown for m in difflib.get_close_matches(k, names, 1)]
        raise TypeError(
            f"{tier}() got unexpected keyword arguments: {', '.join(unknown)}"
            + (f" (did you mean {', '.join(near)}?)" if near else "")
            + f"; with driver {driver!r} it takes: {', '.join(sorted(names))}"
        )


def _backend_options(driver: str) -> frozenset[str]:
    """The keyword arguments ``driver``'s backend takes besides its URL (empty where that
    cannot be told: the driver's package is not installed, which opening the tier reports)."""
    try:
        if driver == "boto3":
            from tierckpt.backends.s3 import S3Backend as cls
        else:
            from tierckpt.backends.objstore import ObjectStoreBackend as cls  # type: ignore[assignment]
    except ImportError:
        return frozenset()
    params = list(inspect.signature(cls.__init__).parameters.values())[2:]  # self, the URL
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset()
    return frozenset(p.name for p in params)
