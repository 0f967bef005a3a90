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

On each save (whenever the ``Trainer`` would save: every event that sets
``control.should_save``, so ``save_strategy="steps"``, ``"epoch"`` and ``"best"``, and the end
of training) the callback starts ``Checkpointer.save()`` with the model, optimizer and
scheduler state, the ``TrainerState`` and every RNG state, and returns at once; the optimizer
waits only if the copy is still unfinished at the next update. When an evaluation follows the
save step, the save waits for its metrics (as the ``Trainer``'s own save does), so the stored
``TrainerState`` holds them. With ``replace_hf_save=True`` (default) it also tells the
``Trainer`` to skip its own synchronous ``torch.save`` of the same state; set it False to keep
both.

``load_best_model_at_end=True`` works as with the ``Trainer``'s own saves: the callback tracks
``metric_for_best_model`` / ``greater_is_better``, sets ``state.best_metric``,
``best_global_step`` and ``best_model_checkpoint`` (``<output_dir>/checkpoint-<step>``), and
pins the best step on every tier (``Checkpointer.pin``), so retention never removes it
whatever ``keep_last`` says; the previous best is unpinned. At the end of training, right
before the ``Trainer`` loads the best model, the best checkpoint is materialized into that
folder, so the ``Trainer`` loads it as usual.

``preemption=True`` (or the signals to take instead of SIGTERM): from ``train()`` on, a
SIGTERM makes the ``Trainer`` save the step it is at and stop (:class:`tierckpt.Preemption`).

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
import signal
import threading
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from tierckpt.checkpointer import Checkpointer
from tierckpt.integrations._common import sanitize_state
from tierckpt.integrations.sinks import OutcomeCounts, event_metrics
from tierckpt.policy import TierPolicy, TierSpec
from tierckpt.preemption import Preemption
from tierckpt.stats import CheckpointEvent

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - the transformers extra is optional
    raise ImportError(
        "tierckpt.integrations.hf needs Hugging Face transformers: pip install transformers"
    ) from exc

__all__ = ["TierCkptCallback", "TrainerLogSink", "rng_states", "set_rng_states"]

log = logging.getLogger("tierckpt")


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


class TierCkptCallback(TrainerCallback):  # type: ignore[misc]
    """Saves the ``Trainer``'s full training state through tierckpt on every save step.

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy` (or pass ``checkpointer``).
        checkpointer: an existing :class:`Checkpointer` to use instead.
        replace_hf_save: skip the ``Trainer``'s own blocking save on those steps (default True).
        unsupported: values that cannot be stored without pickle: ``"repr"`` stores their
            text, ``"error"`` fails the save.
        preemption: ``True`` (SIGTERM) or the signals that ask the job to stop: from
            ``train()`` on, such a signal makes the ``Trainer`` save the step it is at and stop
            training (:class:`tierckpt.Preemption`; every rank stops after the same step). Off
            by default: it replaces the signals' handlers while training.
        **checkpointer_kwargs: passed to :class:`Checkpointer`.
    """

    def __init__(
        self,
        tiers: Sequence[TierSpec] | TierPolicy | None = None,
        *,
        checkpointer: Checkpointer | None = None,
        replace_hf_save: bool = True,
        unsupported: Literal["error", "repr"] = "repr",
        preemption: bool | Sequence[int] = False,
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
        #: a save step whose evaluation follows: saved once its metrics are known
        self._pending: int | None = None
        #: whether the best checkpoint was materialized for the Trainer's load at the end
        self._best_ready = False
        #: the best step before the newest best (unpinned once the new one is pinned)
        self._previous_best: int | None = None
        self._stop_signals: tuple[int, ...] = (
            (signal.SIGTERM,) if preemption is True else tuple(preemption or ())
        )
        self._stop: Preemption | None = None

    # -- TrainerCallback -----------------------------------------------------------------------
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
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

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        # save_strategy="epoch": the Trainer sets should_save here, not at a step end
        return self._maybe_save(state, control, kwargs)

    def _maybe_save(
        self, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]
    ) -> TrainerControl:
        if control.should_save:
            if control.should_evaluate:
                # an evaluation runs before the Trainer would save: save after it, with its
                # metrics in the state (and the best known), as the Trainer does
                self._pending = int(state.global_step)
            else:
                self.save(
                    state,
                    kwargs.get("model"),
                    kwargs.get("optimizer"),
                    kwargs.get("lr_scheduler"),
                    control,
                )
            if self.replace_hf_save:
                control.should_save = False
        return control

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        step = int(state.global_step)
        new_best = self._track_best(args, state, kwargs.get("metrics"))
        pending, self._pending = self._pending, None
        strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
        if pending == step or (strategy == "best" and new_best):
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
        if "train_runtime" in logs:
            # the Trainer's last log of a train(): next it loads the best model, if asked
            self._prepare_best(args, state)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
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
        if not os.path.isdir(folder):
            self.checkpointer.wait()
            self._write_folder(folder, self.checkpointer.load(step), step)
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
        self.checkpointer.save(
            sanitize_state(ckpt, unsupported=self.unsupported),
            step,
            metadata={"framework": "transformers"},
        )
        self._saved.add(step)

    # -- resuming -------------------------------------------------------------------------------
    def materialize(self, output_dir: str, step: int | None = None) -> str:
        """Write checkpoint ``step`` (default: newest committed) as a ``Trainer`` checkpoint
        folder ``output_dir/checkpoint-<step>``; returns its path for ``resume_from_checkpoint``.
        """
        self.checkpointer.wait()
        ckpt = self.checkpointer.load(step)
        step = int(ckpt["global_step"])
        self._saved = {step}  # the run resumes here: later steps are saved again
        folder = os.path.join(output_dir, f"checkpoint-{step}")
        self._write_folder(folder, ckpt, step)
        return folder

    def _write_folder(self, folder: str, ckpt: dict[str, Any], step: int) -> None:
        """Write ``ckpt`` as a ``Trainer`` checkpoint folder."""
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
            json.dump({"step": step, "tiers": self.checkpointer.tier_names}, f)
        log.info("materialized step %d into %s", step, folder)

    def close(self) -> None:
        """Wait for pending saves and release the checkpointer."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.checkpointer.close()


class TrainerLogSink(TrainerCallback):  # type: ignore[misc]
    """Checkpoint events into a ``Trainer``'s log: ``TrainerLogSink.attach(trainer, ck)``
    (metric names as in :mod:`tierckpt.integrations.sinks`).

    As an event callback it queues each event's metrics (from a background thread); as a
    ``TrainerCallback`` it writes the queue with ``trainer.log`` from the training thread at
    the next step end, epoch end or end of training, so TensorBoard, W&B, MLflow (whatever
    ``report_to`` names) receive them with the Trainer's own figures.
    """

    def __init__(self, trainer: Any, prefix: str = "tierckpt") -> None:
        self.trainer = trainer
        self.prefix = prefix
        self._lock = threading.Lock()
        self._queue: list[dict[str, float]] = []
        self._counts = OutcomeCounts()

    @classmethod
    def attach(
        cls, trainer: Any, checkpointer: Checkpointer, prefix: str = "tierckpt"
    ) -> TrainerLogSink:
        """A sink registered with both ``trainer`` (a callback) and ``checkpointer`` (an
        event callback); returns it."""
        sink = cls(trainer, prefix=prefix)
        trainer.add_callback(sink)
        checkpointer.add_event_callback(sink)
        return sink

    def __call__(self, event: CheckpointEvent) -> None:
        count = None if event.ok else self._counts.bump(event.tier, event.kind)
        metrics = event_metrics(event, self.prefix, count)
        metrics[f"{self.prefix}/step"] = float(event.step)
        with self._lock:
            self._queue.append(metrics)

    def flush(self) -> None:
        """Write the queued events with ``trainer.log`` (call from the training thread)."""
        with self._lock:
            queued, self._queue = self._queue, []
        for metrics in queued:
            self.trainer.log(metrics)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.flush()

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.flush()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.flush()
