"""Export one checkpoint to safetensors files that a Hugging Face user can load.

The nested state is flattened into dotted names (``model.blocks.0.qkv.weight``,
``optimizer.state.0.exp_avg``). By default each top-level key whose value holds tensors gets
its own file, with names relative to that key, so ``model.safetensors`` loads straight into
``model.load_state_dict``::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("out/model.safetensors"))

With ``single_file=True`` everything goes to ``state.safetensors`` under full dotted names.
Everything that is not a tensor (step counters, param groups, scheduler state, strings) goes
to ``state.json`` beside the files: the whole tree, with each tensor replaced by a reference
``{"$safetensors": file, "name": name}``. Tensors that share storage (tied weights) are
written once per name; ``state.json`` lists such aliases. Dtypes safetensors cannot hold
(complex128, some float8 variants) are skipped and listed.
"""

from __future__ import annotations

import base64
import errno
import json
import math
import os
import re
import tempfile
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.backends.base import Backend
from tierckpt.errors import BackendError, FormatError
from tierckpt.format import FORMAT_VERSION
from tierckpt.restore import read_manifest, read_shard
from tierckpt.tree import dtype_name

__all__ = ["ExportResult", "export_safetensors", "flatten_state"]

#: dtypes safetensors 0.4+ can store
SAFETENSORS_DTYPES = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64, torch.complex64,
    torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
})
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass
class ExportResult:
    """What one rank's export wrote."""

    step: int
    rank: int
    out_dir: str
    files: list[str] = field(default_factory=list)  # safetensors files, then state.json
    tensors: int = 0
    skipped: list[str] = field(default_factory=list)
    aliases: dict[str, str] = field(default_factory=dict)


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
    return repr(x)


def _file_name(key: str) -> str:
    name = _UNSAFE.sub("_", key).strip("._") or "tensors"
    return f"{name}.safetensors"


def _ensure_writable(where: str) -> None:
    """Create ``where`` and check that files can be written there: a read-only location gets
    a clear error before anything is written, instead of a raw OSError (or safetensors' own
    error) halfway through."""
    try:
        os.makedirs(where, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".tierckpt-probe-", dir=where)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        hint = ""
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            hint = " (the folder is read-only or not writable by this user: pick a writable one)"
        raise BackendError(
            exc.errno or 0, f"{where}: cannot write the export there: {exc.strerror}{hint}"
        ) from exc


def export_safetensors(
    backend: Backend,
    step: int,
    out_dir: str,
    *,
    rank: int | None = None,
    single_file: bool = False,
    source: str = "",
    timeline: int = 0,
) -> list[ExportResult]:
    """Write one checkpoint as safetensors files plus ``state.json``; see the module docstring.

    ``rank``: export this rank only (default: every rank; with several ranks each goes to
    ``out_dir/rank-NNNNNN/``). ``timeline``: the checkpoint's timeline (see
    :func:`tierckpt.offline.resolve_id`).
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ImportError(f"export to safetensors needs the package: pip install safetensors "
                          f"({exc})") from exc

    manifest = read_manifest(backend, step, backend.url, timeline=timeline)
    ranks = [s.rank for s in manifest.shards] if rank is None else [rank]
    results = []
    with ThreadPoolExecutor(4, thread_name_prefix="tierckpt-export") as pool:
        for r in ranks:
            loaded = read_shard(backend, backend.url, manifest, r, pool)
            where = out_dir if len(ranks) == 1 else os.path.join(out_dir, f"rank-{r:06d}")
            _ensure_writable(where)
            res = ExportResult(step, r, where)
            state = loaded.state
            groups: OrderedDict[str, list[tuple[str, torch.Tensor]]] = OrderedDict()
            if (not single_file and isinstance(state, dict)
                    and all(isinstance(k, str) for k in state)):
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
            for fname, items in groups.items():
                tensors: dict[str, torch.Tensor] = {}
                first_name: dict[tuple[int, int], str] = {}
                for name, t in items:
                    full = name
                    if name in tensors:
                        raise FormatError(f"two tensors flatten to the same name {name!r} in "
                                          f"{fname}; export with --single-file or rename keys")
                    if t.dtype not in SAFETENSORS_DTYPES:
                        res.skipped.append(f"{fname}:{full} ({dtype_name(t.dtype)})")
                        continue
                    storage_key = (t.untyped_storage().data_ptr(), int(t.storage_offset()))
                    if t.numel() and storage_key in first_name:
                        res.aliases[f"{fname}:{full}"] = f"{fname}:{first_name[storage_key]}"
                    elif t.numel():
                        first_name[storage_key] = full
                    # safetensors refuses shared or strided memory: give each name its own
                    tensors[full] = t.detach().contiguous().clone()
                    ref[id(t)] = {"$safetensors": fname, "name": full}
                if not tensors:
                    continue
                path = os.path.join(where, fname)
                save_file(tensors, path, metadata={
                    "format": "pt",
                    "tierckpt_step": str(step),
                    "tierckpt_rank": str(r),
                    "tierckpt_source": source or backend.url,
                })
                res.files.append(path)
                res.tensors += len(tensors)
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
