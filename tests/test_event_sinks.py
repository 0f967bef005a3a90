"""Observability: failures, skips and give-ups reach callbacks and stats(); blocked time in
TierResult; the ready-made sinks with the real TensorBoard, Lightning, Hugging Face and
Prometheus packages."""

from __future__ import annotations

import errno
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

import tierckpt
from tierckpt import Checkpointer, LocalTier

if TYPE_CHECKING:
    from tierckpt.stats import CheckpointEvent


class _Events:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[CheckpointEvent] = []

    def __call__(self, e: CheckpointEvent) -> None:
        with self.lock:
            self.items.append(e)

    def kinds(self) -> list[tuple[str, str, int]]:
        with self.lock:
            return sorted((e.kind, e.tier, e.step) for e in self.items)


def _disk_full(backend: Any) -> None:
    def open_writer(name: str) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device", name)

    backend.open_writer = open_writer


def _gate(backend: Any) -> threading.Event:
    """Every write to ``backend`` waits for the returned event (a stalled link)."""
    real = backend.open_writer
    gate = threading.Event()

    def open_writer(name: str) -> Any:
        w = real(name)
        write = w.write

        def gated(offset: int, data: Any) -> None:
            assert gate.wait(60), "the test never opened the gate"
            write(offset, data)

        w.write = gated
        return w

    backend.open_writer = open_writer
    return gate


def test_failures_reach_event_callbacks_and_stats(tmp_path: Path) -> None:
    events, commits = _Events(), []
    tiers = [LocalTier(tmp_path / "ok"), LocalTier(tmp_path / "full", name="full")]
    with Checkpointer(tiers, on_commit=commits.append, on_event=events) as ck:
        _disk_full(ck.backend("full"))
        h = ck.save({"w": torch.ones(1024)}, 1)
        with pytest.raises(tierckpt.CheckpointFailed):
            h.wait(timeout=60)
        # the on_commit callback keeps its old contract: commits only, TierResult
        assert [(r.tier, r.step) for r in commits] == [("local", 1)]
        assert events.kinds() == [("committed", "local", 1), ("failed", "full", 1)]
        failed = next(e for e in events.items if e.kind == "failed")
        assert "No space left" in (failed.error or "") and failed.error_type == "OSError"
        assert [s.tier for s in ck.stats()] == ["local"]  # compatible: commits only
        every = ck.stats(failures=True)
        assert sorted((s.tier, s.outcome) for s in every) == [
            ("full", "failed"),
            ("local", "committed"),
        ]
        assert "No space left" in (next(s for s in every if s.outcome == "failed").error or "")
        # blocked time travels with the result
        r = h.results["local"]
        assert 0 < r.blocked_seconds <= h.blocked_seconds
        assert commits[0].blocked_seconds == r.blocked_seconds


def test_deadline_give_up_is_an_event(tmp_path: Path) -> None:
    events = _Events()
    tiers = [LocalTier(tmp_path / "fast"), LocalTier(tmp_path / "slow", name="slow")]
    with Checkpointer(
        tiers, chunk_bytes=1 << 20, host_buffer_bytes=2 << 20, save_deadline=1.0, on_event=events
    ) as ck:
        gate = _gate(ck.backend("slow"))
        h = ck.save({"x": torch.randn(4 << 20)}, 1)  # 16 chunks through 2 arena slots
        try:
            h.wait("local", timeout=120)
            with pytest.raises(tierckpt.CheckpointFailed):
                h.wait("slow", timeout=120)
        finally:
            gate.set()
        ck.wait()
        assert ("deadline", "slow", 1) in events.kinds()
        assert ck.tier_counts()["slow"]["deadline"] == 1
        assert [s.outcome for s in ck.stats(failures=True) if s.tier == "slow"] == ["deadline"]


def test_copy_skipped_is_an_event(tmp_path: Path) -> None:
    events = _Events()
    tiers = [
        LocalTier(tmp_path / "fast", keep_last=None),
        LocalTier(tmp_path / "slow", name="slow", source="local", max_behind=1),
    ]
    with Checkpointer(tiers, on_event=events) as ck:
        gate = _gate(ck.backend("slow"))
        try:
            handles = [ck.save({"x": torch.full((256,), float(s))}, s) for s in (1, 2, 3)]
            for h in handles:
                h.wait("local", timeout=60)
        finally:
            gate.set()
        ck.wait()
        skipped = [e for e in events.items if e.kind == "skipped"]
        assert skipped and all(e.tier == "slow" and e.error_type == "CopySkipped" for e in skipped)


def test_a_skipped_save_is_an_event(tmp_path: Path) -> None:
    events = _Events()
    with Checkpointer([LocalTier(tmp_path)], on_busy="skip", on_event=events) as ck:
        gate = _gate(ck.backend("local"))
        try:
            ck.save({"x": torch.ones(256)}, 1)
            assert ck.save({"x": torch.ones(256)}, 2).skipped
        finally:
            gate.set()
        ck.wait()
    assert ("save_skipped", "", 2) in events.kinds()


def _commit_two(tmp_path: Path, sink: Any) -> Checkpointer:
    ck = Checkpointer(
        [LocalTier(tmp_path / "ok"), LocalTier(tmp_path / "full", name="full")], on_event=sink
    )
    _disk_full(ck.backend("full"))
    for step in (1, 2):
        ck.save({"w": torch.ones(1024)}, step)
        ck.wait()
    return ck


def test_tensorboard_sink_with_a_real_summary_writer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from tierckpt.integrations.sinks import TensorBoardSink

    writer = SummaryWriter(str(tmp_path / "runs"))
    ck = _commit_two(tmp_path, TensorBoardSink(writer))
    ck.close()
    writer.close()
    acc = EventAccumulator(str(tmp_path / "runs"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {
        "tierckpt/local/seconds",
        "tierckpt/local/blocked_seconds",
        "tierckpt/full/failed",
    } <= set(tags)
    assert [(e.step, e.value) for e in acc.Scalars("tierckpt/full/failed")] == [(1, 1.0), (2, 2.0)]
    assert [e.step for e in acc.Scalars("tierckpt/local/stored_bytes")] == [1, 2]


def test_lightning_logger_sink_with_a_csv_logger(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from tierckpt.integrations.sinks import LightningLoggerSink

    logger = CSVLogger(str(tmp_path / "logs"), name="run")
    ck = _commit_two(tmp_path, LightningLoggerSink(logger))
    ck.close()
    logger.save()
    logger.finalize("success")
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    failed = [
        (int(r["step"]), float(r["tierckpt/full/failed"]))
        for r in rows
        if r.get("tierckpt/full/failed")
    ]
    assert failed == [(1, 1.0), (2, 2.0)]
    assert [int(r["step"]) for r in rows if r.get("tierckpt/local/seconds")] == [1, 2]


def test_hf_trainer_sink_logs_through_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from test_integration_promises import _hf_trainer

    from tierckpt.integrations.hf import TrainerLogSink

    trainer, callback, _ = _hf_trainer(
        tmp_path, save_strategy="epoch", eval_strategy="no", num_train_epochs=2
    )
    seen: list[dict[str, float]] = []

    import transformers

    class Reporter(transformers.TrainerCallback):  # stands in for a report_to integration
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            seen.append(dict(logs or {}))

    trainer.add_callback(Reporter())
    TrainerLogSink.attach(trainer, callback.checkpointer)
    trainer.train()
    callback.close()
    logged = [x for x in trainer.state.log_history if "tierckpt/local/seconds" in x]
    assert sorted(int(x["tierckpt/step"]) for x in logged) == [2, 4]
    assert any("tierckpt/local/blocked_seconds" in x for x in seen)


def test_prometheus_text_parses(tmp_path: Path) -> None:
    from tierckpt.integrations.sinks import prometheus_text

    ck = _commit_two(tmp_path, None)
    text = prometheus_text(ck)
    ck.close()
    assert 'tierckpt_copies_total{tier="full",outcome="failed"} 2' in text
    assert 'tierckpt_copies_total{tier="local",outcome="committed"} 2' in text
    assert 'tierckpt_last_commit_step{tier="local"} 2.0' in text
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    copies = families["tierckpt_copies"]
    assert copies.type == "counter"
    values = {(s.labels["tier"], s.labels["outcome"]): s.value for s in copies.samples}
    assert values[("full", "failed")] == 2 and values[("local", "committed")] == 2
    assert families["tierckpt_last_commit_blocked_seconds"].samples[0].value > 0
