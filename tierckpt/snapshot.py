"""Eager snapshots at ``save()``: the tensors a forward pass can write are copied before it returns.

Lazy capture rests on one fact: parameters and optimizer state change only in
``optimizer.step()``, and the guard holds that step until the capture is done. Other tensors
change earlier: the forward pass that runs right after ``save()`` writes module buffers in place
(BatchNorm running stats and ``num_batches_tracked``, EMA and cache buffers), and a state can
hold loose tensors the loop changes at will (a running loss). Those are copied in ``save()``
itself — they are small — so a checkpoint is the state at ``save()``.

Which is which is learned from what ``Checkpointer.guard(optimizer, model)`` was given: a tensor
is *lazy* iff its storage belongs to a parameter of a guarded module (trained or frozen), to a
parameter of a guarded optimizer or to that optimizer's state. Tensors are matched by storage,
not identity, because ``state_dict()`` returns detached tensors sharing storage with the
parameters. A frozen base of billions of parameters (LoRA) is therefore never copied eagerly.

A copy keeps the layout of what it copies: every storage the state views is copied once, as the
byte range covering its views, into a storage of its own, and the views are rebuilt on it — so
views stay views and the checkpoint's layout is what the lazy path would have written. (A
tensor alone on its storage is cloned instead; one of a dtype the copy kernel refuses, such as
the sub-byte ``torch.uint4``, takes the byte path too.) On CUDA the copy is a device clone
queued on the current stream; the capture's side stream waits for an event recorded after it,
so ``save()`` does not wait for the copy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.nn.parameter import is_lazy

from tierckpt.errors import StateChanged
from tierckpt.plan import ChunkPlan, ShardLayout, _extent

__all__ = [
    "EAGER_WARN_BYTES",
    "LazySources",
    "Snapshot",
    "snapshot_eager",
]

#: copying more than this at one ``save()`` earns a warning (once): frozen parameters, probably
EAGER_WARN_BYTES = 64 << 20
#: a copied span starts this aligned, so a view of any dtype keeps a whole-element offset
_ALIGN = 16

_Key = tuple[torch.device, int]


def _key(t: torch.Tensor) -> _Key:
    return (t.device, t.untyped_storage().data_ptr())


class LazySources:
    """The optimizers and modules ``guard()`` was given, held weakly.

    Their storages are recomputed at every ``save()``: optimizer state appears at the first
    step and ``module.to()`` or ``load_state_dict`` may replace a storage, so a cached set could
    be stale in exactly the way that loses data.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._optimizers: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._modules: dict[int, weakref.ref[torch.nn.Module]] = {}

    def add(
        self, optimizer: torch.optim.Optimizer | None, modules: Iterable[torch.nn.Module] = ()
    ) -> None:
        with self._lock:
            if optimizer is not None:
                known = self._optimizers.get(id(optimizer))
                if known is None or known() is not optimizer:
                    self._optimizers[id(optimizer)] = weakref.ref(optimizer)
            for m in modules:
                mknown = self._modules.get(id(m))
                if mknown is None or mknown() is not m:
                    self._modules[id(m)] = weakref.ref(m)

    def _alive(self) -> tuple[list[torch.optim.Optimizer], list[torch.nn.Module]]:
        with self._lock:
            for table in (self._optimizers, self._modules):
                for k in [k for k, r in table.items() if r() is None]:
                    del table[k]
            opts = [o for r in self._optimizers.values() if (o := r()) is not None]
            mods = [m for r in self._modules.values() if (m := r()) is not None]
        return opts, mods

    @property
    def guarded(self) -> bool:
        """Whether ``guard()`` named anything that is still alive."""
        opts, mods = self._alive()
        return bool(opts or mods)

    @property
    def has_modules(self) -> bool:
        return bool(self._alive()[1])

    def storages(self) -> set[_Key]:
        """Storages of the guarded modules' parameters and the guarded optimizers' tensors."""
        opts, mods = self._alive()
        keys: set[_Key] = set()
        for m in mods:
            keys.update(_key(p) for p in m.parameters() if not is_lazy(p) and p.numel())
        for opt in opts:
            keys.update(_key(t) for t in _optimizer_tensors(opt) if t.numel())
        return keys


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in opt.param_groups:
        yield from (p for p in group["params"] if isinstance(p, torch.Tensor))
    for per_param in opt.state.values():
        if isinstance(per_param, dict):
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What ``snapshot_eager`` did: the tensors to capture, and what it copied."""

    #: the tensors in the state's order, the eager ones replaced by their copies
    tensors: list[torch.Tensor]
    #: bytes copied at ``save()``
    eager_bytes: int
    #: how many of the state's tensors were copied
    eager_tensors: int


def snapshot_eager(
    tensors: list[torch.Tensor], lazy: set[_Key], copies: Iterable[int] | None = None
) -> Snapshot:
    """Copy every tensor whose storage is not in ``lazy``; keep the others by reference.

    An ``nn.Parameter`` put in the state directly (``state_dict(keep_vars=True)``) is lazy only
    where its storage is (a guarded module's or optimizer's): another module's, an EMA's
    updated right after ``save()``, is copied. The tensors at ``copies`` are private copies
    already (of NumPy arrays, taken by the walk): kept as they are.
    """
    out = list(tensors)
    groups: dict[_Key, list[int]] = {}
    eager_bytes = 0
    eager_n = 0
    own = frozenset(copies or ())
    for i, t in enumerate(tensors):
        if t.numel() == 0 or i in own:
            continue
        k = _key(t)
        if k in lazy:
            continue
        if t.is_quantized or t.is_conj() or t.is_neg():
            # no byte-level view for these: a copy of the tensor itself (quantization
            # parameters kept; a conjugate or negative bit resolved, as capture would)
            d = t.detach()
            out[i] = d.clone() if t.is_quantized else d.resolve_conj().resolve_neg()
            eager_bytes += t.numel() * t.element_size()
            eager_n += 1
            continue
        groups.setdefault(k, []).append(i)

    for members in groups.values():
        if len(members) == 1 and tensors[members[0]].is_contiguous():
            # the common case (a buffer alone on its storage): one call
            t = tensors[members[0]]
            try:
                out[members[0]] = t.detach().clone(memory_format=torch.contiguous_format)
            except NotImplementedError:
                # a dtype the copy kernel refuses (the sub-byte ``torch.uint4``, ``int1``…):
                # its bytes are copied as bytes below, the way a shared storage is
                pass
            else:
                eager_bytes += t.numel() * t.element_size()
                eager_n += 1
                continue
        ranges = [_extent(tensors[i]) for i in members]
        start = min(r[0] for r in ranges) // _ALIGN * _ALIGN
        end = max(r[1] for r in ranges)
        st = tensors[members[0]].untyped_storage()
        src = torch.empty(0, dtype=torch.uint8, device=st.device)
        src.set_(st, start, (end - start,), (1,))
        # a storage of its own per source storage (not one shared buffer): the plan groups
        # tensors by storage, so sharing would merge unrelated tensors into one span
        copy = src.clone()
        copied = copy.untyped_storage()
        for i, (first, _) in zip(members, ranges, strict=True):
            t = tensors[i]
            v = torch.empty(0, dtype=t.dtype, device=copy.device)
            v.set_(copied, (first - start) // t.element_size(), t.shape, t.stride())
            out[i] = v
        eager_bytes += end - start
        eager_n += len(members)
    return Snapshot(out, eager_bytes, eager_n)


@dataclass(slots=True)
class Watched:
    """A guarded save's tensors (lazy ones and the eager copies) with their version counters
    at ``save()``. The capture checks each chunk's tensors once that chunk is copied (on CUDA:
    queued) (:meth:`changed`): the guard holds the optimizer step until the whole capture is
    done, so a change seen was made by something else between ``save()`` and the copy, and
    the checkpoint would mix two states. The counter moves when an operation ends, so one
    still running when its chunk is checked is not seen then: the capture looks at every
    tensor again once its copies are done (:meth:`changed_any`), after the training thread
    waits for it or a moment passes, and a change before then fails the save, even one
    made after its own chunk was copied. Changes made through ``.data`` are never seen."""

    tensors: list[torch.Tensor]
    versions: list[int]
    paths: list[object]
    #: span index -> the tensors viewing it (made at the first check, from the layout)
    by_span: dict[int, list[int]] | None = None

    def changed(self, plan: ShardLayout, chunk: ChunkPlan, step: int) -> StateChanged | None:
        """The error for the tensors of ``chunk`` changed in place since ``save()``, or
        None."""
        if self.by_span is None:
            self.by_span = {}
            for i, e in enumerate(plan.tensors):
                self.by_span.setdefault(e.storage, []).append(i)
        return self._error([i for p in chunk.pieces for i in self.by_span.get(p.span, ())], step)

    def changed_any(self, step: int) -> StateChanged | None:
        """The error for any of the save's tensors changed in place since ``save()``, or
        None: once the capture's copies are done, before it says so (see the capture)."""
        return self._error(range(len(self.tensors)), step)

    def _error(self, seen: Sequence[int], step: int) -> StateChanged | None:
        now = _versions([self.tensors[i] for i in seen])
        changed = [i for i, v in zip(seen, now, strict=True) if v != self.versions[i]]
        if not changed:
            return None
        named = ", ".join(str(self.paths[i]) for i in changed[:3])
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return StateChanged(
            f"step {step}: tensors of the state were changed in place after save() and "
            f"before they were captured ({named}{more}): parameters and optimizer state are "
            "copied lazily, so this checkpoint would mix values from before and after the "
            "change and is not committed anywhere. Call ck.wait_captured() (or "
            "h.wait_captured()) before changing them outside the guarded optimizer's step(): "
            "an EMA or averaged-weights swap for evaluation, load_state_dict(), clamp_(); and "
            "guard every optimizer that steps them (ck.guard(opt))"
        )


def watch(tensors: list[torch.Tensor], paths: list[object]) -> Watched:
    return Watched(tensors, _versions(tensors), paths)


def _versions(tensors: list[torch.Tensor]) -> list[int]:
    try:
        return [t._version for t in tensors]
    except RuntimeError:  # an inference tensor has no version counter: not watched
        return [-1 if t.is_inference() else t._version for t in tensors]
