"""Reading a shard's manifest and index, and validating the index's tensor table.

Everything read here comes from storage and may be hostile: sizes are checked before any
allocation, checksums before any decode, and every tensor record against the storage table.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.backends.base import Backend
from tierckpt.errors import CorruptCheckpoint, FormatError
from tierckpt.format import (
    FOOTER_SIZE,
    HEAD_PROBE_BYTES,
    MAX_MANIFEST_BYTES,
    Footer,
    Manifest,
    ShardRef,
    check_index_head,
    checksum,
    decode_index,
    decode_manifest,
    manifest_name,
)
from tierckpt.limits import MAX_DIMS
from tierckpt.tree import dtype_from_name

__all__ = [
    "EarlyTail",
    "TensorRecord",
    "as_parameters",
    "parse_tensor_entry",
    "read_index",
    "read_manifest",
    "rebuild_tensor",
    "rebuild_tensors",
    "start_tail",
]


def read_manifest(backend: Backend, step: int, tier: str, *, timeline: int = 0) -> Manifest:
    """The manifest of ``step`` on ``timeline``, validated; it must say it is that one's."""
    name = manifest_name(step, timeline=timeline)
    where = f"tier {tier!r} {backend.url}/{name}"
    # one GET where the store can (its size checked before its body is read: a hostile
    # manifest may be huge), else a HEAD and a GET
    size, blob = backend.get_bounded(name, MAX_MANIFEST_BYTES)
    if blob is None:
        raise FormatError(f"{where}: manifest is {size} bytes, more than {MAX_MANIFEST_BYTES}")
    manifest = decode_manifest(blob, where=where)
    if manifest.step != step:
        raise FormatError(f"{where}: the manifest is step {manifest.step}'s, not step {step}'s")
    if manifest.timeline != timeline:
        raise FormatError(
            f"{where}: the manifest is timeline {manifest.timeline}'s, not timeline {timeline}'s"
        )
    return manifest


#: bytes of a shard file's end read at once before its footer says the index's length:
#: the footer and an index of a few thousand tensors (~100 bytes each) in one request; a
#: larger index seen on this host raises it (the next load reads that much)
TAIL_READ_BYTES = 256 << 10
#: the most a learned guess reads at once
MAX_TAIL_READ_BYTES = 8 << 20
_tail_guess = TAIL_READ_BYTES


@dataclass(frozen=True, slots=True)
class EarlyTail:
    """A read of a shard file's tail started before the manifest that names the file was read
    (the name guessed from the step, the rank and the tier's layout), so that the two GETs
    overlap; :func:`read_index` uses it where the manifest names that file, the size it saw
    is the manifest's and it asked for as much as the manifest's size makes worth reading;
    else it drops it and reads the tail itself."""

    name: str
    length: int  # bytes of the file's end asked for
    future: Future[tuple[int, Any]]

    def take(self, ref: ShardRef, want: int) -> tuple[int, Any] | None:
        """The read's ``(size, tail)`` where it is of the file ``ref`` names, with its size,
        and brought ``want`` bytes or all of the file; None where not (the caller reads the
        tail itself). Where it failed, its error is raised: it is the named file's, as a
        second read of it would raise after as many tries (a store that fails or stalls is
        not waited for twice)."""
        if self.name != ref.file or self.length < min(want, ref.size):
            return None
        size, tail = self.future.result()
        return (size, tail) if size == ref.size and len(tail) <= size else None


def start_tail(backend: Backend, name: str, pool: ThreadPoolExecutor) -> EarlyTail:
    """Start reading the tail of shard file ``name`` on ``pool`` (see :class:`EarlyTail`).
    Its size unknown, it asks for the first guess only (footer and an index of a few thousand
    tensors): a larger guess learned from a large index earlier would read a small file whole
    (``read_index`` bounds its guess by the file's size); where the learned guess is larger
    and the file large enough, the early read is dropped and the tail read as before."""
    length = min(_tail_guess, TAIL_READ_BYTES) + FOOTER_SIZE
    return EarlyTail(name, length, pool.submit(backend.read_tail, name, length))


def read_index(
    backend: Backend, ref: ShardRef, tier: str, *, early: EarlyTail | None = None
) -> tuple[dict[str, Any], bytes | bytearray, bytes]:
    """The shard file's index, checked against its footer and the manifest's record (its
    size and index checksum); also the index and footer bytes (repopulated copies get them).

    One read of the file's tail brings its size, footer and (usually) the whole index:
    through obstore one suffix-range GET where it used to take a HEAD and three GETs."""
    global _tail_guess
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    # a round trip is worth saving only on a remote store; a local file's footer and index
    # are two reads of exactly what is needed. The learned guess is bounded by the file's
    # size (a large index seen once must not make every small file be read whole)
    remote = backend.is_remote
    guess = min(_tail_guess, max(TAIL_READ_BYTES, ref.size >> 4)) if remote else 0
    # never more than the manifest says the file holds (a suffix past the start of the
    # object is answered differently by different stores)
    want = max(FOOTER_SIZE, min(ref.size, guess + FOOTER_SIZE))
    got = early.take(ref, want) if early is not None and remote else None
    if got is None:
        got = backend.read_tail(ref.file, want)
    size, tail = got
    if size != ref.size:
        raise CorruptCheckpoint(
            f"{where}: file is {size} bytes, the manifest says {ref.size} (truncated or replaced)"
        )
    tail = memoryview(tail).cast("B")
    footer_bytes = bytes(tail[len(tail) - FOOTER_SIZE :])
    footer = Footer.decode(footer_bytes, file_size=size, where=where)
    if footer.index_checksum != ref.index_checksum:
        raise CorruptCheckpoint(f"{where}: index checksum differs from the manifest's")
    have = len(tail) - FOOTER_SIZE  # index bytes already read (the end of the index)
    n = footer.index_length
    if n <= have:
        blob: bytes | bytearray = bytes(tail[have - n : have])
        if n > HEAD_PROBE_BYTES:
            check_index_head(blob[:512], index_length=n, file_size=size, where=where)
    else:
        if n > HEAD_PROBE_BYTES:  # a large index: its counts first
            head = backend.read(ref.file, footer.index_offset, 512)
            check_index_head(head, index_length=n, file_size=size, where=where)
        start = backend.read(ref.file, footer.index_offset, n - have)
        blob = bytearray(memoryview(start).cast("B"))
        blob += tail[:have]
    if checksum(blob) != footer.index_checksum:
        raise CorruptCheckpoint(f"{where}: index bytes do not match their checksum")
    if remote and n > have:  # a checked index larger than the guess: read it in one go next
        _tail_guess = min(MAX_TAIL_READ_BYTES, max(_tail_guess, n + (n >> 3)))
    return decode_index(blob, file_size=size, where=where), blob, footer_bytes


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One validated entry of an index's tensor table."""

    storage: int  # -1: no elements, no storage
    offset: int  # bytes into the storage span
    dtype: torch.dtype
    shape: list[int]
    stride: list[int]
    extent: int  # bytes from ``offset`` to the end of the last element (0 if empty)


def parse_tensor_entry(
    entry: Any, i: int, where: str, storage_sizes: Sequence[int]
) -> TensorRecord:
    """Validate tensor ``i``'s record against the storage table; ``FormatError`` if hostile."""
    if type(entry) is not list or len(entry) != 6:
        raise FormatError(f"{where}: tensor {i} record malformed")
    sid, off, dtype_s, shape, stride, _device = entry
    dtype = dtype_from_name(dtype_s)
    if (
        type(shape) is not list
        or type(stride) is not list
        or len(shape) != len(stride)
        or len(shape) > MAX_DIMS
    ):
        raise FormatError(f"{where}: tensor {i} has a malformed shape/stride")
    dims = shape + stride
    # a JSON int is exactly an int (never a bool: ``type`` is checked, not isinstance); one
    # set of types, min and max cost a few calls where a test per element costs one each
    if dims and (set(map(type, dims)) != _INT_ONLY or min(dims) < 0 or max(dims) >= 1 << 48):
        raise FormatError(f"{where}: tensor {i} has a malformed shape/stride")
    numel = math.prod(shape)
    if numel >= 1 << 62:  # zero strides can declare more elements than torch can count
        raise FormatError(f"{where}: tensor {i} declares {numel} elements")
    if sid == -1 and type(sid) is int:
        if numel != 0:
            raise FormatError(f"{where}: tensor {i} has elements but no storage")
        return TensorRecord(-1, 0, dtype, shape, stride, 0)
    if type(sid) is not int or not 0 <= sid < len(storage_sizes) or type(off) is not int or off < 0:
        raise FormatError(f"{where}: tensor {i} points outside the storage table")
    item = dtype.itemsize
    extent = (sum(map(_last, shape, stride)) + 1) * item
    if numel == 0 or off % item or off + extent > storage_sizes[sid]:
        raise FormatError(f"{where}: tensor {i} does not fit its storage")
    return TensorRecord(sid, off, dtype, shape, stride, extent)


_INT_ONLY = {int}


def _last(size: int, stride: int) -> int:
    """Elements from the first to the last along one dimension (``stride * (size - 1)``)."""
    return (size - 1) * stride


def as_parameters(tensors: list[torch.Tensor], index: dict[str, Any], where: str) -> None:
    """Make the tensors the index lists as ``nn.Parameter`` again, with their
    ``requires_grad`` (the index field ``parameters``: ``2 * tensor + requires_grad`` per
    parameter, as :func:`tierckpt.plan.collect_state` records them), and the plain tensors it
    lists under ``requires_grad`` require grad again, so a load gives back what ``torch.load``
    gives back. An index without the fields holds neither."""
    seen: set[int] = set()
    for field_name, flags in (("parameters", 2), ("requires_grad", 1)):
        table = index.get(field_name)
        if table is None:
            continue
        if not isinstance(table, list) or len(table) > len(tensors):
            raise FormatError(f"{where}: index field {field_name!r} malformed")
        for v in table:
            if type(v) is not int or not 0 <= v < flags * len(tensors) or v // flags in seen:
                raise FormatError(f"{where}: index field {field_name!r} names no tensor ({v!r})")
            i, grad = divmod(v, flags) if flags == 2 else (v, 1)
            seen.add(i)
            t = tensors[i]
            if grad and not (t.is_floating_point() or t.is_complex()):
                raise FormatError(
                    f"{where}: index field {field_name!r}: tensor {i} of {t.dtype} cannot "
                    "require grad"
                )
            if flags == 2:
                tensors[i] = torch.nn.Parameter(t, requires_grad=bool(grad))
            else:
                tensors[i] = t.detach().requires_grad_(True)


def rebuild_tensor(
    entry: Any, spans: list[torch.Tensor], sizes: Sequence[int], i: int, where: str
) -> torch.Tensor:
    """Tensor ``i`` of the index (its ``entry``) as a view of its storage span."""
    return rebuild_tensors([entry], spans, sizes, where, first=i)[0]


def rebuild_tensors(
    entries: Sequence[Any],
    spans: list[torch.Tensor],
    sizes: Sequence[int],
    where: str,
    *,
    first: int = 0,
) -> list[torch.Tensor]:
    """The index's tensor table (``entries``, numbered from ``first``), each validated and
    made a view of its storage span (``set_`` on a fresh empty tensor of its dtype: a
    thousand tensors in a few ms; each span's storage is looked up once)."""
    storages: dict[int, torch.UntypedStorage] = {}
    empty: dict[torch.dtype, torch.Tensor] = {}
    out: list[torch.Tensor] = []
    for i, entry in enumerate(entries, first):
        rec = parse_tensor_entry(entry, i, where, sizes)
        if rec.storage == -1:
            out.append(torch.empty_strided(rec.shape, rec.stride, dtype=rec.dtype))
            continue
        st = storages.get(rec.storage)
        if st is None:
            st = storages[rec.storage] = spans[rec.storage].untyped_storage()
        e = empty.get(rec.dtype)
        if e is None:
            e = empty[rec.dtype] = torch.empty(0, dtype=rec.dtype)
        out.append(e.new_empty(0).set_(st, rec.offset // rec.dtype.itemsize, rec.shape, rec.stride))
    return out
