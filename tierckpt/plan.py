"""Flatten a state dict into a tensor table and a byte layout, then cut it into chunks.

A rank's tensors are stored as *storage spans*: for every storage the state references, the
smallest byte range covering all tensors that view it. A span is copied as plain bytes, so
non-contiguous tensors (transposed, strided slices) need no temporary on the device, and two
views of one storage stay views of one storage after loading. Spans are laid end to end in a
logical byte stream, grouped by dtype (a group's spans whose size is a multiple of
:data:`SPAN_ALIGN` first, so each starts aligned), and the stream is cut into chunks of about
``chunk_bytes``: many small tensors share a chunk (one copy), a large one spans several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt._types import JSON
from tierckpt.errors import UnsupportedObject
from tierckpt.format import EncodedTable
from tierckpt.tree import dtype_name, encode_tree

__all__ = [
    "SPAN_ALIGN",
    "ChunkPlan",
    "CollectedState",
    "Piece",
    "ShardLayout",
    "SpanPlan",
    "TensorEntry",
    "build_plan",
    "collect_state",
    "layout_plan",
]

#: start of a span is aligned down to this when tensors of different dtypes share a storage
_MIXED_ALIGN = 16
#: within a dtype group, the spans whose size is a multiple of this come first (in order of
#: appearance), then the others (largest first): every span of the first kind, and the first
#: of the others, starts at a multiple of it from the group's start, which is a chunk's start,
#: at a multiple of 4096 in the file, as are the chunk starts after it (``chunk_bytes``
#: apart). 16 is the largest itemsize (complex128) and what a node-RAM restore needs to map a
#: storage rather than copy it (``noderam_map.MAP_ALIGNMENT``): in order of appearance, one
#: 4-byte Adam ``step`` before the fp32 moments left every later fp32 span unaligned, so the
#: whole optimizer state was copied. An order, not padding: the stream stays gapless (readers
#: before this handle gaps only partly), no byte is added
SPAN_ALIGN = 16


@dataclass(frozen=True, slots=True)
class TensorEntry:
    storage: int  # index into the span table, -1 for tensors with no elements
    offset: int  # byte offset of element 0 within the span
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str

    def to_json(self) -> list[JSON]:
        return [
            self.storage,
            self.offset,
            self.dtype,
            list(self.shape),
            list(self.stride),
            self.device,
        ]


@dataclass(frozen=True, slots=True)
class SpanPlan:
    logical_offset: int
    nbytes: int
    dtype: str


@dataclass(frozen=True, slots=True)
class Piece:
    span: int
    src_offset: int  # within the span
    length: int
    dst_offset: int  # within the chunk


@dataclass(frozen=True, slots=True)
class ChunkPlan:
    seq: int
    logical_offset: int
    raw_size: int
    dtype: str
    pieces: tuple[Piece, ...]


@dataclass(slots=True)
class ShardLayout:
    """How one rank's state lays out in its shard file: the object tree, the tensor table, the
    storage spans and the chunks their bytes are cut into (not DCP's ``SavePlan``)."""

    tree: JSON
    tensors: list[TensorEntry]
    spans: list[SpanPlan]
    sources: list[torch.Tensor]  # uint8 views of each span's bytes, on the tensor's device
    chunks: list[ChunkPlan]
    data_bytes: int
    devices: set[str]
    #: ``2 * tensor + requires_grad`` for each tensor that is an ``nn.Parameter``
    parameters: list[int] = field(default_factory=list)
    #: the other tensors that require grad (``torch.load`` gives them back so)
    requires_grad: list[int] = field(default_factory=list)
    #: the tensor and storage tables as index text, made at the first index of this layout
    #: (a layout reused by the next save keeps them: ``LayoutCache``)
    tables: tuple[EncodedTable, EncodedTable] | None = None

    def index_tables(self) -> tuple[EncodedTable, EncodedTable]:
        """The tensor and storage tables as compact JSON text, the same text as
        ``json.dumps`` of their records gives, made once per layout: a save of thousands of
        tensors builds no list per tensor for its index (each tier's index would otherwise
        hold thousands at once, and the garbage collector run on them)."""
        if self.tables is None:
            self.tables = (_tensor_table(self.tensors), _storage_table(self.spans))
        return self.tables

    def index_skeleton(self) -> dict[str, Any]:
        tensors, storages = self.index_tables()
        out: dict[str, Any] = {
            "tree": self.tree,
            "tensors": tensors,
            "storages": storages,
            "data_bytes": self.data_bytes,
        }
        if self.parameters:
            # a field readers before it ignore (they load plain tensors), unlike a tree tag
            out["parameters"] = list(self.parameters)
        if self.requires_grad:
            out["requires_grad"] = list(self.requires_grad)
        return out


def _ints(xs: tuple[int, ...]) -> str:
    return ",".join(map(str, xs))


def _tensor_table(entries: list[TensorEntry]) -> EncodedTable:
    """``[t.to_json() for t in entries]`` as compact JSON text (strings through ``json``,
    once per distinct dtype and device name)."""
    quoted: dict[str, str] = {}

    def q(name: str) -> str:
        text = quoted.get(name)
        if text is None:
            text = quoted[name] = json.dumps(name)
        return text

    records = [
        f"[{e.storage},{e.offset},{q(e.dtype)},[{_ints(e.shape)}],[{_ints(e.stride)}],"
        f"{q(e.device)}]"
        for e in entries
    ]
    text = "[" + ",".join(records) + "]"
    return EncodedTable(text, len(entries), sum(len(e.shape) for e in entries))


def _storage_table(spans: list[SpanPlan]) -> EncodedTable:
    """``[[s.logical_offset, s.nbytes] for s in spans]`` as compact JSON text."""
    text = "[" + ",".join(f"[{s.logical_offset},{s.nbytes}]" for s in spans) + "]"
    return EncodedTable(text, len(spans))


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of ``t`` within its storage."""
    item = t.element_size()
    first = t.storage_offset()
    last = first + sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True))
    return int(first * item), int((last + 1) * item)


def _check_tensor(t: torch.Tensor, path: object) -> torch.Tensor:
    """Refuse what cannot be stored; cheap, so it runs in ``save()`` itself."""
    if t.layout != torch.strided:
        raise UnsupportedObject(
            f"tensor at {path} has layout {t.layout}; only dense (strided) tensors are stored "
            "(convert with .to_dense())"
        )
    if t.is_meta:
        raise UnsupportedObject(f"tensor at {path} is on the meta device and holds no data")
    if t.is_nested:
        raise UnsupportedObject(
            f"tensor at {path} is a nested tensor; store its components (t.unbind()) or a "
            "padded tensor (t.to_padded_tensor(0)) and the lengths"
        )
    if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) and not isinstance(
        t, torch.nn.Parameter
    ):
        raise UnsupportedObject(
            f"tensor at {path} is a {type(t).__qualname__}; distributed (DTensor/sharded) "
            "state goes through tierckpt.dcp (torch.distributed.checkpoint), plain tensors here"
        )
    _check_storage(t, path)
    return t


def _check_storage(t: torch.Tensor, path: object) -> None:
    """The tensor's bytes must lie inside its storage: a freed or shrunk storage (an FSDP flat
    parameter between gathers, ``untyped_storage().resize_(0)``) would be read out of bounds."""
    n = t.numel()
    if n == 0:
        return
    # contiguous, the common case, without _extent's walk over the dimensions
    end = (t.storage_offset() + n) * t.element_size() if t.is_contiguous() else _extent(t)[1]
    have = t.untyped_storage().nbytes()
    if end > have:
        raise UnsupportedObject(
            f"tensor at {path} needs bytes up to {end} of its storage, which holds {have}: "
            "its storage was freed or resized (e.g. an FSDP parameter outside forward); save "
            "the state where its tensors hold their data"
        )


def _prepare(t: torch.Tensor) -> torch.Tensor:
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t.detach()


@dataclass(slots=True)
class CollectedState:
    """What ``save()`` itself extracts from the state (the rest is laid out in background).

    Walking the object tree validates it (unsupported objects raise here, at save time) and
    takes references to the tensors; grouping, spans and chunks are computed by the capture
    thread, so the training thread pays only for the walk.
    """

    tree: JSON
    tensors: list[torch.Tensor]
    devices: set[str]
    #: ``2 * tensor + requires_grad`` for each tensor that is an ``nn.Parameter`` (a load
    #: gives it back as a Parameter with its requires_grad, as ``torch.load`` does)
    parameters: list[int] = field(default_factory=list)
    #: indices of the other tensors that require grad (a plain leaf such as SAC's
    #: ``log_alpha``: loaded without it, an optimizer over it would never step it)
    requires_grad: list[int] = field(default_factory=list)
    #: indices of the tensors that are copies taken by the walk itself (NumPy arrays): a
    #: snapshot already, which ``snapshot_eager`` need not copy again
    copies: list[int] = field(default_factory=list)
    #: each tensor's key path (formatted only when shown: an error naming it)
    paths: list[object] = field(default_factory=list)


def collect_state(state: Any) -> CollectedState:
    tensors: list[torch.Tensor] = []
    devices: set[str] = set()
    parameters: list[int] = []
    requires_grad: list[int] = []
    paths: list[object] = []

    def on_tensor(t: torch.Tensor, path: object) -> int:
        tensors.append(_check_tensor(t, path))
        paths.append(path)
        if not t.is_cpu:  # is_cpu: a flag; t.device builds a device object per tensor
            devices.add(str(t.device))
        if isinstance(t, torch.nn.Parameter):
            parameters.append(2 * (len(tensors) - 1) + bool(t.requires_grad))
        elif t.requires_grad:
            requires_grad.append(len(tensors) - 1)
        return len(tensors) - 1

    copies: list[int] = []
    tree = encode_tree(state, on_tensor, copies=copies)
    return CollectedState(tree, tensors, devices, parameters, requires_grad, copies, paths)


def build_plan(state: Any, chunk_bytes: int) -> ShardLayout:
    return layout_plan(collect_state(state), chunk_bytes)


def layout_plan(collected: CollectedState, chunk_bytes: int) -> ShardLayout:
    if chunk_bytes < 4096 or chunk_bytes % 4096:
        raise ValueError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes}")
    tree = collected.tree
    tensors = [_prepare(t) for t in collected.tensors]
    entries: list[TensorEntry | None] = [None] * len(tensors)

    # group tensors by the storage they view
    groups: dict[tuple[str, int], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() == 0:
            entries[i] = TensorEntry(
                -1, 0, dtype_name(t.dtype), tuple(t.shape), tuple(t.stride()), str(t.device)
            )
            continue
        st = t.untyped_storage()
        groups.setdefault((str(st.device), st.data_ptr()), []).append(i)

    spans: list[SpanPlan] = []
    sources: list[torch.Tensor] = []
    first_seen: dict[str, int] = {}
    laid: list[tuple[tuple[int, bool, int], list[int], list[tuple[int, int]], int, int]] = []
    for members in groups.values():
        ranges = [_extent(tensors[i]) for i in members]
        start = min(r[0] for r in ranges)
        end = max(r[1] for r in ranges)
        if any(
            (r[0] - start) % tensors[i].element_size() for i, r in zip(members, ranges, strict=True)
        ):
            start -= start % _MIXED_ALIGN
        group = first_seen.setdefault(str(tensors[members[0]].dtype), len(first_seen))
        odd = (end - start) % SPAN_ALIGN != 0
        laid.append(((group, odd, start - end if odd else 0), members, ranges, start, end))
    # by dtype (first appearance) so chunks hold one dtype each; in a group, the spans of a
    # size that keeps the next one aligned first (see SPAN_ALIGN; a stable sort)
    laid.sort(key=lambda x: x[0])
    logical = 0
    for _key, members, ranges, start, end in laid:
        span_idx = len(spans)
        lead = tensors[members[0]]
        spans.append(SpanPlan(logical, end - start, dtype_name(lead.dtype)))
        st = lead.untyped_storage()
        src = torch.empty(0, dtype=torch.uint8, device=st.device)
        src.set_(st, start, (end - start,), (1,))
        sources.append(src)
        for i, r in zip(members, ranges, strict=True):
            t = tensors[i]
            entries[i] = TensorEntry(
                span_idx,
                r[0] - start,
                dtype_name(t.dtype),
                tuple(t.shape),
                tuple(t.stride()),
                str(t.device),
            )
        logical += end - start

    chunks = _cut_chunks(spans, chunk_bytes)
    return ShardLayout(
        tree=tree,
        tensors=[e for e in entries if e is not None],
        spans=spans,
        sources=sources,
        chunks=chunks,
        data_bytes=logical,
        devices={str(t.device) for t in tensors} | collected.devices,
        parameters=collected.parameters,
        requires_grad=collected.requires_grad,
    )


def _cut_chunks(spans: list[SpanPlan], chunk_bytes: int) -> list[ChunkPlan]:
    chunks: list[ChunkPlan] = []
    pieces: list[Piece] = []
    start = 0
    size = 0
    dtype = ""

    def close() -> None:
        nonlocal pieces, size
        if pieces:
            chunks.append(ChunkPlan(len(chunks), start, size, dtype, tuple(pieces)))
        pieces = []
        size = 0

    for si, span in enumerate(spans):
        if pieces and span.dtype != dtype:
            close()
        done = 0
        while done < span.nbytes:
            if not pieces:
                start = span.logical_offset + done
                dtype = span.dtype
            take = min(span.nbytes - done, chunk_bytes - size)
            pieces.append(Piece(si, done, take, size))
            size += take
            done += take
            if size == chunk_bytes:
                close()
    close()
    return chunks
