"""Completion and failure records: what a rank writes next to its shard on a tier, and the
errors rank 0 raises when records say a save cannot commit."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tierckpt.errors import CommitTimeout, FormatError, RankFailed
from tierckpt.format import MAX_STEP, MAX_TIMELINE, ShardRef, shard_name
from tierckpt.layout import data_folder_part

__all__ = [
    "RankRecord",
    "decode_failure",
    "decode_record",
    "encode_failure",
    "encode_record",
]

RECORD_FORMAT = "tierckpt-rank-record"
RECORD_VERSION = 1
FAILURE_FORMAT = "tierckpt-rank-failure"
MAX_RECORD_BYTES = 64 << 10
#: a failure record keeps at most this many characters of the error message
MAX_ERROR_CHARS = 2000
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_ATTEMPT = re.compile(r"^[0-9A-Za-z._-]{0,128}$")


# -- completion records -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankRecord:
    """One rank's statement "my shard of ``step`` is durable on ``tier``"."""

    step: int
    rank: int
    world_size: int
    attempt: str
    tier: str
    file: str
    size: int
    index_checksum: str
    raw_bytes: int
    stored_bytes: int
    codec: str
    #: the checkpoint's timeline (written only when non-zero)
    timeline: int = 0

    @property
    def ref(self) -> ShardRef:
        return ShardRef(self.rank, self.file, self.size, self.index_checksum)


def encode_record(r: RankRecord) -> bytes:
    body = {"format": RECORD_FORMAT, "version": RECORD_VERSION, **dataclasses.asdict(r)}
    if not r.timeline:
        del body["timeline"]  # timeline 0: the record of format v1, byte for byte
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _field(body: dict[str, Any], key: str, typ: type, where: str) -> Any:
    v = body.get(key)
    if type(v) is not typ:
        raise FormatError(f"{where}: record field {key!r} missing or not a {typ.__name__}")
    return v


def _record_body(data: bytes, fmt: str, what: str, where: str) -> dict[str, Any]:
    """The JSON object of a small record of format ``fmt``, size and version checked."""
    if len(data) > MAX_RECORD_BYTES:
        raise FormatError(f"{where}: {what} larger than {MAX_RECORD_BYTES} bytes")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: {what} is not JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != fmt:
        raise FormatError(f"{where}: not a tierckpt {what}")
    if body.get("version") != RECORD_VERSION:
        raise FormatError(f"{where}: unsupported {what} version {body.get('version')!r}")
    return body


def _timeline_field(body: dict[str, Any], where: str) -> int:
    timeline = body.get("timeline", 0)
    if type(timeline) is not int or not 0 <= timeline <= MAX_TIMELINE:
        raise FormatError(f"{where}: record field 'timeline' is not a timeline: {timeline!r}")
    return timeline


def decode_record(data: bytes, *, where: str) -> RankRecord:
    """Parse and validate a completion record (it comes from storage: trust nothing)."""
    body = _record_body(data, RECORD_FORMAT, "completion record", where)
    step = _field(body, "step", int, where)
    if not 0 <= step <= MAX_STEP:
        raise FormatError(f"{where}: record names step {step}")
    rec = RankRecord(
        step=step,
        rank=_field(body, "rank", int, where),
        world_size=_field(body, "world_size", int, where),
        attempt=_field(body, "attempt", str, where),
        tier=_field(body, "tier", str, where),
        file=_field(body, "file", str, where),
        size=_field(body, "size", int, where),
        index_checksum=_field(body, "index_checksum", str, where),
        raw_bytes=_field(body, "raw_bytes", int, where),
        stored_bytes=_field(body, "stored_bytes", int, where),
        codec=_field(body, "codec", str, where),
        timeline=_timeline_field(body, where),
    )
    # the shard's v1 name, or its v2 name under a hashed prefix (tierckpt.layout)
    if not 0 <= rec.rank < rec.world_size or data_folder_part(rec.file) != shard_name(
        rec.step, rec.rank, timeline=rec.timeline, prefixes=0
    ):
        raise FormatError(f"{where}: record names rank {rec.rank} / file {rec.file!r}")
    if not _HEX16.match(rec.index_checksum) or not _ATTEMPT.match(rec.attempt):
        raise FormatError(f"{where}: malformed checksum or attempt id in record")
    if min(rec.size, rec.raw_bytes, rec.stored_bytes) < 0:
        raise FormatError(f"{where}: negative size in record")
    return rec


def encode_failure(
    step: int, rank: int, attempt: str, tier: str, error: str, *, timeline: int = 0
) -> bytes:
    body: dict[str, Any] = {
        "format": FAILURE_FORMAT,
        "version": RECORD_VERSION,
        "step": step,
        "rank": rank,
        "attempt": attempt,
        "tier": tier,
        "error": error[:MAX_ERROR_CHARS],
    }
    if timeline:
        body["timeline"] = timeline
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def decode_failure(data: bytes, *, where: str) -> tuple[int, int, str, str, int]:
    """``(step, rank, attempt, error, timeline)`` of a failure record (from storage: trust
    nothing)."""
    body = _record_body(data, FAILURE_FORMAT, "failure record", where)
    step = _field(body, "step", int, where)
    rank = _field(body, "rank", int, where)
    attempt = _field(body, "attempt", str, where)
    error = _field(body, "error", str, where)
    if not _ATTEMPT.match(attempt):
        raise FormatError(f"{where}: malformed attempt id in failure record")
    return step, rank, attempt, error[:MAX_ERROR_CHARS], _timeline_field(body, where)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (
        f" and {len(ranks) - 20} more" if len(ranks) > 20 else ""
    )


def all_or_timeout(
    found: dict[int, RankRecord],
    *,
    world_size: int,
    step: int,
    tier_name: str,
    url: str,
    timeout: float,
    start: float,
    polls: str,
    hint: str = "",
    reported: Callable[[], bytes | None] | None = None,
) -> list[RankRecord] | None:
    """Every rank's record in rank order once ``found`` holds them all; ``None`` while some
    are missing and ``timeout`` seconds since ``start`` have not passed; then
    :class:`CommitTimeout` naming the missing ranks (``hint``: a further likely cause).
    ``reported()``: a rank's failure told through the process group's store, where its
    failure record could not be written to the tier (:class:`RankFailed` at once)."""
    if len(found) == world_size:
        logging.getLogger("tierckpt").debug(
            "step %d tier %s: all %d records after %s, %.3f s",
            step,
            tier_name,
            world_size,
            polls,
            time.monotonic() - start,
        )
        return [found[r] for r in range(world_size)]
    if reported is not None and (told := reported()) is not None:
        raise RankFailed(
            f"step {step} on tier {tier_name!r} ({url}): {told.decode('utf-8', 'replace')} "
            "(reported through the process group's store: its failure record could not be "
            "written to the tier); no manifest was written, so this step is not committed "
            "there and the previous checkpoint stays the newest"
        )
    if time.monotonic() < start + timeout:
        return None
    absent = [r for r in range(world_size) if r not in found]
    raise CommitTimeout(
        f"step {step} on tier {tier_name!r} ({url}): after {timeout:.0f} s rank 0 still "
        f"misses the completion records of ranks {_ranks(absent)} (of {world_size}); no "
        "manifest was written, so this step is not committed there and the previous "
        "checkpoint stays the newest. A rank died or failed to write its shard (see its "
        f"log){hint}, or a rank did not call save() for this step (every rank must save the same "
        "steps); if ranks are merely slow, raise TIERCKPT_COMMIT_TIMEOUT_S"
    )


def shared_failure_key(tier: str, step: int, timeline: int, attempt: str) -> str:
    """The process group's store key where a rank tells rank 0 that its part of a save on
    a shared tier failed, when its failure record could not be written to the tier."""
    return f"tierckpt/shared-failed/{tier}/{step}.{timeline}/{attempt}"
