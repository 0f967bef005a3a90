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

On each save (every event that sets ``control.should_save``: ``save_strategy="steps"``,
``"epoch"``, ``"best"``, the end of training) the callback starts ``Checkpointer.save()`` of
the model, optimizer and scheduler state, the ``TrainerState`` and every RNG state, and returns
at once; the optimizer waits only for a copy unfinished at the next update. The save starts
where the ``Trainer``'s own would, after it logged and evaluated that step, so the stored
``TrainerState`` holds the step's log entry and metrics (``total_flos`` only where the step is
logged). Two save events of one step share a checkpoint. Each ``train()`` saves its own steps
(a reused callback saves them again, on a new timeline). A failed save is logged and training
goes on; a ``train()`` whose last checkpoint was committed on no tier ends with
``CheckpointFailed``. ``replace_hf_save=True`` (default) makes the ``Trainer`` skip its own
``torch.save`` of the same state; set it False to keep both.

``load_best_model_at_end=True`` works as with the ``Trainer``'s own saves: the callback tracks
``metric_for_best_model`` / ``greater_is_better``, sets ``state.best_metric``,
``best_global_step`` and ``best_model_checkpoint`` (``<output_dir>/checkpoint-<step>``), and
pins the best step on every tier (``Checkpointer.pin``), so retention never removes it
whatever ``keep_last`` says; the previous best is unpinned. At the end of training, right
before the ``Trainer`` loads the best model, this run's best checkpoint is materialized into
that folder, replacing a folder there that holds another checkpoint (another run's in a shared
``output_dir``, an abandoned timeline's): the ``Trainer`` loads it as usual.

``preemption=True`` (or the signals to take instead of SIGTERM): from ``train()`` on, a
SIGTERM makes the ``Trainer`` save the step it is at and stop (:class:`tierckpt.Preemption`).

``materialize(dir, step=None)`` writes the newest (or ``step``) checkpoint as the folder
``dir/checkpoint-<step>`` that ``Trainer.train(resume_from_checkpoint=...)`` expects
(``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``, and ``tierckpt.json``: step, timeline, save id, tier locations): a
resume continues exactly where the saved run was, data order included. ``train(
resume_from_checkpoint=True)`` works too: when the ``Trainer`` is built (``on_init_end``,
before ``train()`` looks in ``output_dir``) the tiers' newest checkpoint is written there if a
``Trainer`` of this ``output_dir`` saved it and no ``checkpoint-<n>`` folder there is as new
(one process only; ``resume_folder=False``: never).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import torch

from tierckpt.checkpointer import Checkpointer
from tierckpt.errors import CheckpointNotFound, CorruptCheckpoint
from tierckpt.handle import SaveHandle
from tierckpt.integrations._common import (
    checkpoint_identity,
    folder_holds,
    give_back_leases,
    lost_save,
    rng_states,
    sanitize_state,
    set_rng_states,
    with_hint,
    write_checkpoint,
)
from tierckpt.preemption import Preemption
from tierckpt.urls import TiersLike

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - the transformers extra is optional
    raise ImportError(
        "tierckpt.integrations.hf needs Hugging Face transformers: pip install transformers"
    ) from exc

from tierckpt.integrations._hf_log import TrainerLogSink

__all__ = ["TierCkptCallback", "TrainerLogSink", "rng_states", "set_rng_states"]

log = logging.getLogger("tierckpt")

_CKPT_DIR = re.compile(r"checkpoint-(\d+)")


class TierCkptCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the ``Trainer``'s full training state through tierckpt on every save step.

    Args:
        tiers: tier specs fastest first, a :class:`TierPolicy`, or folder paths and URLs
            (``"/nvme/run1"``, ``"s3://bucket/run1"``; or pass ``checkpointer``).
        checkpointer: an existing :class:`Checkpointer` to use instead.
        replace_hf_save: skip the ``Trainer``'s own blocking save on those steps (default True).
        unsupported: values that cannot be stored without pickle: ``"repr"`` stores their
            text, ``"error"`` fails the save.
        preemption: ``True`` (SIGTERM) or the signals that ask the job to stop: from
            ``train()`` on, such a signal makes the ``Trainer`` save the step it is at and stop
            training (:class:`tierckpt.Preemption`; every rank stops after the same step). Off
            by default: it replaces the signals' handlers while training.
        resume_folder: write the newest checkpoint into ``output_dir`` for
            ``train(resume_from_checkpoint=True)`` when the ``Trainer`` is built (see above).
        **checkpointer_kwargs: passed to :class:`Checkpointer`.
    """

    def __init__(
        self,
        tiers: TiersLike | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        replace_hf_save: bool = True,
        unsupported: Literal["error", "repr"] = "repr",
        preemption: bool | Sequence[int] = False,
        resume_folder: bool = True,
        **checkpointer_kwargs: Any,
    ) -> None:
        if (tiers is None) == (checkpointer is None):
            raise ValueError("pass either tiers or checkpointer")
        self.checkpointer = checkpointer or Checkpointer(tiers, **checkpointer_kwargs)  # type: ignore[arg-type]
        self.replace_hf_save = replace_hf_save
        self.unsupported = unsupported
        self.resume_folder = resume_folder
        self._guarded: Any = None
        self._hook: Any = None
        # steps this train() saved, and the one it resumed from: saved again, they would repeat
        # that state. Not the tiers' steps: an earlier train()'s are another run's
        self._saved: set[int] = set()
        #: a save step waiting for the Trainer to log it (or evaluate it: "evaluate")
        self._pending: int | None = None
        self._pending_until: str | None = None
        #: the Trainer's output_dir (absolute), recorded with each save
        self._output_dir: str | None = None
        self._best_ready = False  # the best checkpoint materialized for the Trainer's load
        self._newest: SaveHandle | None = None  # this train()'s last save, checked at its end
        #: the best step before the newest best (unpinned once the new one is pinned)
        self._previous_best: int | None = None
        self._stop_signals: tuple[int, ...] = (
            (signal.SIGTERM,) if preemption is True else tuple(preemption or ())
        )
        self._stop: Preemption | None = None

    # -- TrainerCallback -----------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # the last hook before train(resume_from_checkpoint=True) looks into output_dir
        if self.resume_folder and args.world_size == 1:
            self._offer_resume(str(args.output_dir))

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # a new train() saves its own steps, whatever an earlier one saved; the state is the
        # resumed one here (step 0 when not resuming): that step is not saved again
        out = getattr(args, "output_dir", None)
        self._output_dir = None if out is None else os.path.abspath(str(out))
        resumed = int(getattr(state, "global_step", 0) or 0)
        self._saved = {resumed} if resumed else set()
        self._pending = None
        # its first save chooses its timeline as after a load(): a step not after the newest
        # (an earlier run's last one too) goes on a new timeline
        self.checkpointer._new_run()
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
        if self._stop_signals and self._stop is None:
            self._stop = Preemption(self._stop_signals)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if self._stop is not None and self._stop.check():
            # asked to stop: this step is saved now (no evaluation first) and training ends
            control.should_save = True
            control.should_evaluate = False
            control.should_training_stop = True
        return self._maybe_save(state, control, kwargs)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush(state, control, kwargs)  # its log or evaluation did not come

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._flush(state, control, kwargs)
        # save_strategy="epoch": the Trainer sets should_save here, not at a step end
        return self._maybe_save(state, control, kwargs)

    def _maybe_save(
        self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]
    ) -> TrainerControl:
        step = int(state.global_step)
        if control.should_save and step not in self._saved:
            # saved once the Trainer logged and evaluated this step, where its own save is:
            # no update runs before (the next one waits for the save's capture)
            self._pending = step
            self._pending_until = (
                "evaluate" if control.should_evaluate else "log" if control.should_log else None
            )
            if self._pending_until is None:
                self._flush(state, control, kwargs)
        if control.should_save and self.replace_hf_save:
            control.should_save = False
        return control

    def _flush(self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]) -> None:
        """Start the pending save, if any."""
        if self._pending is None:
            return
        self._pending = None
        if isinstance(state.stateful_callbacks, dict):
            # the control flags as Trainer._save_checkpoint stores them (should_save is set)
            flags = control.state()
            flags["args"]["should_save"] = True
            state.stateful_callbacks["TrainerControl"] = flags
        self.save(state, kwargs.get("model"), kwargs.get("optimizer"), kwargs.get("lr_scheduler"))

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        step = int(state.global_step)
        new_best = self._track_best(args, state, kwargs.get("metrics"))
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        if self._pending is not None:
            self._flush(state, control, kwargs)
        elif strategy == "best" and new_best:
            self.save(
                state,
                kwargs.get("model"),
                kwargs.get("optimizer"),
                kwargs.get("lr_scheduler"),
                control,
            )
        if new_best and step in self._saved:
            self._pin_best(state, step)
        return control

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        logs = kwargs.get("logs") or {}
        if self._pending_until != "evaluate" or "train_runtime" in logs:
            self._flush(state, control, kwargs)  # the step's log is in state.log_history now
        if "train_runtime" in logs:
            # the Trainer's last log of a train(): next it loads the best model, if asked
            self._prepare_best(args, state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._flush(state, control, kwargs)
        if self._stop is not None:
            self._stop.close()
            self._stop = None
        self.checkpointer.wait()  # every checkpoint committed on every tier before returning
        if args.load_best_model_at_end and not self._best_ready:
            # the Trainer's end-of-training log was not seen (another transformers version):
            # load the best weights here, so the promise holds either way
            folder = self._prepare_best(args, state)
            model = kwargs.get("model")
            best_step = state.best_global_step
            if folder is not None and best_step is not None and isinstance(model, torch.nn.Module):
                log.warning("loading the best checkpoint %s into the model at on_train_end", folder)
                best = self.checkpointer.load(int(best_step))
                model.load_state_dict(best["model"], strict=False)
        self._best_ready = False
        give_back_leases(self.checkpointer)  # a new Trainer of this process saves there at once
        newest, self._newest = self._newest, None
        lost = lost_save(newest, self.checkpointer, "train()")  # as a failed torch.save would
        if lost is not None:
            raise lost

    # -- the best checkpoint (load_best_model_at_end) -------------------------------------------
    def _track_best(
        self, args: TrainingArguments, state: TrainerState, metrics: dict[str, float] | None
    ) -> bool:
        """As ``Trainer._determine_best_metric``, before it: whether these metrics are a new
        best; if so the state says so (the Trainer then finds them equal, not better)."""
        name = args.metric_for_best_model
        if name is None or not metrics:
            return False
        if not name.startswith("eval_"):
            name = f"eval_{name}"
        value = metrics.get(name)
        if value is None:
            return False  # the Trainer raises its own KeyError naming the metric
        value = float(value)
        if state.best_metric is None:
            better = True
        elif args.greater_is_better:
            better = value > state.best_metric
        else:
            better = value < state.best_metric
        if not better:
            return False
        previous = state.best_global_step
        step = int(state.global_step)
        state.best_metric = value
        state.best_global_step = step
        if args.load_best_model_at_end:
            # the folder is materialized before the Trainer loads it (_prepare_best)
            state.best_model_checkpoint = os.path.join(str(args.output_dir), f"checkpoint-{step}")
        self._previous_best = previous
        return True

    def _pin_best(self, state: TrainerState, step: int) -> None:
        """Keep the best step on every tier; let the previous best go."""
        self.checkpointer.pin(step, reason="transformers best_model_checkpoint")
        previous = self._previous_best
        if previous is not None and int(previous) != step:
            self.checkpointer.unpin(int(previous))

    def _prepare_best(self, args: TrainingArguments, state: TrainerState) -> str | None:
        """Materialize the best checkpoint where ``state.best_model_checkpoint`` says (the
        Trainer loads it from there at the end of training); returns that folder."""
        if not args.load_best_model_at_end or state.best_global_step is None:
            return None
        step = int(state.best_global_step)
        folder = os.path.join(str(args.output_dir), f"checkpoint-{step}")
        self.checkpointer.wait()
        # rewritten where it is not this run's checkpoint of that step (another run's, an older
        # timeline's), unless the Trainer's own save wrote it (replace_hf_save=False)
        ours = os.path.exists(os.path.join(folder, "tierckpt.json"))
        if self.replace_hf_save or ours or not os.path.isdir(folder):
            try:
                ident = checkpoint_identity(self.checkpointer, step)
            except CheckpointNotFound:
                if not os.path.isdir(folder):
                    raise
                log.warning("best step %d is on no tier: %s is loaded unchecked", step, folder)
            else:
                if not folder_holds(folder, ident):
                    write_checkpoint(self.checkpointer, folder, ident)
        state.best_model_checkpoint = folder
        self._best_ready = True
        return folder

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self,
        state: TrainerState,
        model: Any,
        optimizer: Any,
        lr_scheduler: Any,
        control: TrainerControl | None = None,
    ) -> None:
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
        # a save id names this checkpoint in the folders materialized from it (tierckpt.json)
        meta = {"framework": "transformers", "save_id": uuid.uuid4().hex}
        if self._output_dir is not None:
            meta["output_dir"] = self._output_dir
        clean = sanitize_state(ckpt, unsupported=self.unsupported)
        self._newest = self.checkpointer.save(clean, step, metadata=meta)
        self._saved.add(step)

    # -- resuming -------------------------------------------------------------------------------
    def materialize(self, output_dir: str, step: int | None = None) -> str:
        """Write checkpoint ``step`` (default: newest committed) as a ``Trainer`` checkpoint
        folder ``output_dir/checkpoint-<step>``; returns its path for ``resume_from_checkpoint``.
        A folder there that holds another checkpoint (see its ``tierckpt.json``) is replaced."""
        self.checkpointer.wait()
        ident = checkpoint_identity(self.checkpointer, step)
        folder = os.path.join(output_dir, f"checkpoint-{ident['step']}")
        if folder_holds(folder, ident):
            self.checkpointer._forget_timeline()  # as its load would: the run resumes there
        else:
            write_checkpoint(self.checkpointer, folder, ident)
        return folder

    def _offer_resume(self, output_dir: str) -> None:
        """Write the newest committed checkpoint into ``output_dir`` for
        ``train(resume_from_checkpoint=True)``: only one saved by a ``Trainer`` of this
        ``output_dir``, and only where no ``checkpoint-<n>`` folder there is as new."""
        try:
            ident = checkpoint_identity(self.checkpointer)
        except CheckpointNotFound:
            return
        except Exception as exc:  # a store that does not answer: HF's own idiom fails as usual
            log.warning("tiers not listed, %s/checkpoint-* not prepared: %s", output_dir, exc)
            return
        target = os.path.join(output_dir, f"checkpoint-{ident['step']}")
        if ident["output_dir"] != os.path.abspath(output_dir):
            log.info("newest checkpoint is another output_dir's: not written to %s", target)
            return
        names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
        steps = [int(m.group(1)) for m in map(_CKPT_DIR.fullmatch, names) if m]
        if any(n > ident["step"] for n in steps) or folder_holds(target, ident):
            return
        if os.path.isdir(target) and not os.path.exists(os.path.join(target, "tierckpt.json")):
            log.warning("%s is not from the tiers: resume_from_checkpoint=True takes it", target)
            return
        loaded = self.checkpointer._has_loaded  # nothing is resumed yet: a later save that
        try:  # goes back is still warned about
            write_checkpoint(self.checkpointer, target, ident)
        except CorruptCheckpoint as exc:
            with_hint(
                exc,
                "With the Trainer: build it with TierCkptCallback(..., resume_folder=False), "
                "then resume from an older step with trainer.train(resume_from_checkpoint="
                f"callback.materialize({output_dir!r}, step=<an older step>))",
            )
            raise
        self.checkpointer._has_loaded = loaded

    def close(self) -> None:
        """Wait for pending saves and release the checkpointer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.checkpointer.close()
