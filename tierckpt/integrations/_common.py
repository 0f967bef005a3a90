"""Helpers shared by the framework integrations."""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import os
import random
import shutil
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np
import torch

from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import CheckpointFailed, CheckpointNotFound, TierCkptError
from tierckpt.handle import SaveHandle
from tierckpt.restore import read_manifest
from tierckpt.tree import numpy_storable

__all__ = [
    "checkpoint_identity",
    "closure_guard_hook",
    "with_hint",
    "folder_holds",
    "give_back_leases",
    "rng_states",
    "sanitize_state",
    "set_rng_states",
    "write_checkpoint",
    "write_trainer_folder",
]

log = logging.getLogger("tierckpt")

_PLAIN = (type(None), bool, int, float, str, bytes, torch.Size, torch.dtype, torch.device)


def sanitize_state(
    obj: Any, *, unsupported: Literal["error", "repr"] = "repr", path: str = ""
) -> Any:
    """Turn a framework's checkpoint dict into values tierckpt stores without pickle.

    Dict subclasses (``AttributeDict``, ``defaultdict``) become dicts (``OrderedDict`` stays),
    namedtuples and list subclasses become tuples and lists, paths become strings, enums their
    values, dataclasses dicts; NumPy arrays and scalars of numeric or bool dtypes stay as they
    are (tierckpt stores them). With ``unsupported="repr"`` any other object is stored as its
    ``repr()`` string (logged once per path; it cannot be restored as an object); with
    ``"error"`` it is left alone, so ``save()`` refuses it with ``UnsupportedObject``.
    """
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:
        return obj
    if isinstance(obj, (np.ndarray, np.generic)) and numpy_storable(obj):
        return obj  # stored as it is (a NumPy array or scalar of a numeric or bool dtype)
    if isinstance(obj, Mapping):
        items = [
            (
                sanitize_state(k, unsupported=unsupported, path=f"{path}<key>"),
                sanitize_state(v, unsupported=unsupported, path=f"{path}.{k}"),
            )
            for k, v in obj.items()
        ]
        return OrderedDict(items) if isinstance(obj, OrderedDict) else dict(items)
    if isinstance(obj, tuple):
        return tuple(
            sanitize_state(v, unsupported=unsupported, path=f"{path}.{i}")
            for i, v in enumerate(obj)
        )
    if isinstance(obj, (list, set, frozenset)):
        return [
            sanitize_state(v, unsupported=unsupported, path=f"{path}.{i}")
            for i, v in enumerate(obj)
        ]
    if isinstance(obj, (bool, int, float, str, bytes)):  # subclasses (IntEnum handled here)
        base: type = next(t for t in (bool, int, float, str, bytes) if isinstance(obj, t))
        return base(obj)
    if isinstance(obj, enum.Enum):
        return sanitize_state(obj.value, unsupported=unsupported, path=path)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sanitize_state(dataclasses.asdict(obj), unsupported=unsupported, path=path)
    if unsupported == "repr":
        log.warning(
            "checkpoint value at %s (%s) stored as its repr() text: tierckpt stores "
            "no pickled objects",
            path or "<root>",
            type(obj).__qualname__,
        )
        return repr(obj)
    return obj


def closure_guard_hook(wait: Callable[[], None]) -> Callable[..., Any]:
    """An optimizer step pre-hook that waits for pending captures right before the update.

    Frameworks such as Lightning call ``optimizer.step(closure)`` with the forward and
    backward pass inside the closure. Waiting at the start of ``step()`` would give the
    capture no time to overlap them; instead the hook wraps the closure so the wait happens
    after it returns, just before the optimizer changes the parameters. Without a closure it
    waits at once.
    """

    def hook(_opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # args are step()'s positional arguments, the optimizer itself first
        closure = kwargs.get("closure")
        positional = closure is None and len(args) > 1 and callable(args[1])
        if positional:
            closure = args[1]
        if closure is None:
            wait()
            return None

        def guarded() -> Any:
            out = closure()
            wait()
            return out

        if positional:
            return (args[0], guarded, *args[2:]), kwargs
        return args, {**kwargs, "closure": guarded}

    return hook


def rng_states() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) RNG states in a form tierckpt stores."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _numpy_state(s: dict[str, Any]) -> tuple[Any, ...]:
    keys = s["keys"].numpy().astype(np.uint32)
    return (s["kind"], keys, s["pos"], s["has_gauss"], s["cached_gaussian"])


def set_rng_states(states: dict[str, Any]) -> None:
    """Inverse of :func:`rng_states`."""
    random.setstate(_as_python_rng(states["python"]))
    np.random.set_state(_numpy_state(states["numpy"]))
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_python_rng(state: Any) -> tuple[Any, ...]:
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


# -- folders materialized from a checkpoint (Hugging Face) --------------------------------------
def checkpoint_identity(ck: Checkpointer, step: int | None = None) -> dict[str, Any]:
    """What ``tierckpt.json`` records of committed checkpoint ``step`` (default: the
    newest; of a step, the newest timeline's): step, timeline and save id name it."""
    ids = [c for c in ck.checkpoints() if step is None or c.step == step]
    if not ids:
        which = "" if step is None else f" of step {step}"
        raise CheckpointNotFound(f"no committed checkpoint{which} on tiers {ck.tier_names}")
    cid = ids[-1]
    meta: dict[str, Any] = {}
    for name in ck.tier_names:
        try:
            manifest = read_manifest(ck.backend(name), cid.step, name, timeline=cid.timeline)
        except Exception:  # not (or not readably) on this tier: the next one
            continue
        meta = dict(manifest.metadata or {})
        break
    return {
        "step": cid.step,
        "timeline": cid.timeline,
        "save_id": meta.get("save_id"),
        "output_dir": meta.get("output_dir"),
        "tiers": ck.tier_names,
        "locations": [str(ck.backend(n).url) for n in ck.tier_names],
    }


def folder_holds(folder: str, ident: dict[str, Any]) -> bool:
    """Whether ``folder`` is a complete materialization of checkpoint ``ident``."""
    try:
        with open(os.path.join(folder, "tierckpt.json"), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    files = ("model.safetensors", "optimizer.pt", "trainer_state.json")
    return (
        isinstance(record, dict)
        and ident["save_id"] is not None
        and all(record.get(k) == ident[k] for k in ("step", "timeline", "save_id", "locations"))
        and all(os.path.exists(os.path.join(folder, n)) for n in files)
    )


def write_trainer_folder(folder: str, ckpt: dict[str, Any], ident: dict[str, Any]) -> None:
    """Write ``ckpt`` as a ``Trainer`` checkpoint folder; ``tierckpt.json`` last."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    # one contiguous tensor per name (tied weights are written under both names)
    weights = {k: v.detach().contiguous().clone() for k, v in ckpt["model"].items()}
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    torch.save(ckpt["optimizer"], os.path.join(folder, "optimizer.pt"))
    if ckpt["lr_scheduler"] is not None:
        torch.save(ckpt["lr_scheduler"], os.path.join(folder, "scheduler.pt"))
    rng = ckpt["rng"]
    hf_rng: dict[str, Any] = {
        "python": _as_python_rng(rng["python"]),
        "numpy": _numpy_state(rng["numpy"]),
        "cpu": rng["cpu"],
    }
    if "cuda" in rng:
        hf_rng["cuda"] = rng["cuda"]
    torch.save(hf_rng, os.path.join(folder, "rng_state.pth"))
    with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
        f.write(ckpt["trainer_state"])
    with open(os.path.join(folder, "tierckpt.json"), "w", encoding="utf-8") as f:
        json.dump(ident, f)
    log.info("materialized step %d (timeline %d) into %s", ident["step"], ident["timeline"], folder)


def write_checkpoint(ck: Checkpointer, folder: str, ident: dict[str, Any]) -> None:
    """Load checkpoint ``ident`` and write it as the ``Trainer`` folder ``folder``, replacing
    what is there (another checkpoint: another run's, or an older timeline's)."""
    ckpt = ck.load(ident["step"], timeline=ident["timeline"])
    if os.path.isdir(folder):
        log.warning(
            "%s is not step %d (timeline %d) of %s: replaced",
            folder,
            ident["step"],
            ident["timeline"],
            ident["locations"],
        )
        shutil.rmtree(folder)
    write_trainer_folder(folder, ckpt, ident)


#: how long the end of a fit waits for the retention passes after its last commits before it
#: gives the writer's leases back (a pass still running keeps them: given back at close())
SETTLE_RETENTION_S = 10.0


def give_back_leases(ck: Checkpointer) -> None:
    """The end of a fit or ``train()``, every save committed: give back the writer's leases
    (its next save takes them again), so that another writer of the same tiers made in this
    process is not refused while this one is still referenced: a second ``Trainer`` (a
    fine-tuning stage, a resumed fit) or a retry after a failed fit, whose traceback holds the
    first. Only once the retention passes after the last commits ended (they delete under
    the lease); a pass held by a store that does not answer keeps the leases."""
    if ck._pipeline is None:
        return
    try:
        ck.wait(SETTLE_RETENTION_S, retention=True)
    except TimeoutError:
        log.info("the leases stay with this writer: a retention pass is still running")
        return
    ck._pipeline.give_back_leases()


def lost_save(newest: SaveHandle | None, ck: Checkpointer, run: str) -> CheckpointFailed | None:
    """Where ``newest`` (a run's last save, finished) was committed on no tier: the error that
    ends the run (naming the newest committed checkpoint a resume starts from), else None."""
    if newest is None or not newest.tiers or any(newest.committed(t) for t in newest.tiers):
        return None
    causes = "; ".join(f"{t}: {e}" for t, e in newest.errors.items()) or "skipped"
    try:
        held = [c.step for c in ck.checkpoints()]
        before = f"step {held[-1]}" if held else "none"
    except TierCkptError as exc:
        before = f"unknown ({exc})"
    return CheckpointFailed(
        f"the last checkpoint of this {run}, step {newest.step}, was committed on no tier "
        f"({causes}); the newest committed checkpoint is {before}, so a resume starts there. "
        "Fix the tiers (each failure was logged at its save) and save again",
        newest.errors,
    )


def with_hint(exc: BaseException, hint: str) -> BaseException:
    """``exc`` (a load's error) with ``hint``, the framework's way out, added to its message
    in place: its type, cause and attributes stay what callers look at. The core's advice
    (``load(fallback=...)``) is a call these frameworks' users do not make."""
    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (f"{exc.args[0]}. {hint}",)
    return exc
