"""One shard's chunks read into their storages, one call per chunk from the reader threads.

Where a chunk's bytes go, fastest path first:

* raw, with a fetch pool (every remote load): cut in file order into pieces that are the
  storages' own memory, fetched in segments by the fetch pool while this thread checks them
  (:mod:`tierckpt.restore._scatter`); from a store without a cheap scatter read, through
  this thread's buffer (one part-sized GET per segment);
* raw, inside one storage: read straight into it;
* raw, across storages, from a local file: one scatter read (``preadv``) into all of them;
* compressed, from a codec that decodes progressively: the stored bytes are fetched in pieces
  on a fetch pool while this thread decodes the prefix that has arrived
  (:mod:`tierckpt.restore._fetch`), straight into the storage, or into this thread's warm
  buffer and then copied into each storage when the chunk spans several;
* otherwise: read whole into this thread's warm buffer, verify, decode, copy.

Stored bytes are verified against the index's checksum before the chunk counts as read; a
mismatch raises :class:`~tierckpt.errors.CorruptChunk` naming the tier, file and chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, SupportsProgressiveDecode
from tierckpt.format import ChunkRecord
from tierckpt.restore._fetch import PIECE_BYTES, StreamedFetch, _started
from tierckpt.restore._layout import SpanLayout, ThreadBuffers, decode_chunk, span_view
from tierckpt.restore._prefault import prefault
from tierckpt.restore._repopulate import Repopulation
from tierckpt.restore._scatter import Boundaries, Joint, ScatterFetch
from tierckpt.verify import corrupt_chunk, read_verified, read_verified_pieces

__all__ = ["ChunkReader"]


class ChunkReader:
    """Reads chunk ``ci`` of one shard file into the load's storage spans (:meth:`read`)."""

    def __init__(
        self,
        backend: Backend,
        file: str,
        tier: str,
        where: str,
        codecs: Sequence[Codec],
        chunks: Sequence[ChunkRecord],
        spans: Sequence[torch.Tensor],
        span_offsets: Sequence[int],
        repop: Repopulation,
        fetch_pool: ThreadPoolExecutor | None,
        on_fetch_start: Callable[[], None] | None = None,
        *,
        sizes: Sequence[int] | None = None,
    ) -> None:
        self.backend = backend
        self.file = file
        self.tier = tier
        self.where = where
        self.codecs = codecs
        self.chunks = chunks
        self.spans = spans
        self.offsets = span_offsets
        self.repop = repop
        #: ``sizes``: the storages' sizes where ``spans`` is filled in while the first chunk
        #: is read (``read_shard`` allocates the rest meanwhile)
        self.layout = SpanLayout(
            span_offsets, list(sizes) if sizes is not None else [sp.numel() for sp in spans]
        )
        #: a local file is read straight into the storages (one preadv per chunk); from a
        #: remote store one ranged read per chunk beats one per tensor, so its bytes land in
        #: a buffer
        self.scatter = not backend.is_remote
        #: a scatter read that costs about one read (a local ``preadv``; ranged GETs spread
        #: over the pieces): every storage is then read straight into; otherwise each piece
        #: would be a request of its own, so the chunk goes via this thread's buffer
        self.cheap_scatter = type(backend).read_into_pieces is not Backend.read_into_pieces
        #: where compressed chunks are fetched in pieces while they decode and raw chunks in
        #: segments straight into the storages (None: whole, on the reader thread)
        self.fetch_pool = fetch_pool
        #: told when each fetch on the fetch pool begins (see ``FetchStarts``)
        self.on_fetch_start = on_fetch_start
        # buffers of one thread, reused from chunk to chunk: a fresh buffer per chunk would
        # pay the first touch of new pages every time (peak extra memory: a chunk or two per
        # thread)
        self.scratch = ThreadBuffers()
        self._views: list[memoryview | None] = [None] * len(spans)
        #: from a remote store with a cheap scatter read, the part around a boundary of two
        #: raw chunks is one GET for both (see ``Boundaries``)
        self.share = (
            backend.is_remote
            and self.cheap_scatter
            and fetch_pool is not None
            and self.layout.tiled
        )
        self.boundaries = Boundaries()

    def _shared_part(self, ci: int) -> int | None:
        """The file offset of the part that holds both chunk ``ci``'s end and chunk
        ``ci + 1``'s start (and any padding between them), fetched by one GET; None where
        each reads its own share. Only where the part is the last segment of one and the
        first of the other (never a part shared three ways)."""
        if not self.share or not 0 <= ci < len(self.chunks) - 1:
            return None
        a, b = self.chunks[ci], self.chunks[ci + 1]
        end = a.file_offset + a.stored_size
        part = b.file_offset - b.file_offset % PIECE_BYTES  # the part the next one starts in
        if (
            not self.codecs[a.codec].is_passthrough
            or not self.codecs[b.codec].is_passthrough
            or not a.file_offset <= part < end <= b.file_offset
            or part + PIECE_BYTES > b.file_offset + b.stored_size
        ):
            return None
        return part

    def _file_views(self, ci: int, lo: int, hi: int) -> list[memoryview]:
        """Where file bytes ``lo..hi`` of raw chunk ``ci`` land: the storages' memory, or a
        fresh buffer for gap bytes (not this thread's: the other chunk's reader hashes it)."""
        rec = self.chunks[ci]
        d = rec.logical_offset - rec.file_offset
        parts = self.layout.parts(lo + d, hi + d)
        assert parts is not None  # tiled: see ``share``
        return [
            self._dest(si, a, b) if si >= 0 else memoryview(bytearray(b - a)) for si, a, b in parts
        ]

    def _joint(self, ci: int, part: int) -> Joint:
        """The joint part of chunks ``ci`` and ``ci + 1`` at file offset ``part``, submitted
        by whichever of their readers asks first."""
        a, b = self.chunks[ci], self.chunks[ci + 1]
        end = a.file_offset + a.stored_size
        pool = self.fetch_pool
        assert pool is not None

        def make() -> Joint:
            left = self._file_views(ci, part, end)
            right = self._file_views(ci + 1, b.file_offset, part + PIECE_BYTES)
            # the padding between the two chunks: read with them, checked by neither, dropped
            pad = [memoryview(bytearray(b.file_offset - end))] if b.file_offset > end else []
            read = _started(self.on_fetch_start, self.backend.read_into_pieces)
            future = pool.submit(read, self.file, part, [*left, *pad, *right])
            return Joint(part, left, right, future)

        return self.boundaries.claim(part, make)

    def _prefault(self, parts: list[tuple[int, int, int]]) -> None:
        """Map the storages' pages these parts fill in bulk (see ``_prefault``)."""
        prefault(
            (self.spans[si].data_ptr() + a - self.offsets[si], b - a)
            for si, a, b in parts
            if si >= 0
        )

    def _dest(self, si: int, a: int, b: int) -> memoryview:
        # one memoryview per storage, sliced per piece: a chunk of many small tensors costs a
        # slice each, not a tensor slice and a numpy view each (threads may race to make the
        # same view: either is right)
        whole = self._views[si]
        if whole is None:
            whole = self._views[si] = span_view(self.spans[si], 0, self.spans[si].numel())
        return whole[a - self.offsets[si] : b - self.offsets[si]]

    def read(self, ci: int) -> int:
        """Read, verify and decode chunk ``ci`` into the spans; returns its stored size."""
        rec = self.chunks[ci]
        codec = self.codecs[rec.codec]
        lo, hi = rec.logical_offset, rec.logical_offset + rec.raw_size
        parts = self.layout.parts(lo, hi)
        single = parts is not None and len(parts) == 1 and parts[0][0] >= 0
        if codec.is_passthrough and parts is not None and self.fetch_pool is not None:
            self._read_raw_pieces(rec, ci, parts)
            return rec.stored_size
        if parts is not None and (codec.is_passthrough or single):
            self._prefault(parts)
        if codec.is_passthrough and single:
            assert parts is not None
            dest = self._dest(*parts[0])  # read straight into the one storage it covers
            self._read(rec, ci, dest)
            self.repop.write(rec.file_offset, dest)
            return rec.stored_size
        if codec.is_passthrough and parts is not None and self.scatter:
            # across spans, raw: scatter the read into every storage it touches
            # a gap: bytes no storage holds, read, checked, dropped; each its own part of one
            # buffer (one buffer for every gap made them overwrite each other before the
            # checksum saw them: a chunk with two gaps of different bytes never verified)
            gap = sum(b - a for si, a, b in parts if si < 0)
            gaps = self.scratch.get("gap", gap) if gap else memoryview(b"")
            views, at = [], 0
            for si, a, b in parts:
                if si >= 0:
                    views.append(self._dest(si, a, b))
                else:
                    views.append(gaps[at : at + b - a])
                    at += b - a
            read_verified_pieces(
                self.backend, self.file, rec, ci, views, tier=self.tier, where=self.where
            )
            pos = rec.file_offset
            for v in views:
                self.repop.write(pos, v)
                pos += len(v)
            return rec.stored_size
        if single and not codec.is_passthrough:
            assert parts is not None
            self._read_decode(rec, ci, codec, self._dest(*parts[0]))
            return rec.stored_size
        # across spans via this thread's (warm) buffer, then one copy into each storage
        whole = self.scratch.get("decoded", rec.raw_size)
        if codec.is_passthrough:
            self._read(rec, ci, whole)
            self.repop.write(rec.file_offset, whole)
        else:
            self._read_decode(rec, ci, codec, whole)
        src = torch.frombuffer(whole, dtype=torch.uint8) if len(whole) else None
        for si, a, b in parts if parts is not None else self.layout.overlaps(lo, hi):
            if si >= 0 and src is not None:
                off = self.offsets[si]
                self.spans[si][a - off : b - off].copy_(src[a - lo : b - lo])
        return rec.stored_size

    def _read_raw_pieces(
        self, rec: ChunkRecord, ci: int, parts: list[tuple[int, int, int]]
    ) -> None:
        """Raw chunk ``ci`` fetched by the fetch pool straight into the storages it covers:
        its pieces in file order are the storages' memory, or a slice of this thread's buffer
        for gap bytes and (from a remote store) runs of small tensors, copied out once the
        chunk's checksum matched."""
        assert self.fetch_pool is not None
        lo, hi = rec.file_offset, rec.file_offset + rec.stored_size
        head = tail = None
        head_part, tail_part = self._shared_part(ci - 1), self._shared_part(ci)
        if head_part is not None:  # its first bytes come with the end of the chunk before
            j = self._joint(ci - 1, head_part)
            head, lo = (j.future, j.right), head_part + PIECE_BYTES
        if tail_part is not None:  # its last bytes with the start of the next chunk
            j = self._joint(ci, tail_part)
            tail, hi = (j.future, j.left), tail_part
        whole = parts
        if head is not None or tail is not None:
            d = rec.logical_offset - rec.file_offset
            mid = self.layout.parts(lo + d, hi + d)
            assert mid is not None
            parts = mid
        pieces: list[memoryview] = []
        copies: list[tuple[int, int, int, int]] = []  # (span, start, end, at in the buffer)
        # where each piece would be a request of its own, the chunk goes through the buffer
        # whole: one part-sized GET per segment
        buffered = [si < 0 or not self.cheap_scatter for si, _a, _b in parts]
        need = sum(b - a for (_si, a, b), buf in zip(parts, buffered, strict=True) if buf)
        buf = self.scratch.get("pieces", need) if need else memoryview(b"")
        at = run = 0  # the buffer's next free byte; where its current run began
        for (si, a, b), in_buf in zip(parts, buffered, strict=True):
            if not in_buf:
                if at > run:
                    pieces.append(buf[run:at])
                    run = at
                pieces.append(self._dest(si, a, b))
                continue
            if si >= 0:
                copies.append((si, a, b, at))
            at += b - a
        if at > run:
            pieces.append(buf[run:at])
        fetch = ScatterFetch(
            self.backend,
            self.file,
            lo,
            pieces,
            self.fetch_pool,
            PIECE_BYTES,
            self.on_fetch_start,
            head=head,
            tail=tail,
        )
        self._prefault(whole)  # while the first segments are fetched (never overwrites them)
        try:
            digest = fetch.finish()
        finally:
            fetch.close()
        if digest != rec.checksum:
            corrupt_chunk(self.file, rec, ci, tier=self.tier, where=self.where)
        for si, a, b, at in copies:
            self._dest(si, a, b)[:] = buf[at : at + b - a]
        pos = rec.file_offset
        for v in [*(head[1] if head else ()), *pieces, *(tail[1] if tail else ())]:
            self.repop.write(pos, v)
            pos += len(v)

    def _read(self, rec: ChunkRecord, ci: int, into: memoryview) -> None:
        read_verified(self.backend, self.file, rec, ci, into, tier=self.tier, where=self.where)

    def _read_decode(self, rec: ChunkRecord, ci: int, codec: Codec, out: memoryview) -> None:
        """Fetch chunk ``ci``'s stored bytes into this thread's buffer, verify, decode into
        ``out``: overlapped when the codec decodes progressively, else one after the other."""
        stored = self.scratch.get("stored", rec.stored_size)
        if self.fetch_pool is None or not isinstance(codec, SupportsProgressiveDecode):
            self._read(rec, ci, stored)
            decode_chunk(codec, stored, out, ci, self.tier, self.where, self.file)
        else:
            fetch = StreamedFetch(
                self.backend,
                self.file,
                rec.file_offset,
                stored,
                self.fetch_pool,
                on_start=self.on_fetch_start,
            )
            try:
                decode_chunk(codec, stored, out, ci, self.tier, self.where, self.file, fetch.ready)
                digest = fetch.finish()
            except BaseException:
                # bytes that fail their checksum say more than the decode error they caused
                try:
                    digest = fetch.finish()
                except BaseException:
                    digest = rec.checksum
                if digest != rec.checksum:
                    corrupt_chunk(self.file, rec, ci, tier=self.tier, where=self.where)
                raise
            finally:
                fetch.close()
            if digest != rec.checksum:
                corrupt_chunk(self.file, rec, ci, tier=self.tier, where=self.where)
        self.repop.write(rec.file_offset, stored)
