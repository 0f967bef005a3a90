"""A retention pass that deletes one checkpoint among many lists that checkpoint's folders,
not every object of the tier: with ``keep_every_n_steps`` keeping about 1,000 checkpoints,
each such pass listed all their data files (local saves 4-6x slower over 2,000 saves, many
pages of LIST requests per save on S3). What a scoped pass cannot see (files of an earlier
attempt under a ``<hh>/`` its manifest does not name) goes at the next full sweep."""

from __future__ import annotations

import secrets
import time

import pytest

from tierckpt.backends.memory import MemoryBackend
from tierckpt.format import (
    CheckpointId,
    Manifest,
    ShardRef,
    encode_manifest,
    manifest_name,
    shard_name,
    step_prefix,
)
from tierckpt.layout import hash_prefix, record_name
from tierckpt.retention import Retention, gc_tier

WORLD, PREFIXES = 8, 256
RULE = Retention(keep_last=3, keep_every_n_steps=2)


class _Counting(MemoryBackend):
    """Records every ``list`` (its prefix and how many names it returned)."""

    def __init__(self) -> None:
        super().__init__(f"scoped-{secrets.token_hex(4)}")
        self.lists: list[tuple[str, int]] = []

    def list(self, prefix: str = "") -> list[str]:
        out = super().list(prefix)
        self.lists.append((prefix, len(out)))
        return out

    def everything(self) -> set[str]:
        return set(super().list(""))


def _record(step: int, rank: int, prefixes: int = PREFIXES, attempt: str = "a1") -> str:
    return record_name(
        step_prefix(step),
        rank,
        prefixes,
        size=4096,
        index_checksum="0" * 16,
        raw_bytes=1024,
        stored_bytes=1024,
        codec="raw",
        attempt=attempt,
    )


def _commit(b: MemoryBackend, step: int) -> None:
    """A committed multi-rank checkpoint in format v2: each rank's shard file and completion
    record under its ``<hh>/``, DCP-style metadata in ``steps/<step>/``, then the manifest."""
    shards = []
    for r in range(WORLD):
        name = shard_name(step, r, prefixes=PREFIXES)
        b.put_atomic(name, b"x" * 64)
        b.put_atomic(_record(step, r), b"{}")
        shards.append(ShardRef(r, name, 4096, "0" * 16))
    b.put_atomic(f"{step_prefix(step)}dcp-metadata.json.zst", b"meta")
    m = Manifest(step, WORLD, tuple(shards), time.time(), "test")
    b.put_atomic(manifest_name(step), encode_manifest(m))


def _many(b: _Counting) -> None:
    """100 checkpoints kept by ``keep_every_n_steps=2`` and the newest, 201; the first pass
    of this process sweeps (a listing of every object), the second removes nothing."""
    for s in [*range(2, 201, 2), 201]:
        _commit(b, s)
    assert gc_tier(b, RULE, sweep=None) == []
    for s in (202, 203):
        _commit(b, s)
    assert gc_tier(b, RULE, sweep=None) == []


def test_a_pass_that_deletes_one_of_many_lists_only_that_checkpoint() -> None:
    b = _Counting()
    _many(b)
    _commit(b, 204)
    before = b.everything()
    b.lists.clear()
    assert gc_tier(b, RULE, sweep=None) == [CheckpointId(201)]  # odd, past the 3 newest
    prefixes = [p for p, _ in b.lists]
    # before: a listing of every object (1,800 names: each data file of the 103 kept)
    assert "" not in prefixes, b.lists
    for p in prefixes:
        assert p in ("manifests/", "pins/") or p.endswith(step_prefix(201)), b.lists
    assert sum(n for _, n in b.lists) <= 104 + 2 * WORLD + 1, b.lists
    # all of step 201 went (its folder and every <hh>/ of its ranks), nothing else did
    gone = {n for n in before if step_prefix(201) in n or n == manifest_name(201)}
    assert len(gone) == 2 * WORLD + 2
    assert b.everything() == before - gone


def test_a_manifest_that_cannot_be_read_is_deleted_from_a_listing_of_everything() -> None:
    b = _Counting()
    _many(b)
    _commit(b, 204)
    b.put_atomic(manifest_name(201), b"not a manifest", overwrite=True)
    before = b.everything()
    b.lists.clear()
    assert gc_tier(b, RULE, sweep=None) == [CheckpointId(201)]
    assert "" in [p for p, _ in b.lists]  # the manifest cannot tell its folders
    gone = {n for n in before if step_prefix(201) in n or n == manifest_name(201)}
    assert b.everything() == before - gone


def test_what_scoped_passes_cannot_see_goes_at_the_next_full_sweep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("tierckpt.retention_scan.FULL_SWEEP_EVERY", 2)
    b = _Counting()
    _many(b)
    # an earlier attempt of step 201 ran with another prefixes count and world size: its
    # files are under <hh>/ folders the committed manifest does not name
    stray = [
        shard_name(201, WORLD + 1, prefixes=4),
        _record(201, 3, prefixes=4, attempt="a0"),
    ]
    used = {hash_prefix(r, PREFIXES) for r in range(WORLD)}
    assert not {n[:2] for n in stray} & used
    for n in stray:
        b.put_atomic(n, b"old")
    _commit(b, 204)
    before = b.everything()
    assert gc_tier(b, RULE, sweep=None) == [CheckpointId(201)]  # scoped pass 1
    assert set(stray) <= b.everything()  # not in the folders its manifest names
    _commit(b, 205)
    _commit(b, 206)
    assert gc_tier(b, RULE, sweep=None) == [CheckpointId(203)]  # scoped pass 2
    _commit(b, 207)
    b.lists.clear()
    # a full sweep: step 201's leftovers, data without a manifest, go
    assert gc_tier(b, RULE, sweep=None) == [CheckpointId(201)]
    assert "" in [p for p, _ in b.lists]
    assert not set(stray) & b.everything()
    kept = {*range(2, 207, 2), 205, 207}
    assert {n for n in b.everything() if n.startswith("manifests/")} == {
        manifest_name(s) for s in kept
    }
    for s in kept - {205, 206, 207}:  # every file of a kept checkpoint is still there
        assert {n for n in before if step_prefix(s) in n} <= b.everything(), s
