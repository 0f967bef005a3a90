"""The last save's layout, reused when the next save's tensors are laid out the same.

Laying a state out (grouping tensors by storage, spans, chunks: :func:`tierckpt.plan.layout_plan`)
costs tens of milliseconds for a thousand tensors, on the capture thread before the first copy,
so it adds to every immediate capture. A training loop saves the same tensors at the same
addresses every time; checking that is ~1 µs per tensor. The layout depends only on what the
key holds (which tensors share a storage, each one's storage device, offset, shape, strides and
dtype, in order, and the chunk size), so an equal key gives an equal layout: only the byte
sources are made again, from this save's tensors. Nothing of a state is kept between saves (no
tensor, no storage): only numbers.

Part of :class:`~tierckpt.pipeline.Pipeline`; used by the capture thread only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierckpt.plan import CollectedState, ShardLayout, layout_plan

__all__ = ["LayoutCache"]

_Key = tuple[object, ...]


@dataclass(frozen=True, slots=True)
class _Cached:
    key: _Key
    layout: ShardLayout  # its ``sources`` are empty: never a reference to a storage
    #: per span: (index of the tensor whose storage it covers, byte offset in that storage)
    leads: tuple[tuple[int, int], ...]


def _key(tensors: list[torch.Tensor], chunk_bytes: int) -> tuple[_Key, tuple[int, ...]] | None:
    """Everything :func:`layout_plan` reads from the tensors, and the storages' addresses;
    None if a tensor is conjugated or negated (laying it out makes a resolved copy).

    The layout depends on a storage's address only through which tensors share it, so the
    key names each storage by the first tensor that views it, not by its address: a tensor
    copied afresh at every ``save()`` (a buffer ``guard`` snapshots) or a parameter replaced
    by one of the same shape lays out the same, and still hits."""
    key: list[object] = [chunk_bytes]
    addrs: list[int] = []
    first: dict[tuple[torch.device, int], int] = {}
    for i, t in enumerate(tensors):
        if t.is_conj() or t.is_neg():
            return None
        st = t.untyped_storage()
        ptr = st.data_ptr()
        addrs.append(ptr)
        owner = first.setdefault((st.device, ptr), i)
        # one flat list of numbers and names, not a tuple per tensor: a save of thousands of
        # tensors keeps no thousands of small containers alive for the collector to see (the
        # number of dimensions first, so records of different ranks cannot run together)
        key.extend((owner, st.device, t.storage_offset(), t.dtype, t.device, t.dim()))
        key.extend(t.shape)
        key.extend(t.stride())
    return tuple(key), tuple(addrs)


class LayoutCache:
    """One remembered layout: the last one laid out (a changed state replaces it)."""

    def __init__(self) -> None:
        self._last: _Cached | None = None
        self._addrs: tuple[int, ...] = ()
        self.hits = 0  # layouts reused with every storage where it was, for tests and diagnostics
        self.moved = 0  # layouts reused though a storage moved (a tensor copied at save())

    def layout(
        self,
        collected: CollectedState,
        chunk_bytes: int,
        lay_out: Callable[[CollectedState, int], ShardLayout] = layout_plan,
    ) -> ShardLayout:
        """The layout of ``collected`` in chunks of ``chunk_bytes``: the remembered one with
        this save's sources where the key matches, else laid out afresh by ``lay_out`` (and
        remembered)."""
        keyed = _key(collected.tensors, chunk_bytes)
        last = self._last
        if keyed is not None and last is not None and keyed[0] == last.key:
            if keyed[1] == self._addrs:
                self.hits += 1
            else:
                self.moved += 1
                self._addrs = keyed[1]
            return _with_sources(last, collected)
        plan = lay_out(collected, chunk_bytes)
        self._last = None if keyed is None else _remember(keyed[0], plan)
        self._addrs = () if keyed is None else keyed[1]
        return plan

    def clear(self) -> None:
        self._last = None
        self._addrs = ()


def _remember(key: _Key, plan: ShardLayout) -> _Cached:
    leads: list[tuple[int, int] | None] = [None] * len(plan.spans)
    for i, entry in enumerate(plan.tensors):
        if entry.storage >= 0 and leads[entry.storage] is None:
            leads[entry.storage] = (i, int(plan.sources[entry.storage].storage_offset()))
    if any(lead is None for lead in leads):  # every span has a tensor; be safe if not
        raise AssertionError("a storage span without a tensor in the layout")
    bare = ShardLayout(
        tree=None,
        tensors=list(plan.tensors),
        spans=list(plan.spans),
        sources=[],
        chunks=list(plan.chunks),
        data_bytes=plan.data_bytes,
        devices=set(plan.devices),
        # made here, on a miss that laid the whole state out anyway, never on a hit
        tables=plan.index_tables(),
    )
    return _Cached(key, bare, tuple(lead for lead in leads if lead is not None))


def _with_sources(cached: _Cached, collected: CollectedState) -> ShardLayout:
    """The remembered layout with byte sources made from ``collected``'s tensors."""
    bare = cached.layout
    sources: list[torch.Tensor] = []
    for (i, start), span in zip(cached.leads, bare.spans, strict=True):
        st = collected.tensors[i].untyped_storage()
        src = torch.empty(0, dtype=torch.uint8, device=st.device)
        src.set_(st, start, (span.nbytes,), (1,))
        sources.append(src)
    return ShardLayout(
        tree=collected.tree,
        tensors=list(bare.tensors),
        spans=list(bare.spans),
        sources=sources,
        chunks=list(bare.chunks),
        data_bytes=bare.data_bytes,
        devices=set(bare.devices) | collected.devices,
        parameters=collected.parameters,
        requires_grad=collected.requires_grad,
        # the index's tables, made once for the remembered layout and shared by every save
        # that reuses it (only numbers and text: no reference to a tensor)
        tables=bare.tables,
    )
