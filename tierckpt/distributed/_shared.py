"""The commit on a tier every rank can read: each rank writes its completion record next to
its shard; rank 0 polls for every rank's (:func:`wait_for_records`) and writes the manifest
create-only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tierckpt._version import __version__
from tierckpt.backends.base import Backend
from tierckpt.distributed._knobs import DistKnobs, get_knobs
from tierckpt.distributed._records import (
    RankRecord,
    _ranks,
    all_or_timeout,
    decode_failure,
    decode_record,
    encode_record,
)
from tierckpt.errors import CheckpointNotFound, FormatError, RankFailed
from tierckpt.format import (
    CheckpointId,
    Manifest,
    decode_manifest,
    encode_manifest,
    manifest_name,
    rank_failure_name,
    rank_record_name,
    step_prefix,
)

if TYPE_CHECKING:
    from tierckpt.pipeline import SaveJob

__all__ = ["wait_committed", "wait_for_records"]

log = logging.getLogger("tierckpt")


def _write_record(backend: Backend, rec: RankRecord) -> None:
    # overwrite: a record of an earlier, killed attempt at this step may be there
    backend.put_atomic(
        rank_record_name(rec.step, rec.rank, timeline=rec.timeline),
        encode_record(rec),
        overwrite=True,
    )


def _manifest(
    tier_name: str, job: SaveJob, records: Sequence[RankRecord], *, node_local: bool = False
) -> Manifest:
    return Manifest(
        step=job.step,
        world_size=job.world_size,
        shards=tuple(r.ref for r in sorted(records, key=lambda r: r.rank)),
        created=time.time(),
        library_version=__version__,
        tier=tier_name,
        raw_bytes=sum(r.raw_bytes for r in records),
        stored_bytes=sum(r.stored_bytes for r in records),
        codecs=tuple(sorted({r.codec for r in records})),
        metadata=job.metadata,
        timeline=job.timeline,
        node_local=node_local,
    )


def _put_manifest(backend: Backend, m: Manifest) -> None:
    name = manifest_name(m.step, timeline=m.timeline)
    try:
        backend.put_atomic(name, encode_manifest(m))
    except FileExistsError:
        # a retried commit of the same attempt is fine; anything else is a conflict
        existing = decode_manifest(backend.get(name), where=f"{backend.url}/{name}")
        if existing.shards != m.shards:
            raise FormatError(
                f"{backend.url}/{name}: {m.id} was committed meanwhile with other shard "
                "files; refusing to overwrite it"
            ) from None


def wait_for_records(
    backend: Backend,
    tier_name: str,
    step: int,
    world_size: int,
    attempt: str,
    *,
    timeline: int = 0,
    reported: Callable[[], bytes | None] | None = None,
) -> list[RankRecord]:
    """Poll ``backend`` until every rank's record of this attempt is there (rank 0);
    ``reported``: see :func:`all_or_timeout`.

    Few missing records are fetched by name (one GET each); many by one LIST of the step's
    folder. The pause between polls doubles from ``poll_initial`` to ``poll_max``; after
    ``commit_timeout`` seconds :class:`CommitTimeout` names the missing ranks.
    """
    k = get_knobs()
    start = time.monotonic()
    deadline = start + k.commit_timeout
    delay = k.poll_initial
    found: dict[int, RankRecord] = {}
    stale: set[int] = set()
    polls = 0
    while True:
        polls += 1
        missing = [r for r in range(world_size) if r not in found]
        failed: list[int] | None = None  # None: probe every rank whose record is missing
        if len(missing) > k.direct_probe_max:
            listed = set(backend.list(step_prefix(step, timeline=timeline)))
            failed = [r for r in missing if rank_failure_name(step, r, timeline=timeline) in listed]
            missing = [r for r in missing if rank_record_name(step, r, timeline=timeline) in listed]
        absent: list[int] = []
        for r, data in _get_records(backend, step, missing, k.record_readers, timeline=timeline):
            if data is None:
                absent.append(r)
                continue
            name = rank_record_name(step, r, timeline=timeline)
            rec = decode_record(data, where=f"tier {tier_name!r} {backend.url}/{name}")
            if attempt and rec.attempt != attempt:
                if r not in stale:
                    stale.add(r)
                    log.info(
                        "step %d tier %s: ignoring rank %d's record of an earlier attempt",
                        step,
                        tier_name,
                        r,
                    )
                continue
            if (
                rec.step != step
                or rec.timeline != timeline
                or rec.rank != r
                or rec.world_size != world_size
            ):
                raise FormatError(
                    f"{backend.url}/{name}: record is for step {rec.step} timeline "
                    f"{rec.timeline} rank "
                    f"{rec.rank} of {rec.world_size}"
                )
            found[r] = rec
        _raise_reported_failures(
            backend, tier_name, step, attempt, absent if failed is None else failed, k, timeline
        )
        done = all_or_timeout(
            found,
            world_size=world_size,
            step=step,
            tier_name=tier_name,
            url=backend.url,
            timeout=k.commit_timeout,
            start=start,
            polls=f"{polls} polls",
            reported=reported,
        )
        if done is not None:
            return done
        now = time.monotonic()
        time.sleep(max(0.0, min(delay, deadline - now)))
        delay = min(delay * 2, k.poll_max)


def _raise_reported_failures(
    backend: Backend,
    tier_name: str,
    step: int,
    attempt: str,
    ranks: list[int],
    k: DistKnobs,
    timeline: int = 0,
) -> None:
    """Raise :class:`RankFailed` if any of ``ranks`` left a failure record of this attempt."""
    if not ranks:
        return
    reports = []
    for r, data in _get_records(
        backend, step, ranks, k.record_readers, rank_failure_name, timeline=timeline
    ):
        if data is None:
            continue
        name = rank_failure_name(step, r, timeline=timeline)
        f_step, f_rank, f_attempt, error, f_timeline = decode_failure(
            data, where=f"tier {tier_name!r} {backend.url}/{name}"
        )
        if (
            (attempt and f_attempt != attempt)
            or f_step != step
            or f_rank != r
            or f_timeline != timeline
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


def _get_records(
    backend: Backend,
    step: int,
    ranks: list[int],
    readers: int,
    name_of: Callable[..., str] = rank_record_name,
    *,
    timeline: int = 0,
) -> list[tuple[int, bytes | None]]:
    """GET the records of ``ranks`` (None: not there yet).

    At 8,000 ranks one-by-one GETs of ~15 ms would hold the commit for two minutes after the
    last rank finished (see docs/scale.md), so many records are read ``readers`` at a time:
    a bounded pool that lives only for this call, on rank 0's commit thread.
    """

    def one(r: int) -> tuple[int, bytes | None]:
        try:
            return r, backend.get(name_of(step, r, timeline=timeline))
        except CheckpointNotFound:
            return r, None

    if len(ranks) <= 2 or readers <= 1:
        return [one(r) for r in ranks]
    with ThreadPoolExecutor(min(readers, len(ranks)), thread_name_prefix="tierckpt-rec") as pool:
        return list(pool.map(one, ranks))


def wait_committed(
    backend: Backend, step: int, timeout: float | None = None, *, timeline: int = 0
) -> None:
    """Wait until ``step``'s manifest exists on ``backend`` (e.g. ``ck.backend("s3")``).

    On a non-zero rank a save handle's tier completion only means "my shard is durable";
    this waits for rank 0's commit. ``timeline``: the save's (``handle.timeline``; it is
    non-zero once the run went back to an older step). Raises ``TimeoutError``.
    """
    k = get_knobs()
    timeout = k.commit_timeout if timeout is None else timeout
    deadline = time.monotonic() + timeout
    delay = k.poll_initial
    while not backend.exists(manifest_name(step, timeline=timeline)):
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(
                f"{CheckpointId(step, timeline)} not committed on {backend.url} after "
                f"{timeout:.0f} s"
            )
        time.sleep(max(0.0, min(delay, deadline - now)))
        delay = min(delay * 2, k.poll_max)
