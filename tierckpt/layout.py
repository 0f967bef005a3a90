"""Format v2 names: shard files and completion records spread over hashed key prefixes.

Format v1 puts every file of a step under one folder, ``steps/<step>/``; on S3 that is one
key prefix, whose request budget (about 3,500 writes and 5,500 reads per second) then sets
the checkpoint time of a large job (docs/scale.md). Format v2 puts each rank's files under
one of ``prefixes`` hashed top-level folders::

    <hh>/steps/<step>/rank-<r>.tck                      rank r's shard file
    <hh>/steps/<step>/records/rank-<r>.done.<size>.<index checksum>.<raw>.<stored>.<codec>.<attempt>
    <hh>/steps/<step>/records/rank-<r>.failed.json      rank r says its shard failed

``hh`` is two hex digits, ``xxh3_64("rank-<r, 6 digits>") mod prefixes``; a timeline
``t >= 1`` has ``steps/<step>.t<t>/`` as in v1. Manifests stay in ``manifests/`` (format
v1's names) and say ``"version": 2``; the shard files themselves are unchanged (their footer
and index still say 1). A completion record's fields are in its name, so rank 0 commits from
LIST pages alone (:mod:`tierckpt.distributed._listcommit`); its body is the v1 record's JSON,
for people and tools.

This module only builds and parses names; :mod:`tierckpt.format` validates manifests with
it. Every name still passes :func:`~tierckpt.backends.base.validate_name`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from tierckpt.errors import FormatError

__all__ = [
    "DEFAULT_PREFIXES",
    "MAX_PREFIXES",
    "ListedRecord",
    "data_folder_part",
    "describe",
    "hash_prefix",
    "manifest_version",
    "parse_record_name",
    "prefixes_for",
    "record_folder",
    "record_name",
    "shard_file",
    "failure_name",
    "shard_in_folder",
]

#: ``hh`` is two hex digits: at most 256 prefixes
MAX_PREFIXES = 256
#: every tier spreads its ranks' files over all 256 prefixes unless told otherwise (S3 needs
#: it; on a local disk or in RAM it costs one folder per rank and step, and keeps the names
#: of a checkpoint the same on every tier, so copies between tiers keep their names)
DEFAULT_PREFIXES = 256

_HH = re.compile(r"^([0-9a-f]{2})/")
#: the record fields in its name; the codec id has no dots, so the attempt id (which may) is
#: everything after it
_RECORD = re.compile(
    r"^rank-(\d{6,7})\.done\.(\d{1,16})\.([0-9a-f]{16})\.(\d{1,16})\.(\d{1,16})\."
    r"([a-z0-9_-]{1,32})\.([0-9A-Za-z._-]{0,128})$"
)
_RECORDS = "records/"


def check_prefixes(prefixes: object) -> int:
    """``prefixes`` if it is an int in ``[0, 256]`` (0: format v1 names), else ValueError."""
    if type(prefixes) is not int or not 0 <= prefixes <= MAX_PREFIXES:
        raise ValueError(
            f"prefixes must be an int in [0, {MAX_PREFIXES}] (0: format v1 names, all files "
            f"of a step under one prefix), got {prefixes!r}"
        )
    return prefixes


def prefixes_for(configured: int | None) -> int:
    """The number of hashed prefixes a tier writes: its ``prefixes`` knob, else 256. 0 means
    format v1 names."""
    if configured is not None:
        return check_prefixes(configured)
    return DEFAULT_PREFIXES


def hash_prefix(rank: int, prefixes: int) -> str:
    """``hh``: the prefix of ``rank``'s files among ``prefixes`` (1..256)."""
    if not 1 <= prefixes <= MAX_PREFIXES:
        raise ValueError(f"prefixes must be in [1, {MAX_PREFIXES}] for v2 names")
    return f"{xxhash.xxh3_64_intdigest(f'rank-{rank:06d}'.encode()) % prefixes:02x}"


def shard_file(folder: str, rank: int, prefixes: int) -> str:
    """Rank ``rank``'s shard file in the step folder ``folder`` (``steps/<step>/``, from
    :func:`tierckpt.format.step_prefix`): v1 with ``prefixes == 0``, else v2."""
    if prefixes == 0:
        return f"{folder}rank-{rank:06d}.tck"
    return f"{hash_prefix(rank, prefixes)}/{folder}rank-{rank:06d}.tck"


def record_folder(folder: str, hh: str) -> str:
    """Where the v2 records of the ranks with prefix ``hh`` are."""
    return f"{hh}/{folder}{_RECORDS}"


def record_name(
    folder: str,
    rank: int,
    prefixes: int,
    *,
    size: int,
    index_checksum: str,
    raw_bytes: int,
    stored_bytes: int,
    codec: str,
    attempt: str,
) -> str:
    """A v2 completion record's name: its fields are in it (see the module docstring)."""
    leaf = (
        f"rank-{rank:06d}.done.{size}.{index_checksum}.{raw_bytes}.{stored_bytes}.{codec}.{attempt}"
    )
    if _RECORD.match(leaf) is None:
        raise FormatError(f"cannot name the completion record {leaf!r} (malformed field)")
    return record_folder(folder, hash_prefix(rank, prefixes)) + leaf


def failure_name(folder: str, rank: int, prefixes: int) -> str:
    """A v2 failure record's name (its body is the v1 failure record's JSON)."""
    return f"{record_folder(folder, hash_prefix(rank, prefixes))}rank-{rank:06d}.failed.json"


@dataclass(frozen=True, slots=True)
class ListedRecord:
    """A v2 completion record as its name tells it (no GET)."""

    rank: int
    size: int
    index_checksum: str
    raw_bytes: int
    stored_bytes: int
    codec: str
    attempt: str


def parse_record_name(leaf: str) -> ListedRecord | None:
    """The fields of a v2 record's last name component; None for any other name."""
    m = _RECORD.match(leaf)
    if m is None:
        return None
    return ListedRecord(
        int(m.group(1)),
        int(m.group(2)),
        m.group(3),
        int(m.group(4)),
        int(m.group(5)),
        m.group(6),
        m.group(7),
    )


def data_folder_part(name: str) -> str:
    """``name`` without its v2 hash prefix (``ab/steps/...`` -> ``steps/...``); v1 names and
    every other name are returned as they are."""
    m = _HH.match(name)
    return name[3:] if m is not None and name[3:].startswith("steps/") else name


def shard_in_folder(file: str, folder: str, version: int) -> bool:
    """Whether a manifest of ``version`` may list ``file`` for the step folder ``folder``:
    v1 ``<folder>...``, v2 ``<hh>/<folder>...``."""
    if version == 1:
        return file.startswith(folder)
    return _HH.match(file) is not None and file[3:].startswith(folder)


def manifest_version(files: list[str], folder: str) -> int:
    """The format version of a manifest listing ``files``: 1 when every file is in the v1
    step folder (so a checkpoint written with v1 names stays byte for byte v1), else 2."""
    return 1 if all(f.startswith(folder) for f in files) else 2


def describe(files: list[str], folder: str) -> str:
    """How a manifest's files are named, for people: ``format v1`` or ``format v2, N
    prefixes used``."""
    if manifest_version(files, folder) == 1:
        return "format v1"
    used = {f[:2] for f in files if _HH.match(f)}
    return f"format v2, {len(used)} prefix{'es' if len(used) != 1 else ''} used"
