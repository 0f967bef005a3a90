"""``TrainerLogSink``: checkpoint events into a Hugging Face ``Trainer``'s log (re-exported by
:mod:`tierckpt.integrations.hf`)."""

from __future__ import annotations

import threading
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from tierckpt.checkpointer import Checkpointer
from tierckpt.integrations.sinks import OutcomeCounts, event_metrics
from tierckpt.stats import CheckpointEvent

__all__ = ["TrainerLogSink"]


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
