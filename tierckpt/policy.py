"""Tier specs and the tier policy: which tiers, in which order, what each keeps and encodes.

A *tier* is a backend placed in the hierarchy with a policy. Tiers are listed fastest first
(RAM, then local NVMe, then S3); every chunk is handed to the tiers in that order, and
``load()`` reads from the fastest tier that holds the wanted checkpoint.

Per tier:

``keep_last``
    keep this many newest committed checkpoints (``None`` keeps all); newest by timeline, then
    step, so after a rollback the abandoned run's checkpoints go first (see
    :class:`~tierckpt.format.CheckpointId`). Older ones are deleted after a newer one commits:
    manifest first, then data. The newest committed checkpoint is never deleted.
``every``
    this tier receives every n-th checkpoint (by save call count): e.g. RAM and NVMe every
    checkpoint, S3 every 10th.
``codec``
    ``"auto"`` (default: raw to RAM and local disk, compressed to remote tiers when that is
    faster), ``"raw"``, ``"zstd"``, any registered codec id, or a :class:`Codec` instance.
``source``
    the name of an earlier tier this one copies from, once that tier's file is durable,
    instead of taking chunks from the host arena: ``S3Tier(..., source="local")``. A slow
    tier then no longer holds arena slots, so capture (and training) goes at the pace of the
    source. The copy depends on the source's: if the source's copy of a step fails, so does
    this one's. Saves the source does not receive (``every``) come from the arena as usual.
``max_behind``
    for a tier with a ``source``: how many of the source's steps it may hold at once (the
    one it is copying and the newest ones waiting), default 2. The source's retention keeps
    those steps for it; when a newer step arrives beyond the bound, the oldest waiting copy
    is skipped (``CopySkipped`` on its handle, a warning in the log, counted in
    ``Checkpointer.tier_counts()``), so a slow or unreachable follower never makes the
    source keep more than ``keep_last + max_behind`` steps.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.config import S3_DRIVERS, s3_driver
from tierckpt.layout import check_prefixes
from tierckpt.redact import redact, refuse_credentials

__all__ = [
    "AzureTier",
    "GCSTier",
    "LocalTier",
    "MemoryTier",
    "S3Tier",
    "TierPolicy",
    "TierSpec",
    "resolve_codec",
]

CodecSpec = str | Codec | dict[str, Any]


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Common fields of every tier; use :class:`MemoryTier`, :class:`LocalTier`, :class:`S3Tier`."""

    name: str
    keep_last: int | None = None
    every: int = 1
    codec: CodecSpec = "auto"
    source: str | None = None
    #: keyword-only, so subclasses' own positional fields keep their places
    max_behind: int = field(default=2, kw_only=True)
    #: format v2: spread each step's files over this many hashed key prefixes (1..256);
    #: None: 256; 0: format v1 names (one folder per step), which tierckpt before v2 can
    #: read. See tierckpt.layout and docs/scale.md.
    prefixes: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"tier name must be a non-empty string without '/', got {self.name!r}")
        if self.keep_last is not None and (type(self.keep_last) is not int or self.keep_last < 1):
            raise ValueError(f"tier {self.name!r}: keep_last must be an int >= 1 or None")
        if type(self.every) is not int or self.every < 1:
            raise ValueError(f"tier {self.name!r}: every must be an int >= 1")
        if self.source is not None and (not isinstance(self.source, str) or not self.source):
            raise ValueError(f"tier {self.name!r}: source must be a tier name or None")
        if type(self.max_behind) is not int or self.max_behind < 1:
            raise ValueError(f"tier {self.name!r}: max_behind must be an int >= 1")
        if self.prefixes is not None:
            try:
                check_prefixes(self.prefixes)
            except ValueError as exc:
                raise ValueError(f"tier {self.name!r}: {exc}") from None

    def make_backend(self) -> Backend:
        raise NotImplementedError

    def receives(self, save_index: int) -> bool:
        """Whether the ``save_index``-th save (0-based) goes to this tier."""
        return save_index % self.every == 0


@dataclass(frozen=True, slots=True)
class MemoryTier(TierSpec):
    """Host RAM. Fast, not durable: it survives a new Checkpointer in the same process."""

    name: str = "memory"
    keep_last: int | None = 1
    namespace: str = "default"

    def make_backend(self) -> Backend:
        return MemoryBackend(self.namespace)


@dataclass(frozen=True, slots=True, init=False)
class LocalTier(TierSpec):
    """A local folder (NVMe, or any POSIX filesystem)."""

    path: str = ""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        every: int = 1,
        codec: CodecSpec = "auto",
        name: str = "local",
        source: str | None = None,
        max_behind: int = 2,
        prefixes: int | None = None,
    ) -> None:
        object.__setattr__(self, "path", os.fspath(path))
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "max_behind", max_behind)
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "keep_last", keep_last)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "codec", codec)
        TierSpec.__post_init__(self)
        if not self.path:
            raise ValueError("LocalTier needs a folder path")

    def make_backend(self) -> Backend:
        return LocalBackend(self.path)


@dataclass(frozen=True, slots=True, init=False)
class S3Tier(TierSpec):
    """An S3-compatible bucket: ``S3Tier("s3://bucket/prefix", endpoint_url=...)``."""

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    driver: str = "boto3"

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        every: int = 1,
        codec: CodecSpec = "auto",
        name: str = "s3",
        source: str | None = None,
        max_behind: int = 2,
        driver: str | None = None,
        prefixes: int | None = None,
        **options: Any,
    ) -> None:
        # which S3 client moves the bytes: "obstore" or "boto3" (a boto3 client= implies it)
        driver = driver or ("boto3" if "client" in options else s3_driver())
        if driver not in S3_DRIVERS:
            raise ValueError(f"S3Tier: driver must be one of {S3_DRIVERS}, got {driver!r}")
        object.__setattr__(self, "driver", driver)
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "max_behind", max_behind)
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "options", dict(options))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "keep_last", keep_last)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "codec", codec)
        TierSpec.__post_init__(self)
        if not url.startswith("s3://"):
            raise ValueError(f"S3Tier needs an s3://bucket/prefix URL, got {redact(url)!r}")
        refuse_credentials(url)

    def __hash__(self) -> int:
        return hash((self.name, self.url))

    def __repr__(self) -> str:
        # options may hold an endpoint URL with credentials in it: never print those
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return redact(f"S3Tier({shown})")

    def make_backend(self) -> Backend:
        if self.driver == "obstore":
            from tierckpt.backends.objstore import ObjectStoreBackend

            return ObjectStoreBackend(self.url, **self.options)
        try:
            from tierckpt.backends.s3 import S3Backend
        except ImportError as exc:  # pragma: no cover - boto3 is a dependency
            raise ImportError(f"the S3 tier needs boto3: pip install boto3 ({exc})") from exc
        return S3Backend(self.url, **self.options)


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """An ordered list of tiers, fastest first."""

    tiers: tuple[TierSpec, ...]

    def __init__(self, tiers: Sequence[TierSpec]) -> None:
        tiers = tuple(tiers)
        if not tiers:
            raise ValueError("a tier policy needs at least one tier")
        for t in tiers:
            if not isinstance(t, TierSpec):
                raise TypeError(f"tiers must be MemoryTier/LocalTier/S3Tier, got {t!r}")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(
                f"tier names must be unique, got {names}; pass name=... to tell tiers apart"
            )
        for i, t in enumerate(tiers):
            if t.source is None:
                continue
            earlier = {u.name: u for u in tiers[:i]}
            src = earlier.get(t.source)
            if src is None:
                raise ValueError(
                    f"tier {t.name!r}: source {t.source!r} must name a tier listed before it "
                    f"(tiers before it: {list(earlier) or 'none'})"
                )
            if src.source is not None:
                raise ValueError(
                    f"tier {t.name!r}: its source {src.name!r} copies from {src.source!r} "
                    "itself; name a tier that takes chunks from the host arena"
                )
        object.__setattr__(self, "tiers", tiers)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)


def resolve_codec(spec: CodecSpec, backend: Backend) -> Codec:
    """The codec a tier uses. ``"auto"``: raw to RAM and local disks; on remote tiers an
    :class:`~tierckpt.codecs.adaptive.AdaptiveCodec` that compresses while that is faster."""
    if isinstance(spec, Codec):
        return spec
    if isinstance(spec, dict):
        return codec_from_config(spec)
    if spec == "auto":
        if not backend.is_remote:
            # RAM and local disks get raw chunks: compressing would take CPU from training
            # and hold compressed copies beyond the host arena for a link that is rarely
            # slower than the codec
            return codec_from_config({"id": "raw"})
        from tierckpt.codecs.adaptive import AdaptiveCodec

        return AdaptiveCodec(remote=True)
    return codec_from_config({"id": spec})


@dataclass(frozen=True, slots=True, init=False)
class _CloudTier(TierSpec):
    """A bucket of a cloud object store reached through obstore (``gs://``, ``az://``)."""

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        every: int = 1,
        codec: CodecSpec = "auto",
        name: str = "",
        source: str | None = None,
        max_behind: int = 2,
        prefixes: int | None = None,
        **options: Any,
    ) -> None:
        scheme, label = self._scheme()
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "max_behind", max_behind)
        object.__setattr__(self, "prefixes", prefixes)
        object.__setattr__(self, "options", dict(options))
        object.__setattr__(self, "name", name or label)
        object.__setattr__(self, "keep_last", keep_last)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "codec", codec)
        TierSpec.__post_init__(self)
        if not url.startswith(f"{scheme}://"):
            raise ValueError(
                f"{type(self).__name__} needs a {scheme}://bucket/prefix URL, got {redact(url)!r}"
            )
        refuse_credentials(url)

    @classmethod
    def _scheme(cls) -> tuple[str, str]:
        raise NotImplementedError

    def __hash__(self) -> int:
        return hash((self.name, self.url))

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return redact(f"{type(self).__name__}({shown})")

    def make_backend(self) -> Backend:
        from tierckpt.backends.objstore import ObjectStoreBackend

        return ObjectStoreBackend(self.url, **self.options)


@dataclass(frozen=True, slots=True, init=False, repr=False, eq=False)
class GCSTier(_CloudTier):
    """A Google Cloud Storage bucket: ``GCSTier("gs://bucket/prefix")``; credentials from
    Google's standard chain, ``endpoint_url=`` (or ``STORAGE_EMULATOR_HOST``) for an emulator."""

    @classmethod
    def _scheme(cls) -> tuple[str, str]:
        return "gs", "gcs"


@dataclass(frozen=True, slots=True, init=False, repr=False, eq=False)
class AzureTier(_CloudTier):
    """An Azure Blob Storage container: ``AzureTier("az://container/prefix")``; the account and
    credentials from Azure's standard chain (``AZURE_STORAGE_ACCOUNT_NAME``, a key, SAS or an
    identity), ``endpoint_url=`` for the blob endpoint (Azurite, sovereign clouds)."""

    @classmethod
    def _scheme(cls) -> tuple[str, str]:
        return "az", "azure"
