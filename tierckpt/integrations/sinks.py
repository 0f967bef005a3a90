"""Ready-made sinks: send checkpoint events to the logger a training run already has.

Each sink is an event callback (``Checkpointer(on_event=sink)`` or
``ck.add_event_callback(sink)``) that turns :class:`~tierckpt.stats.CheckpointEvent` s into
metrics named ``<prefix>/<tier>/<what>``: for a commit ``seconds``, ``gbps``, ``ratio``,
``stored_bytes`` and ``blocked_seconds``; for a failure, skip or deadline give-up the running
count of that outcome on that tier (``failed``, ``skipped``, ``deadline``; ``save_skipped``
under ``<prefix>/save_skipped``), at the event's step::

    from torch.utils.tensorboard import SummaryWriter
    from tierckpt.integrations.sinks import TensorBoardSink

    ck = tierckpt.Checkpointer(tiers, on_event=TensorBoardSink(SummaryWriter("runs/x")))

* :class:`TensorBoardSink`: a ``torch.utils.tensorboard.SummaryWriter`` (or tensorboardX's);
  failures also go to a text summary with their message.
* :class:`LightningLoggerSink`: any Lightning logger (``TensorBoardLogger``, ``CSVLogger``,
  ``WandbLogger``, ...) through ``log_metrics``.
* :class:`tierckpt.integrations.hf.TrainerLogSink`: a Hugging Face ``Trainer``'s own log
  (``trainer.log``, so every ``report_to`` integration gets the figures), written from the
  training thread at the next step end (``TrainerLogSink.attach(trainer, checkpointer)``);
  it lives with the HF integration, which needs ``transformers``.
* :func:`prometheus_text`: the Prometheus text exposition of a checkpointer's counters and
  last commits, to serve from any HTTP handler or write for node_exporter's textfile
  collector.

Callbacks run on tierckpt's background threads; the sinks serialize their calls with a lock
(the HF one queues and writes from the training thread). An exception in a sink is logged
and never fails a checkpoint.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

from tierckpt.stats import CheckpointEvent

if TYPE_CHECKING:
    from tierckpt.checkpointer import Checkpointer

__all__ = [
    "LightningLoggerSink",
    "OutcomeCounts",
    "TensorBoardSink",
    "event_metrics",
    "prometheus_text",
]


class OutcomeCounts:
    """Running counts of outcomes per tier (thread-safe): a failure's metric is its count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def bump(self, tier: str, kind: str) -> int:
        with self._lock:
            self._counts[(tier, kind)] += 1
            return self._counts[(tier, kind)]


def event_metrics(
    event: CheckpointEvent, prefix: str = "tierckpt", count: int | None = None
) -> dict[str, float]:
    """The metrics of one event: a commit's figures, or ``count`` (the running count of
    this outcome on this tier, default 1) for a failure, skip or give-up."""
    if event.kind == "committed" and event.result is not None:
        r = event.result
        base = f"{prefix}/{r.tier}"
        return {
            f"{base}/seconds": r.seconds,
            f"{base}/gbps": r.gbps,
            f"{base}/ratio": r.ratio,
            f"{base}/stored_bytes": float(r.stored_bytes),
            f"{base}/blocked_seconds": r.blocked_seconds,
        }
    where = f"{prefix}/{event.tier}/{event.kind}" if event.tier else f"{prefix}/{event.kind}"
    return {where: float(1 if count is None else count)}


class TensorBoardSink:
    """Write checkpoint events to a TensorBoard ``SummaryWriter`` (scalars; failures also as
    text with their message)."""

    def __init__(self, writer: Any, prefix: str = "tierckpt") -> None:
        self.writer = writer
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counts = OutcomeCounts()

    def __call__(self, event: CheckpointEvent) -> None:
        count = None if event.ok else self._counts.bump(event.tier, event.kind)
        metrics = event_metrics(event, self.prefix, count)
        with self._lock:
            for name, value in metrics.items():
                self.writer.add_scalar(name, value, event.step)
            if not event.ok:
                tag = f"{self.prefix}/{event.tier or 'save'}/errors"
                self.writer.add_text(tag, f"{event.kind}: {event.error}", event.step)


class LightningLoggerSink:
    """Send checkpoint events to a Lightning logger through ``logger.log_metrics``."""

    def __init__(self, logger: Any, prefix: str = "tierckpt") -> None:
        self.logger = logger
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counts = OutcomeCounts()

    def __call__(self, event: CheckpointEvent) -> None:
        count = None if event.ok else self._counts.bump(event.tier, event.kind)
        with self._lock:
            self.logger.log_metrics(event_metrics(event, self.prefix, count), step=event.step)


# -- Prometheus ------------------------------------------------------------------------------
def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(checkpointer: Checkpointer, prefix: str = "tierckpt") -> str:
    """The Prometheus text exposition (format 0.0.4) of ``checkpointer``'s figures: copies
    per tier and outcome (counters, since the checkpointer started) and the newest commit per
    tier (step, seconds, bytes, blocked seconds)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> str:
        full = f"{prefix}_{name}"
        lines.append(f"# HELP {full} {help_text}")
        lines.append(f"# TYPE {full} {kind}")
        return full

    name = family(
        "copies_total",
        "counter",
        "Copies of checkpoints per tier by outcome (committed, failed, skipped, deadline).",
    )
    for tier, counts in sorted(checkpointer.tier_counts().items()):
        for outcome, n in sorted(counts.items()):
            lines.append(f'{name}{{tier="{_label(tier)}",outcome="{_label(outcome)}"}} {n}')
    last: dict[str, Any] = {}
    for s in checkpointer.stats():
        last[s.tier] = s
    gauges = [
        ("last_commit_step", "Step of the newest checkpoint committed on the tier.", "step"),
        (
            "last_commit_seconds",
            "Seconds from save() to commit of the newest checkpoint.",
            "seconds",
        ),
        ("last_commit_raw_bytes", "Bytes of state in the newest checkpoint.", "raw_bytes"),
        ("last_commit_stored_bytes", "Bytes stored for the newest checkpoint.", "stored_bytes"),
        (
            "last_commit_blocked_seconds",
            "Seconds training waited for the newest checkpoint.",
            "blocked_seconds",
        ),
    ]
    for gname, help_text, attr in gauges:
        full = family(gname, "gauge", help_text)
        for tier, s in sorted(last.items()):
            lines.append(f'{full}{{tier="{_label(tier)}"}} {float(getattr(s, attr))!r}')
    return "\n".join(lines) + "\n"
