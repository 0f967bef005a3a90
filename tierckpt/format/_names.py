"""The format's constants, checksum, checkpoint ids and the object names of a checkpoint
(manifests, data folders, shard files, rank records)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import xxhash

from tierckpt import limits
from tierckpt._types import BytesLike
from tierckpt.errors import FormatError
from tierckpt.layout import data_folder_part, shard_file

FORMAT_VERSION = 1
#: manifest versions this tierckpt reads: 1, and 2 (shard files under hashed prefixes,
#: tierckpt.layout; the shard files themselves are version 1)
MANIFEST_VERSIONS = (1, 2)
ALIGNMENT = 4096
FOOTER_SIZE = 64
MAX_STEP = 10**12 - 1
#: timelines are written with 6 digits; timeline 0 has no suffix at all (the v1 names)
MAX_TIMELINE = 10**6 - 1
MAX_INDEX_BYTES = limits.MAX_INDEX_BYTES
MAX_MANIFEST_BYTES = limits.MAX_MANIFEST_BYTES
MAX_WORLD_SIZE = 1 << 20
CHECKSUM_ALGO = "xxh3_64"

MANIFEST_DIR = "manifests"
DATA_DIR = "steps"
# timeline 0: exactly the v1 names; timeline t >= 1: a ".t<6 digits>" suffix (never ".t000000",
# so that every checkpoint has exactly one name)
_MANIFEST_RE = re.compile(r"^manifests/step-(\d{12})(?:\.t(\d{6}))?\.json$")
_DATA_RE = re.compile(r"^steps/(\d{12})(?:\.t(\d{6}))?/")


def checksum(data: BytesLike) -> str:
    """xxh3-64 of ``data`` as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


# -- checkpoint ids and names ---------------------------------------------------------


def _check_step(step: object) -> int:
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise FormatError(f"step must be an int in [0, {MAX_STEP}], got {step!r}")
    return step


def _check_timeline(timeline: object) -> int:
    if type(timeline) is not int or not 0 <= timeline <= MAX_TIMELINE:
        raise FormatError(f"timeline must be an int in [0, {MAX_TIMELINE}], got {timeline!r}")
    return timeline


@dataclass(frozen=True, slots=True)
class CheckpointId:
    """Which checkpoint: a step on a timeline, ordered by ``(timeline, step)``.

    A run resumed from an older step (a rollback) saves on a new timeline, one above the
    newest, so its checkpoints are newer than every checkpoint of the run it abandoned even
    where their step numbers are lower or equal. "The newest checkpoint" is the largest id;
    retention keeps the newest ids. Timeline 0 is the one every run starts on, and its names
    are exactly those of format v1.
    """

    step: int
    timeline: int = 0

    def __post_init__(self) -> None:
        _check_step(self.step)
        _check_timeline(self.timeline)

    @property
    def key(self) -> tuple[int, int]:
        """``(timeline, step)``: the order of ids."""
        return (self.timeline, self.step)

    def __lt__(self, other: CheckpointId) -> bool:
        return self.key < other.key

    def __le__(self, other: CheckpointId) -> bool:
        return self.key <= other.key

    def __gt__(self, other: CheckpointId) -> bool:
        return self.key > other.key

    def __ge__(self, other: CheckpointId) -> bool:
        return self.key >= other.key

    def __str__(self) -> str:
        return f"step {self.step}" + (f" (timeline {self.timeline})" if self.timeline else "")


def _suffix(timeline: int) -> str:
    return f".t{_check_timeline(timeline):06d}" if timeline else ""


def manifest_name(step: int, *, timeline: int = 0) -> str:
    """``manifests/step-<12 digits>.json``; on timeline t >= 1 ``...<12 digits>.t<6>.json``."""
    return f"{MANIFEST_DIR}/step-{_check_step(step):012d}{_suffix(timeline)}.json"


def parse_manifest_id(name: str) -> CheckpointId | None:
    """The checkpoint a manifest name belongs to; None for any other name."""
    m = _MANIFEST_RE.match(name)
    return _id_of(m)


def parse_manifest_name(name: str) -> int | None:
    """The step of a manifest name (of any timeline); None for any other name."""
    cid = parse_manifest_id(name)
    return cid.step if cid is not None else None


def parse_data_folder(name: str) -> CheckpointId | None:
    """The checkpoint whose data folder (``steps/<step>[.t<timeline>]/``, in format v2 also
    under a hashed prefix ``<hh>/``) holds ``name``."""
    return _id_of(_DATA_RE.match(data_folder_part(name)))


def _id_of(m: re.Match[str] | None) -> CheckpointId | None:
    if m is None:
        return None
    timeline = int(m.group(2)) if m.group(2) is not None else 0
    if m.group(2) is not None and timeline == 0:
        return None  # ".t000000" is not a name: timeline 0 has the suffix-free one
    return CheckpointId(int(m.group(1)), timeline)


def step_prefix(step: int, *, timeline: int = 0) -> str:
    """The data folder of a checkpoint: ``steps/<12 digits>/`` (``.t<6 digits>`` on t >= 1)."""
    return f"{DATA_DIR}/{_check_step(step):012d}{_suffix(timeline)}/"


def dcp_metadata_name(step: int, *, timeline: int = 0) -> str:
    """DCP's metadata of a checkpoint ``tierckpt.dcp`` wrote, in its data folder: the name its
    manifest's ``dcp`` entry holds (which also tells a DCP checkpoint from a native one)."""
    return f"{step_prefix(step, timeline=timeline)}dcp-metadata.json.zst"


def shard_name(step: int, rank: int, *, timeline: int = 0, prefixes: int = 256) -> str:
    """Rank ``rank``'s shard file: format v2 over ``prefixes`` hashed prefixes (256: every
    tier's default, ``<hh>/steps/...``); ``prefixes=0``: the v1 name
    ``steps/<step>/rank-<r>.tck``. See :mod:`tierckpt.layout`."""
    return shard_file(step_prefix(step, timeline=timeline), rank, prefixes)


def rank_record_name(step: int, rank: int, *, timeline: int = 0) -> str:
    return f"{step_prefix(step, timeline=timeline)}rank-{rank:06d}.done.json"


def rank_failure_name(step: int, rank: int, *, timeline: int = 0) -> str:
    """Where a rank says "my shard of this step failed" (so rank 0 stops waiting for it)."""
    return f"{step_prefix(step, timeline=timeline)}rank-{rank:06d}.failed.json"
