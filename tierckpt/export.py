"""Export one checkpoint to safetensors files that a Hugging Face user can load.

The nested state is flattened into dotted names (``model.blocks.0.qkv.weight``,
``optimizer.state.0.exp_avg``). By default each top-level key whose value holds tensors gets
its own file, with names relative to that key, so ``model.safetensors`` loads straight into
the model, tied weights included (see below)::

    from safetensors.torch import load_model
    load_model(model, "out/model.safetensors")

With ``single_file=True`` everything goes to ``state.safetensors`` under full dotted names.
Everything that is not a tensor (step counters, param groups, scheduler state, strings) goes
to ``state.json`` beside the files: the whole tree, with each tensor replaced by a reference
``{"$safetensors": file, "name": name}``.

The files are written by ``huggingface_hub.save_torch_state_dict``, as Hugging Face writes
models: a file larger than ``max_shard_size`` is split into ``model-00001-of-0000N.safetensors``
shards with a ``model.safetensors.index.json`` weight map, and tied weights are stored once.
Two names are *aliases* (tied weights) when they view the same storage at the same offset
with the same shape, stride and dtype; the file holds the first name only, its metadata maps
each alias to it (as Hugging Face records them, so ``safetensors.torch.load_model`` restores
tied modules) and ``state.json`` lists them. Other tensors that overlap in storage (``B =
A[:1]``) are not aliases: each is stored under its own name. Every dtype the installed
safetensors stores is exported (float8_e8m0fnu, float4_e2m1fn_x2 with a recent one); the
others (complex128, sub-byte integer types) are skipped and listed. A NumPy array is
exported as a tensor of the same dtype (its reference in ``state.json`` says ``"numpy":
dtype``); a NumPy scalar is written to ``state.json`` as its Python value.

An export replaces the previous one in the same folder: the files an earlier export recorded
in its ``state.json`` (there or in its ``rank-NNNNNN/`` folders) are removed before anything
is written, so a folder never mixes two exports; other files stay, except those named like
a file (or shard, or index) the new export writes (:mod:`tierckpt._export_folder`).
"""

from __future__ import annotations

import base64
import functools
import json
import logging
import math
import os
import re
import tempfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierckpt._export_folder import ensure_writable, remove_previous_export
from tierckpt.backends.base import Backend
from tierckpt.errors import FormatError
from tierckpt.format import FORMAT_VERSION
from tierckpt.restore import read_manifest, read_shard
from tierckpt.tree import dtype_name

__all__ = ["ExportResult", "export_safetensors", "flatten_state"]

#: dtypes safetensors 0.4 stores (what :func:`safetensors_dtypes` finds in any version)
SAFETENSORS_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.complex64,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
log = logging.getLogger("tierckpt")


@dataclass
class ExportResult:
    """What one rank's export wrote."""

    step: int
    rank: int
    out_dir: str
    files: list[str] = field(default_factory=list)  # safetensors files, then state.json
    #: distinct tensors stored in the safetensors files: an alias (tied weight) is stored once
    #: and counted once; a skipped tensor is not counted
    tensors: int = 0
    skipped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


@functools.cache
def safetensors_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the installed safetensors stores and gives back as they were: each torch
    dtype is tried once with a one-element tensor, in memory (newer safetensors versions add
    dtypes: float8_e8m0fnu and float4_e2m1fn_x2 in 0.6)."""
    from safetensors.torch import load_file, save_file

    found = set()
    # through a file: safetensors.torch.load (from bytes) knows fewer dtypes than load_file
    with tempfile.TemporaryDirectory(prefix="tierckpt-dtypes-") as tmp:
        path = os.path.join(tmp, "probe.safetensors")
        for dtype in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
            try:
                t = torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype)
                save_file({"x": t}, path)
                if load_file(path)["x"].dtype == dtype:
                    found.add(dtype)
            except Exception:  # any failure: not storable
                continue
    return frozenset(found)


def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Tied weights: the same bytes seen the same way (storage, offset, shape, stride,
    dtype); ``A[:1]`` shares A's storage but is another tensor."""
    return (
        str(t.device),
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
    )


def _complete(t: torch.Tensor) -> bool:
    """``t`` covers its whole storage (what save_torch_state_dict keeps of a shared group)."""
    st = t.untyped_storage()
    return t.data_ptr() == st.data_ptr() and t.numel() * t.element_size() == st.nbytes()


def _key(k: Any) -> str:
    if isinstance(k, str):
        return k
    if isinstance(k, (int, bool)) or k is None:
        return str(k)
    return repr(k)


def flatten_state(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """``(dotted name, tensor)`` for every tensor in ``state``, in tree order."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            out.append((path, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{_key(k)}" if path else _key(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(state, prefix)
    return out


def _arrays_as_tensors(state: Any, arrays: dict[int, str]) -> Any:
    """``state`` with each NumPy array replaced by a tensor viewing it (``arrays``: the
    tensors' ids to the arrays' dtypes), so arrays are exported as the tensors they are in
    the checkpoint."""
    if isinstance(state, np.ndarray):
        t = torch.from_numpy(state)
        arrays[id(t)] = state.dtype.name
        return t
    if isinstance(state, dict):
        return type(state)((k, _arrays_as_tensors(v, arrays)) for k, v in state.items())
    if isinstance(state, list):
        return [_arrays_as_tensors(v, arrays) for v in state]
    if isinstance(state, tuple):
        return tuple(_arrays_as_tensors(v, arrays) for v in state)
    return state


def _jsonable(x: Any, ref: dict[int, dict[str, str]]) -> Any:
    """A readable JSON form of the non-tensor state; tensors become references."""
    if isinstance(x, torch.Tensor):
        return ref.get(id(x), {"$skipped_tensor": dtype_name(x.dtype)})
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$float": repr(x)}
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x):
            return {k: _jsonable(v, ref) for k, v in x.items()}
        return {"$dict": [[_jsonable(k, ref), _jsonable(v, ref)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v, ref) for v in x]
    if isinstance(x, bytes):
        return {"$bytes": base64.b64encode(x).decode("ascii")}
    if isinstance(x, (torch.dtype, torch.device)):
        return str(x)
    if isinstance(x, np.generic):  # a NumPy scalar: its Python value
        return _jsonable(x.item(), ref)
    return repr(x)


def _file_name(key: str) -> str:
    name = _UNSAFE.sub("_", key).strip("._") or "tensors"
    return f"{name}.safetensors"


def export_safetensors(
    backend: Backend,
    step: int,
    out_dir: str,
    *,
    rank: int | None = None,
    single_file: bool = False,
    source: str = "",
    timeline: int = 0,
    max_shard_size: int | str = "5GB",
) -> list[ExportResult]:
    """Write one checkpoint as safetensors files plus ``state.json``; see the module docstring.

    ``rank``: export this rank only (default: every rank; with several ranks each goes to
    ``out_dir/rank-NNNNNN/``). ``timeline``: the checkpoint's timeline (see
    :func:`tierckpt.offline.resolve_id`). ``max_shard_size``: a file above it is split into
    shards with an index, as ``save_pretrained`` does (bytes, or a string such as ``"5GB"``).
    """
    max_shard_size = shard_size_bytes(max_shard_size)
    try:
        import huggingface_hub  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "export to safetensors needs safetensors and huggingface_hub: "
            f"pip install 'tierckpt[hf]' ({exc})"
        ) from exc

    manifest = read_manifest(backend, step, backend.url, timeline=timeline)
    ranks = [s.rank for s in manifest.shards] if rank is None else [rank]
    remove_previous_export(out_dir)  # the checkpoint exists: replace what is there
    results = []
    with ThreadPoolExecutor(4, thread_name_prefix="tierckpt-export") as pool:
        for r in ranks:
            loaded = read_shard(backend, backend.url, manifest, r, pool)
            where = out_dir if len(ranks) == 1 else os.path.join(out_dir, f"rank-{r:06d}")
            ensure_writable(where)
            res = ExportResult(step, r, where)
            arrays: dict[int, str] = {}  # tensors that were NumPy arrays: their dtypes
            state = _arrays_as_tensors(loaded.state, arrays)
            groups: OrderedDict[str, list[tuple[str, torch.Tensor]]] = OrderedDict()
            if (
                not single_file
                and isinstance(state, dict)
                and all(isinstance(k, str) for k in state)
            ):
                owner: dict[str, str] = {}  # file name -> the top-level key it holds
                for k, v in state.items():
                    items = flatten_state(v)
                    if items:
                        fname = _file_name(k)
                        if fname in owner:  # never drop one key's tensors for the other's
                            raise FormatError(
                                f"step {step}: top-level keys {owner[fname]!r} and {k!r} both "
                                f"export to {fname} (file names keep only [A-Za-z0-9._-]); "
                                "export with --single-file (single_file=True: every tensor "
                                "under its full key in one file) or rename one of the keys"
                            )
                        owner[fname] = k
                        groups[fname] = [(n or k, t) for n, t in items]
            else:
                groups["state.safetensors"] = flatten_state(state)
            ref: dict[int, dict[str, str]] = {}
            storable = safetensors_dtypes()
            for fname, items in groups.items():
                names: set[str] = set()
                for name, _t in items:
                    if name in names:
                        raise FormatError(
                            f"two tensors flatten to the same name {name!r} in {fname} (as 1 "
                            "and '1', or 'a.b' and a nested a.b do); --single-file joins names "
                            "alike: rename one of those keys (in the state saved, or after "
                            "Checkpointer.load, then write it with safetensors yourself)"
                        )
                    names.add(name)
                written = _write_group(
                    fname,
                    items,
                    where,
                    storable,
                    res,
                    max_shard_size,
                    metadata={
                        "format": "pt",
                        "tierckpt_step": str(step),
                        "tierckpt_rank": str(r),
                        "tierckpt_source": source or backend.url,
                    },
                )
                for t, (file, name) in written.items():
                    ref[t] = {"$safetensors": file, "name": name}
                    if t in arrays:
                        ref[t]["numpy"] = arrays[t]
            doc = {
                "tierckpt_export": 1,
                "format_version": FORMAT_VERSION,
                "source": source or backend.url,
                "step": step,
                "rank": r,
                "world_size": manifest.world_size,
                "files": [os.path.basename(f) for f in res.files],
                "aliases": res.aliases,
                "skipped": res.skipped,
                "metadata": manifest.metadata or {},
                "state": _jsonable(state, ref),
            }
            json_path = os.path.join(where, "state.json")
            with open(json_path, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1, allow_nan=False)
                f.write("\n")
            res.files.append(json_path)
            results.append(res)
    return results


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def shard_size_bytes(size: int | str) -> int:
    """``max_shard_size`` in bytes: an int, or text such as ``2000``, ``500MB``, ``5GB`` or
    ``2GiB`` (Hugging Face's units are decimal: 5GB is 5,000,000,000 bytes)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size), re.IGNORECASE)
        unit = (m.group(2) or "").upper() if m else "?"
        if m is None or unit not in _SIZE_UNITS:
            raise ValueError(
                f"max shard size {size!r}: give bytes (2000) or a size with a unit "
                "(500MB, 5GB, 2GiB)"
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"max shard size {size!r}: must be above 0 bytes")
    return value


def _write_group(
    fname: str,
    items: list[tuple[str, torch.Tensor]],
    where: str,
    storable: frozenset[torch.dtype],
    res: ExportResult,
    max_shard_size: int,
    *,
    metadata: dict[str, str],
) -> dict[int, tuple[str, str]]:
    """Write one group's tensors as ``fname`` (or its shards) through
    ``huggingface_hub.save_torch_state_dict``; ``id(tensor) -> (file, name)`` of each
    tensor written (an alias maps to where its first name is)."""
    from huggingface_hub import save_torch_state_dict

    tensors: dict[str, torch.Tensor] = {}
    first: dict[tuple[Any, ...], str] = {}  # alias key -> first name
    alias_of: dict[str, str] = {}
    per_storage: dict[tuple[str, int], set[tuple[Any, ...]]] = {}
    for name, t in items:
        if t.dtype not in storable:
            res.skipped.append(f"{fname}:{name} ({dtype_name(t.dtype)})")
            continue
        t = t.detach()
        if t.numel() == 0:
            tensors[name] = t
            continue
        key = _alias_key(t)
        if key in first:
            alias_of[name] = first[key]
            continue
        first[key] = name
        tensors[name] = t
        per_storage.setdefault(key[:2], set()).add(key)
    # a tensor that shares its storage with another (not an alias) or that does not cover its
    # storage gets its own copy: save_torch_state_dict would drop the others of a shared group
    for name, t in tensors.items():
        if t.numel() and (len(per_storage[_alias_key(t)[:2]]) > 1 or not _complete(t)):
            tensors[name] = t.contiguous().clone()
    for alias, name in alias_of.items():
        tensors[alias] = tensors[name]  # the same object: stored once, under ``name``
    out: dict[int, tuple[str, str]] = {}
    if not tensors:
        return out
    stem = fname.removesuffix(".safetensors")
    meta = dict(metadata)  # save_torch_state_dict adds the aliases to it
    save_torch_state_dict(
        dict(tensors),  # a copy: it deletes the discarded aliases from the dict it gets
        where,
        filename_pattern=stem + "{suffix}.safetensors",
        max_shard_size=max_shard_size,
        metadata=meta,
        shared_tensors_to_discard=sorted(alias_of),
    )
    index_path = os.path.join(where, f"{fname}.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        res.files.extend(os.path.join(where, x) for x in files)
        res.files.append(index_path)
    else:
        from safetensors import safe_open

        with safe_open(os.path.join(where, fname), "pt") as st:  # the names it holds
            weight_map = dict.fromkeys(st.keys(), fname)
        res.files.append(os.path.join(where, fname))
    for alias, name in alias_of.items():
        res.aliases[f"{fname}:{alias}"] = f"{fname}:{name}"
    res.tensors += len(weight_map)  # what the files hold: each alias group once
    for name, t in items:
        kept = alias_of.get(name, name)
        if kept in weight_map:
            out[id(t)] = (weight_map[kept], kept)
    return out
