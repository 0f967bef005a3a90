"""Ranged, verified reads of selected tensors from one rank's DCP shard on one tier: the
chunks they lie in, read once each, straight into the load's destination tensors where they
can be (see :class:`_ShardFile`)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

import torch
import xxhash

from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import CorruptChunk, FormatError
from tierckpt.format import ChunkRecord, ShardRef, checksum
from tierckpt.restore import TensorRecord, parse_tensor_entry, read_index
from tierckpt.tree import decode_tree


class _ShardFile:
    """Ranged, verified reads of selected tensors from one rank's shard on one tier."""

    def __init__(self, backend: Backend, tier: str, ref: ShardRef) -> None:
        self.backend = backend
        self.tier = tier
        self.ref = ref
        self.where = f"tier {tier!r} {backend.url}/{ref.file}"
        index, _, _ = read_index(backend, ref, tier)
        self.codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
        self.chunks: list[ChunkRecord] = index["chunks"]
        self.chunk_starts = [c.logical_offset for c in self.chunks]
        self.storages: list[list[int]] = index["storages"]
        self._storage_sizes: list[int] | None = None
        self.tensors: list[Any] = index["tensors"]
        tree = decode_tree(index.get("tree"), lambda i: i)
        if not isinstance(tree, dict) or not all(
            isinstance(k, str) and type(v) is int for k, v in tree.items()
        ):
            raise FormatError(f"{self.where}: not a DCP shard (its tree is not a key table)")
        self.keys: dict[str, int] = tree

    def fetch(
        self, keys: Iterable[str], targets: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The tensors of ``keys``, verified. Each chunk is read once, straight into a fresh
        buffer (decoded into it when compressed); a tensor that lies inside one chunk is a
        view of it when the requested tensors use at least half of that chunk (no copy),
        otherwise its bytes are copied into a buffer of its own so that a few small items do
        not keep large chunks alive.

        ``targets``: where the caller wants whole stored tensors (DCP's destination tensors).
        One of the stored tensor's dtype, shape and a contiguous layout is filled in place
        (the returned value is that target): a raw chunk all of whose requested tensors are
        such targets is read straight into them (no buffer, no copy; checksummed as read)."""
        out: dict[str, torch.Tensor] = {}
        direct: dict[int, torch.Tensor] = {}  # wanted index -> the target's bytes
        # (key, record, logical lo, logical hi) per needed tensor with elements
        wanted: list[tuple[str, TensorRecord, int, int]] = []
        for key in keys:
            if key in out:
                continue
            ti = self.keys.get(key)
            if ti is None or not 0 <= ti < len(self.tensors):
                raise FormatError(f"{self.where}: no item {key!r} in this shard")
            if self._storage_sizes is None:
                self._storage_sizes = [n for _lo, n in self.storages]
            rec = parse_tensor_entry(self.tensors[ti], ti, self.where, self._storage_sizes)
            if rec.storage == -1:
                out[key] = torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype)
                continue
            lo = self.storages[rec.storage][0] + rec.offset
            out[key] = torch.empty(0)  # placeholder: keeps keys unique; filled below
            target = targets.get(key) if targets is not None else None
            if target is not None and _fits(target, rec):
                direct[len(wanted)] = _byte_view(target)
            wanted.append((key, rec, lo, lo + rec.extent))
        _drop_overlapping(direct, wanted)
        for wi, view in direct.items():
            assert view.numel() == wanted[wi][3] - wanted[wi][2]
            out[wanted[wi][0]] = targets[wanted[wi][0]]  # type: ignore[index]
        # the chunks each tensor needs, and the requested bytes in each chunk
        pieces: dict[int, list[int]] = {}
        used: dict[int, int] = {}
        for wi, (_key, _rec, lo, hi) in enumerate(wanted):
            covered = lo
            ci = max(bisect.bisect_right(self.chunk_starts, lo) - 1, 0)
            while covered < hi and ci < len(self.chunks):
                c = self.chunks[ci]
                c_lo, c_hi = c.logical_offset, c.logical_offset + c.raw_size
                if c_lo > covered:
                    break
                if c_hi > covered:
                    pieces.setdefault(ci, []).append(wi)
                    used[ci] = used.get(ci, 0) + min(hi, c_hi) - covered
                    covered = min(hi, c_hi)
                ci += 1
            if covered < hi:
                raise FormatError(f"{self.where}: bytes {covered}..{hi} are in no chunk")
        bufs: dict[int, torch.Tensor] = dict(direct)  # tensors assembled from copies
        for ci in sorted(pieces):
            c = self.chunks[ci]
            c_lo, c_hi = c.logical_offset, c.logical_offset + c.raw_size
            if all(wi in direct for wi in pieces[ci]) and self._scatter(
                ci, pieces[ci], direct, wanted
            ):
                continue  # read straight into the targets
            raw = self._chunk(ci)
            share = 2 * used[ci] >= c.raw_size
            for wi in pieces[ci]:
                key, rec, lo, hi = wanted[wi]
                item = rec.dtype.itemsize
                in_chunk = c_lo <= lo and hi <= c_hi and (lo - c_lo) % item == 0
                if wi not in direct and share and in_chunk:
                    t = torch.empty(0, dtype=rec.dtype)
                    t.set_(raw.untyped_storage(), (lo - c_lo) // item, rec.shape, rec.stride)
                    out[key] = t
                    continue
                buf = bufs.get(wi)
                if buf is None:
                    buf = bufs[wi] = torch.empty(hi - lo, dtype=torch.uint8)
                a, b = max(lo, c_lo), min(hi, c_hi)
                buf[a - lo : b - lo].copy_(raw[a - c_lo : b - c_lo])
            del raw
        for wi, buf in bufs.items():
            key, rec, _lo, _hi = wanted[wi]
            if wi in direct:
                continue  # the target itself, filled
            t = torch.empty(0, dtype=rec.dtype)
            t.set_(buf.untyped_storage(), 0, rec.shape, rec.stride)
            out[key] = t
        return out

    def _scatter(
        self,
        ci: int,
        wis: list[int],
        direct: dict[int, torch.Tensor],
        wanted: list[tuple[str, TensorRecord, int, int]],
    ) -> bool:
        """Read raw chunk ``ci`` straight into the targets' bytes it holds (the rest of the
        chunk into scratch buffers) and check its checksum over all of it; False (nothing
        read) when the chunk is stored compressed."""
        rec = self.chunks[ci]
        if not (self.codecs[rec.codec].is_passthrough and rec.stored_size == rec.raw_size):
            return False
        c_lo, c_hi = rec.logical_offset, rec.logical_offset + rec.raw_size
        outs: list[memoryview] = []
        pos = c_lo
        for wi in sorted(wis, key=lambda w: wanted[w][2]):
            _key, _rec, lo, hi = wanted[wi]
            a, b = max(lo, c_lo), min(hi, c_hi)
            if a > pos:
                outs.append(memoryview(bytearray(a - pos)))
            outs.append(memoryview(direct[wi][a - lo : b - lo].numpy()))  # type: ignore[arg-type]
            pos = b
        if pos < c_hi:
            outs.append(memoryview(bytearray(c_hi - pos)))
        self.backend.read_into_pieces(self.ref.file, rec.file_offset, outs)
        h = xxhash.xxh3_64()
        for o in outs:
            h.update(o)
        if h.hexdigest() != rec.checksum:
            raise CorruptChunk(
                f"{self.where}: chunk {ci} (file bytes {rec.file_offset}..+{rec.stored_size}) "
                "does not match its checksum",
                tier=self.tier,
                file=self.ref.file,
                chunk=ci,
            )
        return True

    def _chunk(self, ci: int) -> torch.Tensor:
        """Chunk ``ci``'s raw bytes, read once into a fresh buffer and verified."""
        rec = self.chunks[ci]
        codec = self.codecs[rec.codec]
        out = torch.empty(rec.raw_size, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        direct = codec.is_passthrough and rec.stored_size == rec.raw_size
        stored = view if direct else memoryview(bytearray(rec.stored_size))
        self.backend.read_into(self.ref.file, rec.file_offset, stored)
        if checksum(stored) != rec.checksum:
            raise CorruptChunk(
                f"{self.where}: chunk {ci} (file bytes {rec.file_offset}..+{rec.stored_size}) "
                "does not match its checksum",
                tier=self.tier,
                file=self.ref.file,
                chunk=ci,
            )
        if not direct:
            try:
                codec.decode(stored, view)
            except CorruptChunk as exc:
                raise CorruptChunk(
                    f"{self.where}: chunk {ci}: {exc}", tier=self.tier, file=self.ref.file, chunk=ci
                ) from exc
        return out


def _fits(target: torch.Tensor, rec: TensorRecord) -> bool:
    """Whether the stored tensor ``rec`` can be read straight into ``target``: same dtype
    and shape, both laid out contiguously, ``target`` in host memory."""
    if target.device.type != "cpu" or target.dtype != rec.dtype or list(target.shape) != rec.shape:
        return False
    if not target.is_contiguous() or target.numel() == 0:
        return False
    acc = 1
    for n, st in zip(reversed(rec.shape), reversed(rec.stride), strict=True):
        if n != 1 and st != acc:
            return False
        acc *= n
    return True


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 tensor over the same memory (``t`` is contiguous)."""
    out = torch.empty(0, dtype=torch.uint8)
    nbytes = t.numel() * t.element_size()
    out.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (nbytes,), (1,))
    return out


def _drop_overlapping(
    direct: dict[int, torch.Tensor], wanted: list[tuple[str, TensorRecord, int, int]]
) -> None:
    """Targets whose stored bytes overlap another requested tensor's (views of one storage)
    are filled by copy instead: a scatter read gives each byte one destination."""
    reach, owner = -1, -1
    for lo, hi, wi in sorted((lo, hi, wi) for wi, (_k, _r, lo, hi) in enumerate(wanted)):
        if lo < reach:
            direct.pop(wi, None)
            direct.pop(owner, None)
        if hi > reach:
            reach, owner = hi, wi
