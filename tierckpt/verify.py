"""Reading stored chunk bytes back and checking them against the index's checksum.

Both paths use it: the load path (:mod:`tierckpt.restore`) before decoding a chunk, and the
write path (:mod:`tierckpt.pipeline`) when a tier is filled from the bytes another tier
already stores, so bytes that rotted on the source are never copied on as good.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import xxhash

from tierckpt.backends.base import Backend
from tierckpt.errors import CorruptChunk
from tierckpt.format import ChunkRecord, checksum

__all__ = ["corrupt_chunk", "read_verified", "read_verified_pieces"]


def read_verified(
    backend: Backend,
    file: str,
    rec: ChunkRecord,
    ci: int,
    into: memoryview,
    *,
    tier: str,
    where: str,
) -> None:
    """Read chunk ``ci``'s stored bytes into ``into`` and check them against its checksum."""
    backend.read_into(file, rec.file_offset, into)
    if checksum(into) != rec.checksum:
        corrupt_chunk(file, rec, ci, tier=tier, where=where)


def read_verified_pieces(
    backend: Backend,
    file: str,
    rec: ChunkRecord,
    ci: int,
    pieces: Sequence[memoryview],
    *,
    tier: str,
    where: str,
) -> None:
    """:func:`read_verified` scattered: chunk ``ci``'s stored bytes fill ``pieces`` in order
    (their lengths add up to the stored size) and their running checksum must match."""
    backend.read_into_pieces(file, rec.file_offset, pieces)
    h = xxhash.xxh3_64()  # the same digest as format.checksum over the joined bytes
    for p in pieces:
        h.update(p)
    if h.hexdigest() != rec.checksum:
        corrupt_chunk(file, rec, ci, tier=tier, where=where)


def corrupt_chunk(file: str, rec: ChunkRecord, ci: int, *, tier: str, where: str) -> NoReturn:
    """Raise the :class:`CorruptChunk` of chunk ``ci`` whose stored bytes fail their checksum."""
    raise CorruptChunk(
        f"{where}: chunk {ci} (file bytes {rec.file_offset}..+{rec.stored_size}) does not "
        "match its checksum",
        tier=tier,
        file=file,
        chunk=ci,
    )
