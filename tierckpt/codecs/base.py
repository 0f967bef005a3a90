"""The codec contract and the codec registry.

A codec turns one chunk's raw bytes into stored bytes and back. **A codec is its config**:
``get_config()`` returns a JSON dict whose ``"id"`` names the codec in the registry, and
``codec_from_config(codec.get_config()) == codec``. The config is written into the shard
file's index, so a reader needs nothing else to decode.

Contract
    * ``encode(data)`` takes a contiguous byte buffer and returns a bytes-like object. It
      must not modify ``data``. It may be called from several threads at once.
    * ``decode(data, out)`` fills ``out`` (a writable buffer of exactly the raw size) and
      must raise :class:`~tierckpt.errors.CorruptChunk` when ``data`` is malformed or
      decodes to any other size. It must never allocate more than ``len(out)`` plus a small
      constant for its output (no decompression bombs).
    * ``for_dtype(dtype_name)`` returns the codec to use for a chunk whose values have that
      dtype (e.g. a float-aware codec picks its element size); the default is ``self``.
    * Codecs are immutable values; equality and hashing follow the config.

The calls a codec receives, in order
    1. ``codec_from_config(config)`` / the tier policy builds it (once per tier).
    2. Saving, per chunk, on the pipeline's encoder threads (several at once):
       ``for_dtype(dtype)`` picks the codec for the chunk's values; if that codec
       ``is_passthrough`` the raw bytes are stored, else ``encode(view)`` — and when the
       result is not smaller than the input the pipeline stores the raw bytes instead and
       records ``{"id": "raw"}``. ``get_config()`` of the codec used goes into the index.
    3. Loading, per chunk, on reader threads: ``codec_from_config(index entry)`` (registry
       only: a hostile index can name no code), then ``decode(stored, out)`` into a buffer of
       exactly the chunk's raw size, after the stored bytes' checksum was verified.

Registry
    Codec classes register under their ``codec_id``; ids must be unique (no silent
    overwrite). Optional codecs whose package may be missing are registered lazily by dotted
    path with the name of the package that provides them, so the error says what to install.
    Unknown ids raise :class:`~tierckpt.errors.UnknownCodec`.
"""

from __future__ import annotations

import importlib
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, runtime_checkable

from tierckpt._types import JSON, BytesLike
from tierckpt.errors import UnknownCodec

__all__ = [
    "Codec",
    "SupportsObserve",
    "SupportsObserveRead",
    "SupportsProfile",
    "SupportsProgressiveDecode",
    "codec_from_config",
    "codec_ids",
    "get_codec",
    "register_codec",
    "register_lazy_codec",
]


@runtime_checkable
class SupportsProfile(Protocol):
    """A tier codec that measures itself on real data: before each chunk is encoded the
    pipeline calls ``profile(dtype_name, sample)`` with that chunk's raw bytes (encoder
    threads, several at once), so the codec can decide per kind of chunk (the auto policy)."""

    def profile(self, dtype_name: str, sample: BytesLike) -> None: ...


@runtime_checkable
class SupportsObserve(Protocol):
    """A tier codec that learns the link's speed: after a shard file is durable on the tier the
    pipeline calls ``observe(stored_bytes, seconds)`` with the bytes written and the time spent
    writing them (the auto policy compresses only when the link is slower than the codec)."""

    def observe(self, stored_bytes: int, seconds: float) -> None: ...


@runtime_checkable
class SupportsObserveRead(Protocol):
    """A tier codec that learns the tier's restore speed: after a shard was loaded from the tier
    the load path calls ``observe_read(stored_bytes, raw_bytes, seconds, compressed=...)``
    (the auto policy stores raw chunks where a compressed restore would be slower)."""

    def observe_read(
        self, stored_bytes: int, raw_bytes: int, seconds: float, *, compressed: bool
    ) -> None: ...


@runtime_checkable
class SupportsProgressiveDecode(Protocol):
    """A codec that decodes a chunk while its stored bytes still arrive (the load path's
    fetch/decode overlap): ``decode_progressive(data, out, ready)`` does what
    ``decode(data, out)`` does, but ``data`` (the whole stored buffer, at its final size) may
    hold only a prefix yet, so the codec calls ``ready(n)`` before it reads ``data[:n]``;
    ``ready`` blocks until those bytes are in (and raises if fetching them failed)."""

    def decode_progressive(
        self, data: BytesLike, out: memoryview, ready: Callable[[int], None]
    ) -> None: ...


class Codec(ABC):
    """Base class of every codec; see the module docstring."""

    codec_id: ClassVar[str]

    @abstractmethod
    def encode(self, data: BytesLike) -> BytesLike: ...

    @abstractmethod
    def decode(self, data: BytesLike, out: memoryview) -> None: ...

    def get_config(self) -> dict[str, JSON]:
        return {"id": self.codec_id}

    @classmethod
    def from_config(cls, config: dict[str, JSON]) -> Codec:
        params = {k: v for k, v in config.items() if k != "id"}
        try:
            return cls(**params)
        except (TypeError, ValueError) as exc:  # unknown parameter / out-of-range value
            raise UnknownCodec(
                f"bad config for codec {cls.codec_id!r}: {config!r} ({exc})"
            ) from exc

    def for_dtype(self, dtype_name: str) -> Codec:
        return self

    @property
    def is_passthrough(self) -> bool:
        """True when stored bytes equal raw bytes (no work to do)."""
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"


_lock = threading.Lock()
_registry: dict[str, type[Codec]] = {}
_lazy: dict[str, tuple[str, str]] = {}


def register_codec(cls: type[Codec], *, replace: bool = False) -> type[Codec]:
    """Register ``cls`` under ``cls.codec_id``; refuses to overwrite unless ``replace``."""
    with _lock:
        existing = _registry.get(cls.codec_id)
        if existing is not None and existing is not cls and not replace:
            raise ValueError(
                f"codec id {cls.codec_id!r} is already registered by {existing.__qualname__}"
            )
        _registry[cls.codec_id] = cls
        _lazy.pop(cls.codec_id, None)
    return cls


def register_lazy_codec(codec_id: str, target: str, package: str) -> None:
    """Register ``module:Class`` to be imported on first use; ``package`` provides it."""
    with _lock:
        if codec_id not in _registry:
            _lazy[codec_id] = (target, package)


def _load_entry_points() -> None:
    try:
        from importlib.metadata import entry_points

        for ep in entry_points(group="tierckpt.codecs"):
            if ep.name not in _registry and ep.name not in _lazy:
                _lazy[ep.name] = (ep.value, ep.dist.name if ep.dist else ep.value)
    except Exception:  # pragma: no cover - broken third-party metadata must not break us
        pass


def get_codec(codec_id: str) -> type[Codec]:
    """The codec class for ``codec_id``, importing optional codecs on demand."""
    with _lock:
        cls = _registry.get(codec_id)
        lazy = _lazy.get(codec_id)
    if cls is not None:
        return cls
    if lazy is None:
        _load_entry_points()
        lazy = _lazy.get(codec_id)
    if lazy is None:
        raise UnknownCodec(
            f"unknown codec id {codec_id!r}; known codecs: {', '.join(codec_ids())}. "
            "A checkpoint written by a newer tierckpt or with a plugin codec needs that "
            "codec installed."
        )
    target, package = lazy
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        loaded: Any = getattr(module, attr)
    except ImportError as exc:
        raise UnknownCodec(
            f"codec {codec_id!r} needs the package {package!r}: pip install {package} ({exc})"
        ) from exc
    return register_codec(loaded)


def codec_ids() -> list[str]:
    with _lock:
        return sorted(set(_registry) | set(_lazy))


def codec_from_config(config: dict[str, JSON]) -> Codec:
    """Build a codec from its config (as stored in an index); refuses unknown ids."""
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise UnknownCodec(f"codec config must be a dict with a string 'id', got {config!r}")
    return get_codec(config["id"]).from_config(config)
