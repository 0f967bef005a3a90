"""Multi-rank commit and load agreement on ``torch.distributed``.

Save
    Every rank streams its own shard file (``steps/<step>/rank-<r>.tck``; on a timeline t >= 1
    ``steps/<step>.t<t>/...``, see :class:`~tierckpt.format.CheckpointId`) to every tier in its
    own background threads. Once a rank's file is durable on a tier it writes a small
    *completion record* next to it (``rank-<r>.done.json``: the shard's size and index
    checksum, raw and stored bytes, and the *attempt id* of this save). Rank 0, once its own
    file is durable, polls the tier for the other ranks' records — storage requests only, never
    a collective in a background thread, on the pipeline's commit threads so that the tier's
    writer moves on to the next checkpoint — and writes the tier's manifest, listing every
    rank's file, create-only. A non-zero rank returns as soon as its record is written: on
    those ranks ``handle.done(tier)`` means "my shard is durable there", not "the checkpoint
    is committed"; :func:`wait_committed` waits for the manifest.

    A rank whose save fails on a tier (disk full, storage errors, a failed capture) writes a
    *failure record* there instead (``rank-<r>.failed.json``: attempt id and error message):
    rank 0 sees it at its next poll and fails that tier's save at once with
    :class:`RankFailed`, naming the rank and its error. A rank that dies writes nothing, so
    rank 0 writes no manifest: after ``commit_timeout`` it fails that tier's save with
    :class:`CommitTimeout`, naming the missing ranks. Either way nothing is committed and the
    previous checkpoint stays the newest committed one.

Attempt ids
    Records of an earlier, killed attempt at the same step must not be mistaken for this
    one's, so every record carries an attempt id ``<session>-<n>``: the session id is drawn by
    rank 0 and spread by one small all-reduce in the training thread at the checkpointer's
    first multi-rank save (:func:`begin_save`); ``n`` counts saves. Later saves need no
    collective — except with ``on_busy="skip"``, where every save runs that all-reduce so that
    all ranks skip together.

Private tiers
    A tier whose storage other ranks cannot see (a RAM tier: each process has its own; or a
    node-local disk named in ``TIERCKPT_PRIVATE_TIERS``) cannot be polled by rank 0. There the
    records travel through the process group's key-value store (the ``TCPStore`` behind
    ``init_process_group``, safe to use from background threads): each rank publishes its
    record, rank 0 composes the manifest once and publishes it, and every rank writes that same
    manifest onto its own copy of the tier. Each rank applies retention to its own copy. A
    rank that fails there sets a failure key in the store, which every waiting rank checks.

Load
    :func:`agree_on_step` — one ``all_gather`` of a fixed-size vector in the calling thread —
    makes every rank load the same checkpoint: the newest (step and timeline) whose manifest
    and own shard index every rank can read.

Timelines
    Every rank must write the same checkpoint id. Where a save chooses its timeline from the
    tiers (the first save, the first after a load, a step below the previous save's: the same
    saves on every rank) each rank proposes one from its own view of the tiers and
    :func:`begin_save`'s all-reduce takes the largest; other saves keep the previous save's
    timeline on every rank without a collective.

Knobs (environment overrides, :func:`knobs` context manager for tests)
    ``TIERCKPT_COMMIT_TIMEOUT_S`` (600), ``TIERCKPT_COMMIT_POLL_MAX_S`` (2.0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tierckpt._version import __version__
from tierckpt.backends.base import Backend
from tierckpt.errors import CheckpointNotFound, FormatError, TierCkptError
from tierckpt.format import (
    MAX_STEP,
    MAX_TIMELINE,
    CheckpointId,
    Manifest,
    ShardRef,
    decode_manifest,
    encode_manifest,
    manifest_name,
    rank_failure_name,
    rank_record_name,
    shard_name,
    step_prefix,
)
from tierckpt.restore import LoadedShard, is_recoverable, read_index, read_manifest

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer
    from tierckpt.pipeline import SaveJob, TierRuntime

__all__ = [
    "CommitTimeout",
    "DistKnobs",
    "RankFailed",
    "RankRecord",
    "agree_on_step",
    "checkpoint_key",
    "checkpoint_of_key",
    "begin_save",
    "collective_device",
    "commit_multi_rank",
    "decode_record",
    "encode_record",
    "get_knobs",
    "is_private_tier",
    "knobs",
    "publish_repopulated",
    "report_failure",
    "repopulates",
    "wait_committed",
]

log = logging.getLogger("tierckpt")

RECORD_FORMAT = "tierckpt-rank-record"
RECORD_VERSION = 1
FAILURE_FORMAT = "tierckpt-rank-failure"
MAX_RECORD_BYTES = 64 << 10
#: a failure record keeps at most this many characters of the error message
MAX_ERROR_CHARS = 2000
_HEX16 = re.compile(r"^[0-9a-f]{16}$")
_ATTEMPT = re.compile(r"^[0-9A-Za-z._-]{0,128}$")


class CommitTimeout(TierCkptError, TimeoutError):
    """Rank 0 gave up waiting for other ranks' completion records: nothing was committed."""


class RankFailed(TierCkptError):
    """Another rank reported that its shard failed on this tier: nothing was committed."""


# -- knobs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DistKnobs:
    """Tuning of the multi-rank commit; see :func:`get_knobs`."""

    #: how long rank 0 waits for every rank's record before failing the tier's save
    commit_timeout: float = 600.0
    #: first and largest pause between two polls (the pause doubles up to the largest)
    poll_initial: float = 0.05
    poll_max: float = 2.0
    #: at most this many missing records: GET each by name; more: one LIST of the step folder
    direct_probe_max: int = 16
    #: records GET in parallel by rank 0 when many arrive at once
    record_readers: int = 16
    #: how many candidate steps each rank offers to the load agreement
    agree_max_candidates: int = 32


_knobs_override: DistKnobs | None = None


def get_knobs() -> DistKnobs:
    """The knobs in force: :func:`knobs` overrides, then the environment, then defaults."""
    if _knobs_override is not None:
        return _knobs_override
    k = DistKnobs()
    env_timeout = os.environ.get("TIERCKPT_COMMIT_TIMEOUT_S")
    env_poll = os.environ.get("TIERCKPT_COMMIT_POLL_MAX_S")
    if env_timeout:
        k = dataclasses.replace(k, commit_timeout=float(env_timeout))
    if env_poll:
        k = dataclasses.replace(k, poll_max=float(env_poll))
    return k


@contextlib.contextmanager
def knobs(**changes: Any) -> Iterator[DistKnobs]:
    """Override knobs in this process for the duration of a ``with`` block (tests)."""
    global _knobs_override
    old = _knobs_override
    _knobs_override = dataclasses.replace(get_knobs(), **changes)
    try:
        yield _knobs_override
    finally:
        _knobs_override = old


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
    if not 0 <= rec.rank < rec.world_size or rec.file != shard_name(
        rec.step, rec.rank, timeline=rec.timeline
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


def report_failure(tier: TierRuntime, job: SaveJob, error: BaseException) -> None:
    """Tell the ranks waiting on ``tier`` that this rank's part of ``job`` failed.

    Called by the pipeline when a multi-rank save fails on a tier. On a shared tier a non-zero
    rank writes its failure record (rank 0 is the one that waits; nobody waits for rank 0's
    record); on a private tier any rank sets the attempt's failure key in the store. Best
    effort: storage that just failed may fail again, and then rank 0 falls back on its
    ``commit_timeout``.
    """
    if isinstance(error, (CommitTimeout, RankFailed)):
        return  # a verdict on other ranks, not a failure of this rank's own part
    try:
        if is_private_tier(tier):
            if job.attempt:
                st = _store()
                with _store_lock:
                    st.set(
                        f"tierckpt/{job.attempt}/{tier.name}/failed",
                        f"rank {job.rank}: {_describe(error)}".encode("utf-8", "replace"),
                    )
            return
        if job.rank == 0:
            return
        body = encode_failure(
            job.step, job.rank, job.attempt, tier.name, _describe(error), timeline=job.timeline
        )
        tier.backend.put_atomic(
            rank_failure_name(job.step, job.rank, timeline=job.timeline), body, overwrite=True
        )
    except Exception as exc:  # never mask the save's own error
        log.warning(
            "step %d tier %s: could not report rank %d's failure to the other ranks (%s); "
            "rank 0 will wait out its commit timeout",
            job.step,
            tier.name,
            job.rank,
            exc,
        )


# -- the training-thread handshake ------------------------------------------------------


def _group_ok(ck: Checkpointer) -> bool:
    """Whether the default process group is up and matches the checkpointer's rank/world."""
    import torch.distributed as dist

    return (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == ck.world_size
        and dist.get_rank() == ck.rank
    )


def _collective_device() -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "gloo" not in backend and "cpu" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


collective_device = _collective_device

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


@dataclass
class _Session:
    """Per-checkpointer state of the handshake: the id agreed at the first save, a counter."""

    session: int = 0
    saves: int = 0


_sessions: weakref.WeakKeyDictionary[Checkpointer, _Session] = weakref.WeakKeyDictionary()


def begin_save(
    ck: Checkpointer, step: int, busy: bool, *, timeline: int = 0, agree_timeline: bool = False
) -> tuple[str, bool, int]:
    """Agree on an attempt id (and, with ``on_busy="skip"``, on skipping; and on the
    timeline); training thread.

    Returns ``(attempt_id, skip_because_busy, timeline)``. The attempt id is ``<session>-<n>``: the
    session id is drawn by rank 0 and spread by one all-reduce at the checkpointer's first
    multi-rank save; ``n`` counts saves, which every rank makes in the same order. So
    with ``on_busy="block"`` (the default) later saves need no collective at all. With
    ``on_busy="skip"`` every save runs one small all-reduce so that all ranks skip together
    (and checks that they save the same step; a mismatch raises ``ValueError`` everywhere).
    Without an initialized process group (rank and world size given by hand) there is no
    collective: the session is ``TIERCKPT_ATTEMPT_ID`` (empty: any record is accepted).

    ``agree_timeline``: ``timeline`` is this rank's choice from its own view of the tiers
    (the first save, the first after a load, a step below the previous save's — the same
    saves on every rank); the ranks take the largest, in the same all-reduce, so that every
    rank writes the same checkpoint id. Otherwise ``timeline`` is returned as it is.
    """
    sess = _sessions.setdefault(ck, _Session())
    sess.saves += 1
    if not _group_ok(ck):
        _warn_once(
            "no-group",
            "multi-rank save without an initialized torch.distributed group: ranks cannot "
            "agree on an attempt id (set TIERCKPT_ATTEMPT_ID per job attempt) nor skip together",
        )
        attempt = os.environ.get("TIERCKPT_ATTEMPT_ID", "")
        if not _ATTEMPT.match(attempt) or len(attempt) > 100:
            raise ValueError("TIERCKPT_ATTEMPT_ID may hold only [0-9A-Za-z._-], 100 at most")
        return (f"{attempt}-{sess.saves}" if attempt else ""), busy, timeline
    skip_mode = ck.on_busy == "skip"
    if sess.session == 0 or skip_mode or agree_timeline:
        import torch.distributed as dist

        mine = secrets.randbits(62) + 1 if ck.rank == 0 and sess.session == 0 else 0
        t = torch.tensor(
            [mine, step, -step, int(busy), timeline],
            dtype=torch.int64,
            device=_collective_device(),
        )
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        drawn, hi, neg_lo, any_busy, timeline = (int(v) for v in t.tolist())
        if sess.session == 0:
            sess.session = drawn
        if hi != -neg_lo:
            raise ValueError(
                f"ranks are saving different steps (from {-neg_lo} to {hi}); every rank must "
                "call save() with the same step"
            )
        busy = bool(any_busy)
    return f"{sess.session:016x}-{sess.saves}", busy, timeline


# -- commit ------------------------------------------------------------------------------


def is_private_tier(tier: TierRuntime) -> bool:
    """A tier other ranks cannot read: not durable (per-process RAM), or named in
    ``TIERCKPT_PRIVATE_TIERS`` (comma-separated tier names, e.g. node-local NVMe)."""
    names = {n.strip() for n in os.environ.get("TIERCKPT_PRIVATE_TIERS", "").split(",")}
    return (not tier.backend.is_durable) or tier.name in names


def commit_multi_rank(
    ck: Checkpointer, tier: TierRuntime, job: SaveJob, ref: ShardRef, raw: int, stored: int
) -> Future[None] | None:
    """Runs on a tier's writer thread once this rank's shard is durable on ``tier``.

    Writes this rank's record and returns; on rank 0 (and on private tiers) the waiting part
    goes to the pipeline's commit threads (a Future), so the tier's writer thread moves on to
    the next checkpoint and training never waits for other ranks' flushes.
    """
    rec = RankRecord(
        step=job.step,
        rank=job.rank,
        world_size=job.world_size,
        attempt=job.attempt,
        tier=tier.name,
        file=ref.file,
        size=ref.size,
        index_checksum=ref.index_checksum,
        raw_bytes=raw,
        stored_bytes=stored,
        codec=tier.codec.codec_id,
        timeline=job.timeline,
    )
    if is_private_tier(tier):
        st = _publish_private(tier, job, rec)
        return _defer(ck, lambda: _commit_private(ck, tier, job, st))
    _write_record(tier.backend, rec)
    if job.rank != 0:
        return None

    def wait_and_commit() -> None:
        records = wait_for_records(
            tier.backend, tier.name, job.step, job.world_size, job.attempt, timeline=job.timeline
        )
        _put_manifest(tier.backend, _manifest(tier.name, job, records))

    return _defer(ck, wait_and_commit)


def _defer(ck: Checkpointer, fn: Callable[[], None]) -> Future[None] | None:
    pipeline = ck._pipeline
    if pipeline is None:
        fn()
        return None
    return pipeline.defer(fn)


def _write_record(backend: Backend, rec: RankRecord) -> None:
    # overwrite: a record of an earlier, killed attempt at this step may be there
    backend.put_atomic(
        rank_record_name(rec.step, rec.rank, timeline=rec.timeline),
        encode_record(rec),
        overwrite=True,
    )


def _manifest(tier_name: str, job: SaveJob, records: Sequence[RankRecord]) -> Manifest:
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
) -> list[RankRecord]:
    """Poll ``backend`` until every rank's record of this attempt is there (rank 0).

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
        if len(found) == world_size:
            log.debug(
                "step %d tier %s: all %d records after %d polls, %.3f s",
                step,
                tier_name,
                world_size,
                polls,
                time.monotonic() - start,
            )
            return [found[r] for r in range(world_size)]
        now = time.monotonic()
        if now >= deadline:
            absent = [r for r in range(world_size) if r not in found]
            raise CommitTimeout(
                f"step {step} on tier {tier_name!r} ({backend.url}): after "
                f"{k.commit_timeout:.0f} s rank 0 still misses the completion records of "
                f"ranks {_ranks(absent)} (of "
                f"{world_size}); no manifest was written, so this step is not committed there "
                "and the previous checkpoint stays the newest. A rank died or failed to write its "
                "shard (see its log); if ranks are merely slow, raise TIERCKPT_COMMIT_TIMEOUT_S"
            )
        time.sleep(min(delay, deadline - now))
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


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:20])) + (
        f" and {len(ranks) - 20} more" if len(ranks) > 20 else ""
    )


def wait_committed(
    backend: Backend, step: int, timeout: float | None = None, *, timeline: int = 0
) -> None:
    """Wait until ``step``'s manifest exists on ``backend`` (e.g. ``ck.backend("s3")``).

    On a non-zero rank a save handle's tier completion only means "my shard is durable";
    this waits for rank 0's commit. ``timeline``: the save's (``handle.timeline``; it is
    non-zero once the run went back to an older step). Raises ``TimeoutError``.
    """
    k = get_knobs()
    deadline = time.monotonic() + (k.commit_timeout if timeout is None else timeout)
    delay = k.poll_initial
    while not backend.exists(manifest_name(step, timeline=timeline)):
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(
                f"{CheckpointId(step, timeline)} not committed on {backend.url} after {timeout} s"
            )
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, k.poll_max)


# -- private tiers: records through the process group's store ---------------------------

_store_lock = threading.Lock()
_store_cache: dict[int, Any] = {}


def _store() -> Any:
    """A client of the default process group's key-value store for background threads."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise TierCkptError(
            "a private tier (RAM, or named in TIERCKPT_PRIVATE_TIERS) in a multi-rank job needs "
            "torch.distributed initialized: its commit goes through the process group's store"
        )
    base: Any = dist.distributed_c10d._get_default_store()
    with _store_lock:
        st = _store_cache.get(id(base))
        if st is None:
            try:
                st = base.clone()  # its own connection: the training thread keeps the other
            except (RuntimeError, AttributeError):
                st = base
            _store_cache.clear()
            _store_cache[id(base)] = st
        return st


def _store_failure(where: str, failure: bytes) -> RankFailed:
    return RankFailed(
        f"{where}: {failure.decode('utf-8', 'replace')} (reported through the process group's "
        "store); nothing committed, the previous checkpoint stays the newest"
    )


def _store_wait(
    st: Any, keys: list[str], where: str, what: str, deadline: float, failed_key: str
) -> None:
    """Wait until ``keys`` are in the store; ``where: what`` on timeout; RankFailed at once if
    a rank set ``failed_key``."""
    k = get_knobs()
    delay = k.poll_initial
    while True:
        with _store_lock:
            ready = st.check(keys)
            failure = bytes(st.get(failed_key)) if not ready and st.check([failed_key]) else None
        if ready:
            return
        if failure is not None:
            raise _store_failure(where, failure)
        now = time.monotonic()
        if now >= deadline:
            raise CommitTimeout(f"{where}: {what}")
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, k.poll_max)


def _publish_private(tier: TierRuntime, job: SaveJob, rec: RankRecord) -> Any:
    """Put this rank's record into the store (on the tier thread, before any waiting, so
    that rank 0's wait never depends on another rank's queued commit work)."""
    if not job.attempt:
        raise TierCkptError(
            f"tier {tier.name!r} is private to each process; a multi-rank commit on it needs an "
            "initialized torch.distributed process group"
        )
    st = _store()
    with _store_lock:
        st.set(f"tierckpt/{job.attempt}/{tier.name}/rec/{job.rank}", encode_record(rec))
    return st


def _commit_private(ck: Checkpointer, tier: TierRuntime, job: SaveJob, st: Any) -> None:
    k = get_knobs()
    deadline = time.monotonic() + k.commit_timeout
    prefix = f"tierckpt/{job.attempt}/{tier.name}/"
    rec_keys = [f"{prefix}rec/{r}" for r in range(job.world_size)]
    m_key = f"{prefix}manifest"
    failed_key = f"{prefix}failed"
    where = f"step {job.step} tier {tier.name!r}"
    if job.rank == 0:
        try:
            _store_wait(
                st,
                rec_keys,
                where,
                "not every rank published its completion record in time; nothing committed",
                deadline,
                failed_key,
            )
            with _store_lock:
                blobs = st.multi_get(rec_keys)
            records = [
                decode_record(bytes(b), where=f"store {key}")
                for b, key in zip(blobs, rec_keys, strict=True)
            ]
            if any(
                r.attempt != job.attempt or r.step != job.step or r.timeline != job.timeline
                for r in records
            ):
                raise FormatError(f"step {job.step}: a record in the store is of another attempt")
            body = encode_manifest(_manifest(tier.name, job, records))
        except BaseException as exc:
            with _store_lock:
                st.set(m_key, b"FAILED " + str(exc).encode("utf-8", "replace")[:4096])
            raise
        with _store_lock:
            st.set(m_key, body)
    _store_wait(
        st,
        [m_key],
        where,
        "rank 0 published no manifest in time; nothing committed",
        deadline,
        failed_key,
    )
    with _store_lock:
        body = bytes(st.get(m_key))
    if body.startswith(b"FAILED "):
        with _store_lock:
            failure = bytes(st.get(failed_key)) if st.check([failed_key]) else None
        if failure is not None:  # rank 0 gave up because a rank reported a failure
            raise _store_failure(where, failure)
        raise TierCkptError(
            f"step {job.step} tier {tier.name!r}: rank 0 could not commit: "
            f"{body[7:].decode('utf-8', 'replace')}"
        )
    m = decode_manifest(body, where=f"store {m_key}")
    _put_manifest(tier.backend, m)
    with _store_lock:
        done = int(st.add(f"{prefix}done", 1))
        if done == job.world_size:  # the last rank out cleans the store
            for key in [*rec_keys, m_key, f"{prefix}done"]:
                with contextlib.suppress(RuntimeError):
                    st.delete_key(key)
    if job.rank != 0:  # the pipeline applies retention on rank 0 only
        from tierckpt.retention import gc_tier

        pipeline = ck._pipeline
        if pipeline is None or not pipeline.may_collect(tier, job.rank):
            return  # retention only while this writer holds the location's lease
        protect = {j.id for j in pipeline.in_flight() if j is not job}
        try:
            gc_tier(tier.backend, tier.spec.keep_last, protect=protect)
        except OSError as exc:
            log.warning("retention on tier %s failed (will retry next save): %s", tier.name, exc)


# -- repopulation after a multi-rank load ------------------------------------------------


#: tiers a multi-rank load can repopulate (the size of its all_reduce vector)
_MAX_REPOP_TIERS = 16


def repopulates(ck: Checkpointer) -> bool:
    """Whether this job's loads copy shards to faster tiers (same answer on every rank)."""
    return bool(ck.repopulate) and _group_ok(ck)


def publish_repopulated(ck: Checkpointer, loaded: LoadedShard | None) -> None:
    """Commit the copies a multi-rank load made on faster tiers, once every rank's is there.

    Each rank copied its own shard file to its local durable tiers while reading it from a
    remote one (``read_shard(publish=False)``). One ``all_reduce`` (MIN and MAX of a small
    vector, in the calling thread; every rank calls this exactly once per load, ``loaded``
    None where its load failed) tells whether every rank copied from the same source tier to
    a tier; there the source's manifest is written — by rank 0 on a tier all ranks share,
    by every rank on a private one. Elsewhere the copied files stay uncommitted leftovers,
    which retention removes. Best effort: a failure is logged, never raised.
    """
    import torch.distributed as dist

    # a fixed size: a rank configured with other tiers must not make the collective hang
    n = min(len(ck._tiers), _MAX_REPOP_TIERS)
    vec = torch.zeros(_MAX_REPOP_TIERS, dtype=torch.int64)
    if loaded is not None:
        source = next(i for i, t in enumerate(ck._tiers) if t.name == loaded.tier) + 1
        for i, t in enumerate(ck._tiers[:n]):
            if any(b is t.backend for b in loaded.repopulated):
                vec[i] = source
    dev = _collective_device()
    lo, hi = vec.to(dev), vec.to(dev)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if loaded is None:
        return
    body = encode_manifest(loaded.manifest)
    cid = loaded.manifest.id
    name = manifest_name(cid.step, timeline=cid.timeline)
    for i, t in enumerate(ck._tiers[:n]):
        if int(lo[i]) == 0 or int(lo[i]) != int(hi[i]):
            continue  # some rank did not copy here, or copied another tier's file
        private = is_private_tier(t)
        if ck.rank != 0 and not private:
            continue
        try:
            if not private:
                # a tier said to be shared must really hold every rank's file (per-node
                # folders belong in TIERCKPT_PRIVATE_TIERS)
                there = set(t.backend.list(step_prefix(cid.step, timeline=cid.timeline)))
                absent = [r.rank for r in loaded.manifest.shards if r.file not in there]
                if absent:
                    log.warning(
                        "%s: not committing the copy on tier %s: it lacks the files of "
                        "ranks %s (a per-node folder? name it in TIERCKPT_PRIVATE_TIERS)",
                        cid,
                        t.name,
                        _ranks(absent),
                    )
                    continue
            t.backend.put_atomic(name, body)
            log.info(
                "%s is now also on tier %s (copied from %s by every rank)",
                cid,
                t.name,
                loaded.tier,
            )
        except FileExistsError:
            pass
        except (OSError, TierCkptError) as exc:
            log.warning(
                "%s: could not commit the copy on tier %s: %s",
                cid,
                t.name,
                exc,
            )


# -- load agreement ---------------------------------------------------------------------


def _readable(ck: Checkpointer, cid: CheckpointId) -> str:
    """Empty if this rank can read ``cid`` (manifest + own shard index) on some tier, else
    why not."""
    reasons = []
    for t in ck._tiers:
        try:
            m = read_manifest(t.backend, cid.step, t.name, timeline=cid.timeline)
            if m.world_size != ck.world_size:
                reasons.append(
                    f"tier {t.name!r}: saved by {m.world_size} ranks, this job has "
                    f"{ck.world_size} (the native format needs the same world size; save with "
                    "tierckpt.dcp to reshard)"
                )
                continue
            read_index(t.backend, m.shard_for(ck.rank), t.name)
            return ""
        except CheckpointNotFound:
            continue
        except BaseException as exc:
            if not is_recoverable(exc):
                raise
            reasons.append(f"tier {t.name!r}: {exc}")
    return "; ".join(reasons) or "not on any tier"


#: a checkpoint id as one int64 for the load agreement: ordered like the ids
_ID_BASE = MAX_STEP + 1


def checkpoint_key(cid: CheckpointId) -> int:
    """A checkpoint id as one int64 (for collectives): ordered as the ids are."""
    return cid.timeline * _ID_BASE + cid.step


def checkpoint_of_key(key: int) -> CheckpointId:
    """The inverse of :func:`checkpoint_key`."""
    return CheckpointId(key % _ID_BASE, key // _ID_BASE)


def agree_on_step(ck: Checkpointer, candidates: Sequence[CheckpointId]) -> list[CheckpointId]:
    """The checkpoint every rank loads: the newest of ``candidates`` all ranks can read.

    One ``all_gather`` of ``agree_max_candidates`` int64 per rank (a checkpoint id each, in
    the ids' order), in the calling thread; every rank must call ``load()`` together. Returns
    a one-element list, or raises ``CheckpointNotFound`` on every rank when the ranks share
    no readable checkpoint.
    """
    if not _group_ok(ck):
        _warn_once(
            "no-group-load",
            "multi-rank load without an initialized torch.distributed "
            "group: ranks cannot agree on a step; each loads its own newest",
        )
        if not candidates:
            raise CheckpointNotFound(f"rank {ck.rank}: no committed checkpoint on any tier")
        return list(candidates)
    import torch.distributed as dist

    k = get_knobs()
    mine: list[CheckpointId] = []
    why: dict[CheckpointId, str] = {}
    for cid in list(candidates)[: k.agree_max_candidates]:
        reason = _readable(ck, cid)
        if reason:
            why[cid] = reason
        else:
            mine.append(cid)
    dev = _collective_device()
    vec = torch.full((k.agree_max_candidates,), -1, dtype=torch.int64, device=dev)
    if mine:
        keys = [checkpoint_key(c) for c in mine]
        vec[: len(mine)] = torch.tensor(keys, dtype=torch.int64, device=dev)
    gathered = [torch.empty_like(vec) for _ in range(ck.world_size)]
    dist.all_gather(gathered, vec)
    sets = [{int(v) for v in g.tolist() if v >= 0} for g in gathered]
    common = set.intersection(*sets)
    if common:
        chosen = checkpoint_of_key(max(common))
        if mine and chosen != mine[0]:
            log.warning(
                "rank %d: loading %s, the newest checkpoint every rank can read (this rank "
                "also has %s)",
                ck.rank,
                chosen,
                ", ".join(str(c) for c in [c for c in mine if c > chosen][:5]),
            )
        return [chosen]
    newest = {r: str(checkpoint_of_key(max(s))) if s else None for r, s in enumerate(sets)}
    lacking = [r for r, s in newest.items() if s is None]
    detail = "; ".join(f"{c}: {w}" for c, w in list(why.items())[:3])
    raise CheckpointNotFound(
        f"no checkpoint step is committed and readable on every rank (this rank looked at "
        f"{', '.join(map(str, list(candidates)[:5])) or 'no committed step'}; newest readable "
        f"checkpoint per rank: {dict(list(newest.items())[:16])}; ranks with none: "
        f"{_ranks(lacking)})" + (f"; this rank (rank {ck.rank}): {detail}" if detail else "")
    )
