"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves through tierckpt.

::

    import lightning as L
    from tierckpt import LocalTier, MemoryTier, S3Tier
    from tierckpt.integrations.lightning import TierCkptIO

    io = TierCkptIO([MemoryTier(), LocalTier("/nvme/run1"), S3Tier("s3://bucket/run1")])
    trainer = L.Trainer(plugins=[io], callbacks=[L.pytorch.callbacks.ModelCheckpoint(
        dirpath="ckpts", every_n_train_steps=500, save_top_k=-1, save_last=True)])
    trainer.fit(model)                                   # checkpoints cost training ~nothing
    trainer.fit(model, ckpt_path="ckpts/last.ckpt")      # resume (any node, from S3 if need be)

(``save_last=True`` is what makes Lightning write ``ckpts/last.ckpt``.)

How it maps Lightning onto tierckpt:

* ``save_checkpoint(checkpoint, path)`` starts ``Checkpointer.save(checkpoint, global_step)``
  and returns at once; the bytes go through the tiers in the background. At ``path`` it writes
  a small JSON *pointer* (the step, its timeline and the tiers), so Lightning's file logic
  (``last.ckpt``, top-k bookkeeping, ``ckpt_path=...``) keeps working. Saves at one step share
  one checkpoint where their tensors are the same (``last`` and a top-k file): the pointer
  carries the small values that differ (the callbacks' bookkeeping, the loops' progress);
  other tensors or keys (a weights-only and a full checkpoint, a save after ``fit``) are a
  checkpoint of their own (:mod:`tierckpt.integrations._same_step`).
* Lightning runs forward and backward inside ``optimizer.step(closure)``; the plugin installs
  a global optimizer pre-hook that waits for an unfinished capture after the closure, right
  before the parameters change, so the copy overlaps the whole forward/backward pass. The
  hook also learns the optimizer and the LightningModule (from Lightning's closure), as
  ``Checkpointer.guard(optimizer, model)`` would: at a save, the module's buffers (BatchNorm
  statistics, which the next forward pass writes) are copied at once and its parameters,
  frozen ones included, captured lazily.
* ``load_checkpoint(path)`` reads the pointer and loads that checkpoint from the fastest tier
  that has it. Lightning writes the pointer when the save starts: where the job died before
  the checkpoint committed (or the save failed), the newest committed checkpoint before it
  on that run's history is loaded instead, with a warning. A path that is not a pointer (a
  ``.ckpt`` written by ``torch.save``) is loaded with Lightning's own ``TorchCheckpointIO``,
  so older runs still resume.
* ``remove_checkpoint(path)`` removes the pointer; the data follows each tier's
  ``keep_last`` retention. Retention never removes a step that a live pointer names
  (``best_model_path``, ``last.ckpt``, the top-k files): at each retention the plugin reads
  the pointers in the folders it wrote to or loaded from (so a restarted job protects the
  previous run's pointers too), and those steps are kept on every tier until Lightning
  removes their pointers. With ``save_top_k=-1`` Lightning keeps every pointer, and so
  tierckpt keeps every step: use ``save_top_k=k`` for retention.
* A failed save does not stop training (it is logged); where the fit's last checkpoint was
  committed on no tier, :meth:`TierCkptIO.teardown` raises ``CheckpointFailed`` at the end of
  the fit, as Lightning's ``AsyncCheckpointIO`` does.
* Preemption: at SIGTERM Lightning ends the step with ``SIGTERMException``; Lightning's own
  ``OnExceptionCheckpoint(dirpath)`` then saves that step through this plugin, and
  :meth:`TierCkptIO.teardown` waits until it is committed on every tier before the process
  ends (``fit(ckpt_path="last")`` resumes from it).
* Values tierckpt cannot store without pickle (objects in ``hyper_parameters``) are stored as
  their ``repr()`` text (see :func:`~tierckpt.integrations.sanitize_state`).
  ``LightningModule.load_from_checkpoint`` reads files with ``torch.load`` and does not go
  through plugins: use ``trainer.fit/validate(ckpt_path=...)``, or ``tierckpt export`` for
  the weights.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from typing import Any, Literal

import torch

from tierckpt.catalog import lineage
from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint
from tierckpt.format import CheckpointId
from tierckpt.handle import SaveHandle
from tierckpt.integrations._common import (
    closure_guard_hook,
    give_back_leases,
    lost_save,
    sanitize_state,
    with_hint,
)
from tierckpt.integrations._same_step import Described, describe, restore
from tierckpt.urls import TiersLike

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
except ImportError:  # pragma: no cover - the lightning extra is optional
    try:
        from lightning_fabric.utilities.cloud_io import get_filesystem  # type: ignore
        from pytorch_lightning.plugins.io import CheckpointIO, TorchCheckpointIO  # type: ignore
    except ImportError as exc:
        raise ImportError(
            "tierckpt.integrations.lightning needs PyTorch Lightning: pip install lightning"
        ) from exc

__all__ = ["POINTER_FORMAT", "TierCkptIO", "read_pointer"]

log = logging.getLogger("tierckpt")

POINTER_FORMAT = "tierckpt-lightning-pointer"
_MAX_POINTER = 64 << 10


def read_pointer(path: Any) -> dict[str, Any] | None:
    """The pointer at ``path``, or None if the file is not a tierckpt pointer."""
    fs = get_filesystem(path)
    with fs.open(path, "rb") as f:
        head = f.read(_MAX_POINTER + 1)
    if len(head) > _MAX_POINTER or not head.lstrip().startswith(b"{"):
        return None
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("format") != POINTER_FORMAT:
        return None
    if type(doc.get("step")) is not int:
        return None
    return doc


def _older_pointer(path: Any, step: int) -> str | None:
    """The pointer file beside ``path`` of the newest step before ``step`` (None: none)."""
    parent = _parent(path)
    best: tuple[int, str] | None = None
    try:
        names = get_filesystem(parent).ls(parent, detail=False)
    except Exception:  # a folder that cannot be listed: no hint, the error stands
        return None
    for name in names:
        if not str(name).endswith(".ckpt"):
            continue
        try:
            doc = read_pointer(name)
        except Exception:
            continue
        if doc is not None and doc["step"] < step and (best is None or doc["step"] > best[0]):
            best = (doc["step"], str(name))
    return None if best is None else best[1]


def _parent(path: Any) -> str:
    text = str(path)
    return text.rsplit("/", 1)[0] if "/" in text else "."


def _closure_modules(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.nn.Module]:
    """The LightningModule in Lightning's step closure, ``partial(_wrap_closure, model, ...)``.

    Found by type, not position; an unknown closure yields none, and the checkpointer then
    copies parameters missing from the optimizer at save() (and says so)."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if isinstance(closure, functools.partial):
        return [a for a in closure.args if isinstance(a, torch.nn.Module)]
    return []


class TierCkptIO(CheckpointIO):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` that saves through a tierckpt :class:`Checkpointer`.

    Args:
        tiers: tier specs fastest first, a :class:`TierPolicy`, or folder paths and URLs
            (``"/nvme/run1"``, ``"s3://bucket/run1"``; or pass ``checkpointer``).
        checkpointer: an existing :class:`Checkpointer` to use instead.
        unsupported: what to do with values that cannot be stored without pickle:
            ``"repr"`` (default) stores their text, ``"error"`` fails the save.
        **checkpointer_kwargs: passed to :class:`Checkpointer` (``host_buffer_bytes``, ...).
    """

    def __init__(
        self,
        tiers: TiersLike | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        unsupported: Literal["error", "repr"] = "repr",
        **checkpointer_kwargs: Any,
    ) -> None:
        super().__init__()
        if (tiers is None) == (checkpointer is None):
            raise ValueError("pass either tiers or checkpointer")
        self.checkpointer = checkpointer or Checkpointer(tiers, **checkpointer_kwargs)  # type: ignore[arg-type]
        self.unsupported = unsupported
        self._hook: Any = None
        # the checkpoint this plugin last stored: (step, timeline, its description); a save at
        # that step with the same tensors shares it (tierckpt.integrations._same_step)
        self._last: tuple[int, int, Described] | None = None
        #: the newest save of this fit, checked at teardown (committed on some tier?)
        self._newest: SaveHandle | None = None
        self._fallback = TorchCheckpointIO()
        #: folders holding this run's pointers: the steps they name are kept by retention
        self._pointer_dirs: set[str] = set()
        self._unprotect = self.checkpointer.protect_steps(self._live_pointer_steps)
        # from the start, so the optimizer and the module are known at the first save
        self._install_guard()

    def _install_guard(self) -> None:
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            wait = closure_guard_hook(self.checkpointer.wait_captured)
            checkpointer = self.checkpointer

            def learn_and_wait(opt: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                checkpointer._learn(opt, _closure_modules(args, kwargs))
                return wait(opt, args, kwargs)

            self._hook = register_optimizer_step_pre_hook(learn_and_wait)

    def _remove_guard(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # -- CheckpointIO --------------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError("TierCkptIO does not take storage_options; configure the tiers")
        step = int(checkpoint.get("global_step", 0))
        self._install_guard()
        described = describe(checkpoint)
        overrides: dict[str, Any] | None = None
        if self._last is not None and self._last[0] == step:
            overrides = described.overrides(self._last[2])
            if overrides is None:  # other content at this step: a checkpoint of its own
                log.info("step %d saved again with other tensors or keys (%s)", step, path)
                self.checkpointer._save_again()
        if overrides is None or self._last is None:
            state = sanitize_state(checkpoint, unsupported=self.unsupported)
            handle = self.checkpointer.save(state, step, metadata={"lightning_path": str(path)})
            self._last = (step, handle.timeline, described)
            self._newest = handle
            overrides = {}
        timeline = self._last[1]
        fs = get_filesystem(path)
        parent = _parent(path)
        fs.makedirs(parent, exist_ok=True)
        self._pointer_dirs.add(parent)
        pointer = {
            "format": POINTER_FORMAT,
            "version": 1,
            "step": step,
            "timeline": timeline,
            "tiers": self.checkpointer.tier_names,
        }
        if overrides:
            pointer["values"] = overrides
        with fs.open(path, "w") as f:
            f.write(json.dumps(pointer, indent=1) + "\n")

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        pointer = read_pointer(path)
        if pointer is None:
            log.info("%s is not a tierckpt pointer: loading it with torch.load", path)
            loaded: dict[str, Any] = self._fallback.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
            return loaded
        self._pointer_dirs.add(_parent(path))
        self.checkpointer.wait()  # a save from this process may still be flushing
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        step, timeline = int(pointer["step"]), pointer.get("timeline")
        timeline = timeline if type(timeline) is int else None  # pointers before timelines
        try:
            state: dict[str, Any] = self.checkpointer.load(
                step, timeline=timeline, map_location=device
            )
        except CheckpointNotFound:
            state = self._load_before(path, step, timeline, device)
        except CorruptCheckpoint as exc:
            older = _older_pointer(path, step)
            with_hint(
                exc,
                f"With Lightning, resume from an older checkpoint by its file: "
                f"trainer.fit(model, ckpt_path={older!r})"
                if older is not None
                else f"No older checkpoint file of tierckpt is in {_parent(path)}",
            )
            raise
        else:
            for key, value in (pointer.get("values") or {}).items():
                state[key] = restore(value)
        self._last = None
        return state

    def _load_before(
        self, path: Any, step: int, timeline: int | None, device: Any
    ) -> dict[str, Any]:
        """The newest committed checkpoint before the one ``path`` names, on its run's
        history: Lightning wrote the pointer when the save started, and the job died before
        that save committed (or it failed on every tier)."""
        ids = self.checkpointer.checkpoints()
        if timeline is None:  # the newest timeline holding the step, as load(step) takes
            timeline = max((c.timeline for c in ids if c.step <= step), default=0)
        target = CheckpointId(step, timeline)
        older = [c for c in lineage([*ids, target], target) if c != target]
        if not older:
            raise CheckpointNotFound(
                f"{path} names step {step}, which is not committed on any tier "
                f"({', '.join(self.checkpointer.tier_names)}), and no checkpoint before it is: "
                "the job ended before that save committed"
            )
        got = older[0]
        log.warning(
            "%s names step %d, which is not committed on any tier (the job ended before that "
            "save committed, or it failed): resuming from step %d, the newest committed "
            "checkpoint before it",
            path,
            step,
            got.step,
        )
        loaded: dict[str, Any] = self.checkpointer.load(
            got.step, timeline=got.timeline, map_location=device
        )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        fs = get_filesystem(path)
        if fs.exists(path):
            fs.rm(path, recursive=True)

    def _live_pointer_steps(self) -> set[int]:
        """The steps named by the pointer files now in the folders this plugin wrote to or
        loaded from (read from the files, so a restarted job sees them too)."""
        steps: set[int] = set()
        for folder in list(self._pointer_dirs):
            fs = get_filesystem(folder)
            if not fs.isdir(folder):
                continue
            for entry in fs.ls(folder, detail=True):
                if entry.get("type") != "file" or int(entry.get("size") or 0) > _MAX_POINTER:
                    continue
                name = str(entry["name"])
                if "://" in folder and "://" not in name:
                    name = folder.split("://", 1)[0] + "://" + name
                try:
                    pointer = read_pointer(name)
                except FileNotFoundError:
                    continue  # removed meanwhile
                if pointer is not None:
                    steps.add(int(pointer["step"]))
        return steps

    def teardown(self) -> None:
        """End of a fit: wait until every checkpoint is committed on every tier, then give
        the writer's leases back (the next save takes them again), so that another
        ``TierCkptIO`` of this process on the same tiers (a second ``Trainer``, the retry of a
        failed fit) saves there while this one is still referenced.

        Raises :class:`~tierckpt.errors.CheckpointFailed` where the fit's newest checkpoint
        was committed on no tier (every tier failed it, as when every save of the run
        failed), as Lightning's ``AsyncCheckpointIO`` raises a failed save here: the job must
        not end as if its final state were saved. Not while the fit is failing already (its
        own error goes on; this one is logged)."""
        self.checkpointer.wait()
        self._remove_guard()
        give_back_leases(self.checkpointer)  # a new IO of this process saves there at once
        newest, self._newest = self._newest, None
        lost = lost_save(newest, self.checkpointer, "fit")
        if lost is not None and sys.exc_info()[1] is not None:
            log.error("%s", lost)
        elif lost is not None:
            raise lost

    def close(self) -> None:
        """Wait for pending saves and release the checkpointer (threads, host buffer)."""
        self._remove_guard()
        self.checkpointer.close()
