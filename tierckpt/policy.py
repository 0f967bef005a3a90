"""Tier specs and the tier policy: which tiers, in which order, what each keeps and encodes.

A *tier* is a backend placed in the hierarchy with a policy. Tiers are listed fastest first
(RAM, then local NVMe, then S3); every chunk is handed to the tiers in that order, and
``load()`` reads from the fastest tier that holds the wanted checkpoint.

Per tier:

``keep_last``
    keep this many newest committed checkpoints (``None`` keeps all; defaults: 1 in RAM, 3 on
    local disk, 5 on S3); newest by timeline, then
    step, so after a rollback the abandoned run's checkpoints go first (see
    :class:`~tierckpt.format.CheckpointId`). Older ones are deleted after a newer one commits:
    manifest first, then data. The newest committed checkpoint is never deleted.
``keep_every_n_steps``
    a checkpoint whose step is a multiple of n is never removed by retention (Orbax's
    ``keep_period``): e.g. ``keep_last=2, keep_every_n_steps=1000`` keeps the two newest and
    every 1000th.
``keep_best``, ``best_metric``, ``best_mode``
    keep the ``keep_best`` best committed checkpoints by the metric ``best_metric`` that
    ``save(..., metrics={...})`` stored with them, lowest first (``best_mode="min"``, the
    default) or highest (``"max"``); besides the ``keep_last`` newest. Checkpoints saved
    without that metric are kept by the other rules only. ``keep_last=None`` with
    ``keep_best`` set keeps the best and the newest only.
Pinned checkpoints (``Checkpointer.pin(step)``) are never removed by retention until
unpinned, whatever the rules above say. Every rule is decided from what the tier stores
(manifests, pin markers), so a restarted job keeps the same checkpoints.
``every``
    this tier receives the saves whose step is a multiple of ``every`` (as Orbax's
    ``save_interval_steps``): e.g. RAM and NVMe every checkpoint, S3 ``every=1000`` gets
    steps 0, 1000, 2000, ... It counts steps, not ``save()`` calls, so a restarted process
    (or one that skipped saves) sends the same steps to the tier as an uninterrupted run.
    Pick it as a multiple of the save interval: saving every 300 steps with ``every=1000``
    reaches the tier only at multiples of 3000. ``every=1`` (default): every save.
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
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypedDict, cast

from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.memory import MemoryBackend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.config import S3_DRIVERS, s3_driver
from tierckpt.layout import check_prefixes
from tierckpt.locations import (
    folder_location,
    local_folder,
    refuse_shared_locations,
    refuse_unknown_store_options,
    store_location,
)
from tierckpt.redact import (
    redact,
    refuse_bad_endpoint,
    refuse_bad_region,
    refuse_control_characters,
    refuse_credentials,
    shown,
)
from tierckpt.retention import Retention

if TYPE_CHECKING:
    from typing import Unpack

__all__ = [
    "AzureTier",
    "GCSTier",
    "LocalTier",
    "MemoryTier",
    "S3Tier",
    "TierOptions",
    "TierPolicy",
    "TierSpec",
    "resolve_codec",
]

CodecSpec = str | Codec | dict[str, Any]


class TierOptions(TypedDict, total=False):
    """The keyword arguments every tier class takes besides its location, ``name`` and
    ``keep_last`` (whose defaults differ per tier); each is the :class:`TierSpec` field of that
    name, with its default when not given (see the module docstring for what each does)."""

    every: int
    codec: CodecSpec
    source: str | None
    max_behind: int
    keep_every_n_steps: int | None
    keep_best: int | None
    best_metric: str | None
    best_mode: Literal["min", "max"]
    prefixes: int | None


#: the names of :class:`TierOptions`
TIER_OPTIONS = frozenset(TierOptions.__annotations__)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Common fields of every tier; use :class:`MemoryTier`, :class:`LocalTier`, :class:`S3Tier`.

    Every tier class takes ``name`` and ``keep_last`` (its defaults differ) and the shared
    keyword options (:class:`TierOptions`): ``every``, ``codec``, ``source``, ``max_behind``,
    ``keep_every_n_steps``, ``keep_best``, ``best_metric``, ``best_mode`` and ``prefixes``,
    each described in :mod:`tierckpt.policy`.
    """

    name: str
    keep_last: int | None = None
    every: int = 1
    codec: CodecSpec = "auto"
    source: str | None = None
    #: keyword-only, so subclasses' own positional fields keep their places
    max_behind: int = field(default=2, kw_only=True)
    #: retention beyond keep_last (see the module docstring and :class:`Retention`)
    keep_every_n_steps: int | None = field(default=None, kw_only=True)
    keep_best: int | None = field(default=None, kw_only=True)
    best_metric: str | None = field(default=None, kw_only=True)
    best_mode: Literal["min", "max"] = field(default="min", kw_only=True)
    #: True for a tier that takes no chunks but copies other tiers' commits elsewhere
    #: (:class:`~tierckpt.PeerTier`): the pipeline leaves it out, the checkpointer drives it
    is_replica: ClassVar[bool] = False
    #: format v2: spread each step's files over this many hashed key prefixes (1..256);
    #: None: 256; 0: format v1 names (one folder per step), which tierckpt before v2 can
    #: read. See tierckpt.layout and docs/scale.md.
    prefixes: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # a subclass with a hand-written __init__ (slots: no class-level defaults) gets the
        # defaults of the fields it does not set, so adding a field never breaks one
        for f in fields(self):
            if not hasattr(self, f.name):
                factory: Any = f.default_factory
                default = f.default if f.default is not MISSING else factory()
                object.__setattr__(self, f.name, default)
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
        try:
            self.retention  # noqa: B018 - validates the retention fields
        except ValueError as exc:
            raise ValueError(f"tier {self.name!r}: {exc}") from None

    @property
    def retention(self) -> Retention:
        """This tier's retention rules, applied after each commit (:mod:`tierckpt.retention`)."""
        return Retention(
            keep_last=self.keep_last,
            keep_every_n_steps=self.keep_every_n_steps,
            keep_best=self.keep_best,
            best_metric=self.best_metric,
            best_mode=self.best_mode,
        )

    def make_backend(self) -> Backend:
        raise NotImplementedError

    def for_run(self, tiers: Sequence[TierSpec]) -> TierSpec:
        """This tier as the job whose tiers are ``tiers`` opens it (a node-RAM tier without a
        namespace takes one from the run's other tiers); itself by default."""
        return self

    def location(self) -> tuple[str, Hashable] | None:
        """``(where, key)``: tiers with equal keys write to one place (:mod:`tierckpt.locations`);
        None: not known."""
        return None

    def receives(self, step: int) -> bool:
        """Whether a save of ``step`` goes to this tier: ``step`` is a multiple of ``every``.

        A function of the step alone, so every rank and every restart agree without state."""
        return step % self.every == 0

    def _init_fields(self, shared: Mapping[str, object], /, **own: object) -> None:
        """A subclass's hand-written ``__init__``: set the ``shared`` options given
        (:class:`TierOptions`; ``TypeError`` for any other name) and the subclass's ``own``
        fields, then validate; fields set by neither keep their defaults."""
        unknown = sorted(shared.keys() - TIER_OPTIONS)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword arguments: {', '.join(unknown)}"
            )
        for name, value in {**shared, **own}.items():
            object.__setattr__(self, name, value)
        TierSpec.__post_init__(self)


def _split_options(
    options: dict[str, Any], tier: str, driver: str = "obstore"
) -> tuple[TierOptions, dict[str, Any]]:
    """A store tier's keyword arguments: the shared tier options, and the store's own
    (endpoint, credentials profile, client...) that go to its backend (``driver``'s). A name
    that is neither is refused here, naming ``tier`` (:func:`refuse_unknown_store_options`)."""
    shared = {k: v for k, v in options.items() if k in TIER_OPTIONS}
    store = {k: v for k, v in options.items() if k not in TIER_OPTIONS}
    refuse_unknown_store_options(store, tier, driver, TIER_OPTIONS)
    return cast(TierOptions, shared), store


@dataclass(frozen=True, slots=True)
class MemoryTier(TierSpec):
    """Host RAM. Fast, not durable: it survives a new Checkpointer in the same process."""

    name: str = "memory"
    keep_last: int | None = 1
    namespace: str = "default"

    def make_backend(self) -> Backend:
        return MemoryBackend(self.namespace)

    def location(self) -> tuple[str, Hashable] | None:
        return f"host RAM namespace {self.namespace!r}", ("memory", self.namespace)


@dataclass(frozen=True, slots=True, init=False)
class LocalTier(TierSpec):
    """A local folder (NVMe, or any POSIX filesystem; ``~/ckpt`` is in the home folder, as in a
    shell); ``options``: the shared tier options (:class:`TierOptions`, listed in
    :class:`TierSpec`)."""

    path: str = ""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep_last: int | None = 3,
        name: str = "local",
        **options: Unpack[TierOptions],
    ) -> None:
        self._init_fields(
            options, path=local_folder(os.fspath(path)), name=name, keep_last=keep_last
        )
        if not self.path:
            raise ValueError("LocalTier needs a folder path")

    def make_backend(self) -> Backend:
        return LocalBackend(self.path)

    def location(self) -> tuple[str, Hashable] | None:
        return folder_location(self.path)


#: how many checkpoints an :class:`S3Tier` keeps unless told (``keep_last=None`` keeps all)
S3_DEFAULT_KEEP_LAST = 5


@dataclass(frozen=True, slots=True, init=False)
class S3Tier(TierSpec):
    """An S3-compatible bucket: ``S3Tier("s3://bucket/prefix", endpoint_url=...)``.

    ``keep_last`` defaults to :data:`S3_DEFAULT_KEEP_LAST` (5): a bucket is billed by what it
    holds, and a run that saves for weeks must not keep every checkpoint by accident. Pass
    ``keep_last=None`` to keep all (an archive), or another number. ``options``: the shared
    tier options (:class:`TierOptions`, listed in :class:`TierSpec`); the others go to the S3
    backend (``endpoint_url``, ``profile``...).

    ``driver``: the S3 client that moves the bytes, ``"obstore"`` (the default: measured the
    faster, docs/object-stores.md) or ``"boto3"``; unset, ``TIERCKPT_S3_DRIVER`` decides. A
    ``client=`` (a boto3 client) selects boto3.
    """

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    driver: str = "obstore"

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = S3_DEFAULT_KEEP_LAST,
        name: str = "s3",
        driver: str | None = None,
        **options: Any,
    ) -> None:
        # which S3 client moves the bytes: "obstore" or "boto3" (a boto3 client= implies it)
        driver = driver or ("boto3" if "client" in options else s3_driver())
        if driver not in S3_DRIVERS:
            raise ValueError(f"S3Tier: driver must be one of {S3_DRIVERS}, got {driver!r}")
        if driver == "obstore" and "client" in options:
            raise ValueError(
                "S3Tier(client=...) takes a boto3 client: it works with the boto3 driver only; "
                "leave driver unset (a client selects boto3) or pass driver='boto3'"
            )
        shared, store = _split_options(options, "S3Tier", driver)
        self._init_fields(
            shared, url=url, name=name, keep_last=keep_last, driver=driver, options=store
        )
        if not url.startswith("s3://"):
            raise ValueError(f"S3Tier needs an s3://bucket/prefix URL, got {redact(url)!r}")
        refuse_credentials(url)
        refuse_control_characters(url, "S3Tier")
        if store.get("endpoint_url") is not None:
            refuse_bad_endpoint(store["endpoint_url"])
        if store.get("region") is not None:
            refuse_bad_region(store["region"])

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

    def location(self) -> tuple[str, Hashable] | None:
        return store_location(self.url, self.options)


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
                raise TypeError(
                    "a TierPolicy takes tier objects (MemoryTier, LocalTier, S3Tier, ...), got "
                    f"{shown(t)}; for a path or URL use "
                    "tierckpt.tier(location), or pass the locations to Checkpointer as they are"
                )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(
                f"tier names must be unique, got {names}; pass name=... to tell tiers apart "
                "(LocalTier(path, name='nvme'); for a path or URL, "
                "tierckpt.tier(location, name='nvme'))"
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
        refuse_shared_locations(tiers)
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
    """A bucket of a cloud object store reached through obstore (``gs://``, ``az://``);
    ``options``: the shared tier options (:class:`TierOptions`, listed in :class:`TierSpec`);
    the others go to the store's backend. ``keep_last`` defaults to None: every checkpoint
    is kept (unlike :class:`S3Tier`'s 5); give a number to bound what the bucket bills."""

    url: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __init__(
        self,
        url: str,
        *,
        keep_last: int | None = None,
        name: str = "",
        **options: Any,
    ) -> None:
        shared, store = _split_options(options, type(self).__name__)
        scheme, label = self._scheme()
        self._init_fields(shared, url=url, name=name or label, keep_last=keep_last, options=store)
        if not url.startswith(f"{scheme}://"):
            raise ValueError(
                f"{type(self).__name__} needs a {scheme}://bucket/prefix URL, got {redact(url)!r}"
            )
        refuse_credentials(url)
        refuse_control_characters(url, type(self).__name__)
        endpoint = store.get("endpoint_url")
        if endpoint is not None:  # gs: host:port is taken, as STORAGE_EMULATOR_HOST has it
            if scheme == "gs" and "://" not in endpoint:
                endpoint = f"http://{endpoint}"
            refuse_bad_endpoint(endpoint)

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

    def location(self) -> tuple[str, Hashable] | None:
        return store_location(self.url, self.options)


@dataclass(frozen=True, slots=True, init=False, repr=False, eq=False)
class GCSTier(_CloudTier):
    """A Google Cloud Storage bucket: ``GCSTier("gs://bucket/prefix")``; credentials from
    Google's standard chain, ``endpoint_url=`` (or ``STORAGE_EMULATOR_HOST``) for an emulator.
    Keeps every checkpoint unless ``keep_last`` is given (``S3Tier`` keeps 5)."""

    @classmethod
    def _scheme(cls) -> tuple[str, str]:
        return "gs", "gcs"


@dataclass(frozen=True, slots=True, init=False, repr=False, eq=False)
class AzureTier(_CloudTier):
    """An Azure Blob Storage container: ``AzureTier("az://container/prefix")``; the account and
    credentials from Azure's standard chain (``AZURE_STORAGE_ACCOUNT_NAME``, a key, SAS or an
    identity), ``endpoint_url=`` for the blob endpoint (Azurite, sovereign clouds). Keeps
    every checkpoint unless ``keep_last`` is given (``S3Tier`` keeps 5)."""

    @classmethod
    def _scheme(cls) -> tuple[str, str]:
        return "az", "azure"
