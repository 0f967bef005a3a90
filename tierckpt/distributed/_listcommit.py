"""The LIST-only commit on a shared tier with format v2 names (:mod:`tierckpt.layout`).

Each rank writes its completion record under its own hashed prefix, with the record's
fields (shard size, index checksum, raw and stored bytes, codec, attempt id) in the
record's name::

    <hh>/steps/<step>/records/rank-<r>.done.<size>.<crc>.<raw>.<stored>.<codec>.<attempt>

Rank 0 learns everything from LIST pages and GETs no record (:func:`wait_for_listed_records`):

- it lists only the ``records/`` folders (never the shard files beside them) of the prefixes
  that still miss a record, in parallel (``record_readers`` at a time);
- each LIST starts after the last rank of that prefix seen with every rank before it
  (ListObjectsV2 ``StartAfter``), so a poll reads only keys it has not read yet;
- the pause between polls doubles from ``poll_initial`` to ``poll_max``, but not after a
  poll that found new records (records still arriving: the commit follows them closely);
- a rank whose save failed writes ``records/rank-<r>.failed.json`` (JSON, GET only then).

The manifest is still written last, create-only, and only from records of this attempt,
one per rank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierckpt.backends.base import Backend
from tierckpt.distributed._knobs import get_knobs
from tierckpt.distributed._records import (
    RankRecord,
    _ranks,
    all_or_timeout,
    decode_failure,
    encode_record,
)
from tierckpt.errors import CheckpointNotFound, RankFailed
from tierckpt.format import step_prefix
from tierckpt.layout import (
    failure_name,
    hash_prefix,
    parse_record_name,
    prefixes_for,
    record_folder,
    record_name,
    shard_file,
)

if TYPE_CHECKING:
    from tierckpt.pipeline import Tier

__all__ = ["tier_prefixes", "wait_for_listed_records", "write_listed_record"]

log = logging.getLogger("tierckpt")


def tier_prefixes(tier: Tier) -> int:
    """The hashed prefixes ``tier`` writes (0: format v1 names, the GET-based commit)."""
    return prefixes_for(tier.spec.prefixes)


def write_listed_record(backend: Backend, rec: RankRecord, prefixes: int) -> None:
    """Write ``rec`` under its v2 name (its fields in the name; the body is the v1 JSON)."""
    name = record_name(
        step_prefix(rec.step, timeline=rec.timeline),
        rec.rank,
        prefixes,
        size=rec.size,
        index_checksum=rec.index_checksum,
        raw_bytes=rec.raw_bytes,
        stored_bytes=rec.stored_bytes,
        codec=rec.codec,
        attempt=rec.attempt,
    )
    backend.put_atomic(name, encode_record(rec), overwrite=True)


def listed_failure_name(step: int, rank: int, prefixes: int, *, timeline: int = 0) -> str:
    return failure_name(step_prefix(step, timeline=timeline), rank, prefixes)


def wait_for_listed_records(
    backend: Backend,
    tier_name: str,
    step: int,
    world_size: int,
    attempt: str,
    prefixes: int,
    *,
    timeline: int = 0,
    reported: Callable[[], bytes | None] | None = None,
) -> list[RankRecord]:
    """Poll the records' folders until every rank's record of this attempt is listed (rank 0);
    see the module docstring. :class:`CommitTimeout` after ``commit_timeout`` seconds,
    :class:`RankFailed` as soon as a rank's failure record of this attempt is listed."""
    k = get_knobs()
    start = time.monotonic()
    deadline = start + k.commit_timeout
    delay = k.poll_initial
    folder = step_prefix(step, timeline=timeline)
    groups: dict[str, list[int]] = {}
    for r in range(world_size):
        groups.setdefault(hash_prefix(r, prefixes), []).append(r)
    cursor = dict.fromkeys(groups, 0)  # groups[hh][:cursor[hh]] all found
    short_ranks = world_size <= 10**6
    found: dict[int, RankRecord] = {}
    polls = lists = 0
    pool = ThreadPoolExecutor(max(1, k.record_readers), thread_name_prefix="tierckpt-list")
    try:
        while True:
            polls += 1
            pending = [hh for hh in groups if cursor[hh] < len(groups[hh])]

            def one(hh: str) -> tuple[str, list[str]]:
                base = record_folder(folder, hh)
                c = cursor[hh]
                # keys sort by rank while ranks have 6 digits (rank 10^6 would sort before
                # rank 999,999): past that, list the whole folder
                after = f"{base}rank-{groups[hh][c - 1]:06d}.~" if c and short_ranks else ""
                return hh, backend.list_after(base, after)

            listed = list(pool.map(one, pending))
            lists += len(listed)
            before = len(found)
            failed: list[int] = []
            for hh, names in listed:
                base = record_folder(folder, hh)
                for name in names:
                    leaf = name[len(base) :]
                    if leaf.endswith(".failed.json"):
                        try:
                            r = int(leaf[5:].split(".", 1)[0])
                        except ValueError:
                            continue
                        if r not in found:
                            failed.append(r)
                        continue
                    got = parse_record_name(leaf)
                    if (
                        got is None
                        or not 0 <= got.rank < world_size
                        or hash_prefix(got.rank, prefixes) != hh
                        or (attempt and got.attempt != attempt)
                    ):
                        continue  # another attempt's record, or not a record at all
                    found[got.rank] = RankRecord(
                        step=step,
                        rank=got.rank,
                        world_size=world_size,
                        attempt=got.attempt,
                        tier=tier_name,
                        file=shard_file(folder, got.rank, prefixes),
                        size=got.size,
                        index_checksum=got.index_checksum,
                        raw_bytes=got.raw_bytes,
                        stored_bytes=got.stored_bytes,
                        codec=got.codec,
                        timeline=timeline,
                    )
                ranks = groups[hh]
                while cursor[hh] < len(ranks) and ranks[cursor[hh]] in found:
                    cursor[hh] += 1
            if failed:
                _raise_listed_failures(
                    backend, tier_name, step, attempt, sorted(set(failed)), prefixes, timeline
                )
            done = all_or_timeout(
                found,
                world_size=world_size,
                step=step,
                tier_name=tier_name,
                url=backend.url,
                timeout=k.commit_timeout,
                start=start,
                polls=f"{polls} polls ({lists} LISTs)",
                hint=", or ranks configure different `prefixes` for this tier",
                reported=reported,
            )
            if done is not None:
                return done
            now = time.monotonic()
            time.sleep(max(0.0, min(delay, deadline - now)))
            if len(found) == before:  # no progress: back off; records arriving: keep pace
                delay = min(delay * 2, k.poll_max)
    finally:
        pool.shutdown(wait=False)


def _raise_listed_failures(
    backend: Backend,
    tier_name: str,
    step: int,
    attempt: str,
    ranks: list[int],
    prefixes: int,
    timeline: int,
) -> None:
    """:class:`RankFailed` if a listed failure record of ``ranks`` is of this attempt."""
    reports = []
    for r in ranks:
        name = listed_failure_name(step, r, prefixes, timeline=timeline)
        try:
            data = backend.get(name)
        except CheckpointNotFound:
            continue
        f_step, f_rank, f_attempt, error, f_timeline = decode_failure(
            data, where=f"tier {tier_name!r} {backend.url}/{name}"
        )
        if (attempt and f_attempt != attempt) or (f_step, f_rank, f_timeline) != (
            step,
            r,
            timeline,
        ):
            continue  # an earlier attempt at this step failed; this one may not
        reports.append((r, error))
    if reports:
        detail = "; ".join(f"rank {r}: {e}" for r, e in reports[:5])
        raise RankFailed(
            f"step {step} on tier {tier_name!r} ({backend.url}): rank(s) "
            f"{_ranks([r for r, _ in reports])} reported that their shard failed ({detail}); "
            "no manifest was written, so this step is not committed there and the previous "
            "checkpoint stays the newest"
        )
