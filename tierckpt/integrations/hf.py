"""Hugging Face ``transformers``: a ``TrainerCallback`` that checkpoints through tierckpt.

::

    from transformers import Trainer, TrainingArguments
    from tierckpt import LocalTier, MemoryTier, S3Tier
    from tierckpt.integrations.hf import TierCkptCallback

    cb = TierCkptCallback([MemoryTier(), LocalTier("/nvme/run1"), S3Tier("s3://bucket/run1")])
    args = TrainingArguments("out", save_strategy="steps", save_steps=500, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()

    # on a new node: rebuild a Hugging Face checkpoint folder from the tiers, then resume
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.materialize("out"))

On each save step (whenever the ``Trainer`` would save: ``save_steps``, ``save_strategy``, the
end of training) the callback starts ``Checkpointer.save()`` with the model, optimizer and
scheduler state, the ``TrainerState`` and every RNG state, and returns at once; the optimizer
waits only if the copy is still unfinished at the next update. With ``replace_hf_save=True``
(default) it also tells the ``Trainer`` to skip its own synchronous ``torch.save`` of the
same state; set it False to keep both.

``materialize(dir, step=None)`` writes the newest (or ``step``) checkpoint as the folder
``dir/checkpoint-<step>`` that ``Trainer.train(resume_from_checkpoint=...)`` expects
(``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``): a resume continues exactly where the saved run was, data order
included.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from tierckpt.checkpointer import Checkpointer
from tierckpt.integrations._common import sanitize_state
from tierckpt.policy import TierPolicy, TierSpec

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - the transformers extra is optional
    raise ImportError(
        "tierckpt.integrations.hf needs Hugging Face transformers: pip install transformers"
    ) from exc

__all__ = ["TierCkptCallback", "rng_states", "set_rng_states"]

log = logging.getLogger("tierckpt")


def rng_states() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) RNG states in a form tierckpt stores."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)},
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


class TierCkptCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the ``Trainer``'s full training state through tierckpt on every save step.

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy` (or pass ``checkpointer``).
        checkpointer: an existing :class:`Checkpointer` to use instead.
        replace_hf_save: skip the ``Trainer``'s own blocking save on those steps (default True).
        unsupported: values that cannot be stored without pickle: ``"repr"`` stores their
            text, ``"error"`` fails the save.
        **checkpointer_kwargs: passed to :class:`Checkpointer`.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec] | TierPolicy | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        replace_hf_save: bool = True,
        unsupported: Literal["error", "repr"] = "repr",
        **checkpointer_kwargs: Any,
    ) -> None:
        if (tiers is None) == (checkpointer is None):
            raise ValueError("pass either tiers or checkpointer")
        self.checkpointer = checkpointer or Checkpointer(tiers, **checkpointer_kwargs)  # type: ignore[arg-type]
        self.replace_hf_save = replace_hf_save
        self.unsupported = unsupported
        self._guarded: Any = None
        self._hook: Any = None
        # steps this callback saved since it last materialized one, and that one: saving them
        # again would repeat the same state. Not the steps committed on the tiers: after a
        # resume from an older step those belong to the abandoned run (see Checkpointer.load)
        self._saved: set[int] = set()

    # -- TrainerCallback -----------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        optimizer = kwargs.get("optimizer")
        # Accelerate wraps the optimizer; the hook goes on the one whose step() updates
        inner = getattr(optimizer, "optimizer", optimizer)
        if isinstance(inner, torch.optim.Optimizer) and inner is not self._guarded:
            if self._hook is not None:
                self._hook.remove()
            # with the model: its frozen parameters (a LoRA base) stay lazy, buffers are copied
            model = kwargs.get("model")
            self._hook = self.checkpointer.guard(
                inner, model if isinstance(model, torch.nn.Module) else None
            )
            self._guarded = inner

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if control.should_save:
            self.save(state, kwargs.get("model"), kwargs.get("optimizer"),
                      kwargs.get("lr_scheduler"), control)
            if self.replace_hf_save:
                control.should_save = False
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        self.checkpointer.wait()  # every checkpoint committed on every tier before returning

    # -- saving ---------------------------------------------------------------------------------
    def save(self, state: TrainerState, model: Any, optimizer: Any, lr_scheduler: Any,
             control: TrainerControl | None = None) -> None:
        """Start saving the training state as ``state.global_step`` (returns at once)."""
        step = int(state.global_step)
        if step in self._saved:
            return
        if model is None or optimizer is None:
            raise ValueError("TierCkptCallback needs the model and optimizer from the Trainer")
        inner = getattr(optimizer, "optimizer", optimizer)
        if control is not None and isinstance(state.stateful_callbacks, dict):
            # as Trainer._save_checkpoint does: the control flags travel with the state
            state.stateful_callbacks["TrainerControl"] = control.state()
        trainer_state = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        ckpt: dict[str, Any] = {
            "model": model.state_dict(),
            "optimizer": inner.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
            "trainer_state": trainer_state,
            "rng": rng_states(),
            "global_step": step,
        }
        self.checkpointer.save(sanitize_state(ckpt, unsupported=self.unsupported), step,
                               metadata={"framework": "transformers"})
        self._saved.add(step)

    # -- resuming -------------------------------------------------------------------------------
    def materialize(self, output_dir: str, step: int | None = None) -> str:
        """Write checkpoint ``step`` (default: newest committed) as a ``Trainer`` checkpoint
        folder ``output_dir/checkpoint-<step>``; returns its path for ``resume_from_checkpoint``.
        """
        from safetensors.torch import save_file

        self.checkpointer.wait()
        ckpt = self.checkpointer.load(step)
        step = int(ckpt["global_step"])
        self._saved = {step}  # the run resumes here: later steps are saved again
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        os.makedirs(folder, exist_ok=True)
        # one contiguous tensor per name (tied weights are written under both names)
        weights = {k: v.detach().contiguous().clone() for k, v in ckpt["model"].items()}
        save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        torch.save(ckpt["optimizer"], os.path.join(folder, "optimizer.pt"))
        if ckpt["lr_scheduler"] is not None:
            torch.save(ckpt["lr_scheduler"], os.path.join(folder, "scheduler.pt"))
        rng = ckpt["rng"]
        hf_rng: dict[str, Any] = {"python": _as_python_rng(rng["python"]),
                                  "numpy": _numpy_state(rng["numpy"]), "cpu": rng["cpu"]}
        if "cuda" in rng:
            hf_rng["cuda"] = rng["cuda"]
        torch.save(hf_rng, os.path.join(folder, "rng_state.pth"))
        with open(os.path.join(folder, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(ckpt["trainer_state"])
        with open(os.path.join(folder, "tierckpt.json"), "w", encoding="utf-8") as f:
            json.dump({"step": step, "tiers": self.checkpointer.tier_names}, f)
        log.info("materialized step %d into %s", step, folder)
        return folder

    def close(self) -> None:
        """Wait for pending saves and release the checkpointer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.checkpointer.close()

