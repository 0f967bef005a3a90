"""The commit on a tier only its own process can read (RAM, or a node-local disk named in
``TIERCKPT_PRIVATE_TIERS``): records and the manifest travel through the process group's
key-value store, and every rank writes the same manifest onto its own copy."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

from tierckpt import config
from tierckpt.distributed._knobs import get_knobs
from tierckpt.distributed._records import (
    RankRecord,
    decode_record,
    encode_record,
)
from tierckpt.distributed._shared import _manifest, _put_manifest
from tierckpt.errors import CommitTimeout, FormatError, RankFailed, TierCkptError
from tierckpt.format import decode_manifest, encode_manifest

if TYPE_CHECKING:
    from tierckpt.pipeline import SaveJob, Tier

__all__ = ["is_private_tier"]


def is_private_tier(tier: Tier) -> bool:
    """A tier other ranks cannot read: not durable (per-process RAM), node-local (node RAM),
    or named in ``TIERCKPT_PRIVATE_TIERS`` (comma-separated tier names, e.g. node-local NVMe)."""
    b = tier.backend
    return (not b.is_durable) or b.is_node_local or tier.name in config.private_tiers()


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


def _publish_private(tier: Tier, job: SaveJob, rec: RankRecord) -> Any:
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


def _commit_private(tier: Tier, job: SaveJob, st: Any) -> None:
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
