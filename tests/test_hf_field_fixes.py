"""Hugging Face ``TierCkptCallback``: a field tester's findings, each fixed and kept fixed.

- a callback reused for a second ``train()`` skipped every save of that run;
- ``load_best_model_at_end`` loaded whatever ``output_dir/checkpoint-<best>`` held (another
  run's weights) instead of this run's best checkpoint;
- ``train(resume_from_checkpoint=True)`` found no checkpoint although the tiers held one;
- the stored ``TrainerState`` lacked the save step's own log entry.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt
from tierckpt.format import CheckpointId

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("safetensors")

from tierckpt.integrations.hf import TierCkptCallback  # noqa: E402

EVAL_LOSSES = [0.9, 0.2, 0.6, 0.7]  # per epoch (2 steps each): the best is step 4


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        out = self.lin(x)
        loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
        return {"loss": loss, "logits": out}


class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.seed + i)
        x = torch.randn(4, generator=g)
        return {"x": x, "labels": x.sum(0, keepdim=True)}


class Trainer(transformers.Trainer):  # type: ignore[misc]
    """Evaluation returns a scripted loss per epoch, so the best step is known."""

    def evaluate(self, *a: Any, **k: Any) -> dict[str, float]:
        metrics = {"eval_loss": EVAL_LOSSES[round(self.state.epoch or 0) - 1]}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(
            self.args, self.state, self.control, metrics=metrics
        )
        return metrics


def _trainer(
    out: Path, cb: Any, *, seed: int = 0, callbacks: tuple[Any, ...] = (), **args: Any
) -> Any:
    defaults: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "num_train_epochs": 4,
        "learning_rate": 0.1,
        "report_to": [],
        "use_cpu": True,
        "logging_strategy": "no",
        "disable_tqdm": True,
        "save_strategy": "epoch",
        "seed": seed,
    }
    torch.manual_seed(seed)
    return Trainer(
        model=Tiny(),
        args=transformers.TrainingArguments(**{**defaults, **args}),
        train_dataset=Data(seed),
        eval_dataset=Data(seed),
        callbacks=[cb, *callbacks],
    )


def _weights(trainer: Any) -> torch.Tensor:
    return trainer.model.lin.weight.detach().clone()


def _callback(tier: Path, **kw: Any) -> TierCkptCallback:
    return TierCkptCallback([tierckpt.LocalTier(tier, keep_last=None)], **kw)


# -- 1. a reused callback ----------------------------------------------------------------------
def test_a_reused_callback_saves_the_second_runs_checkpoints(tmp_path: Path) -> None:
    """Two fresh train() runs through one callback: the second saves its own steps 2, 4, 6, 8
    (on a new timeline), so the newest checkpoint is its final state, not the first run's."""
    cb = _callback(tmp_path / "tier")
    ck = cb.checkpointer
    first = _trainer(tmp_path / "r1", cb, seed=1)
    first.train()
    second = _trainer(tmp_path / "r2", cb, seed=2)
    second.train()
    ck.wait()
    assert [c.timeline for c in ck.checkpoints()] == [0] * 4 + [1] * 4
    assert torch.equal(ck.load()["model"]["lin.weight"], _weights(second))
    assert not torch.equal(_weights(first), _weights(second))
    cb.close()


def test_a_second_run_whose_first_save_is_the_first_runs_last_step(tmp_path: Path) -> None:
    """Equal steps: each run saves step 8 only. The second run's step 8 is a checkpoint of its
    own on a new timeline (not refused as already committed, not skipped)."""
    cb = _callback(tmp_path / "tier")
    ck = cb.checkpointer
    runs = []
    for seed in (1, 2):
        trainer = _trainer(
            tmp_path / f"r{seed}", cb, seed=seed, save_strategy="steps", save_steps=8
        )
        trainer.train()
        runs.append(_weights(trainer))
    ck.wait()
    assert ck.checkpoints() == [CheckpointId(8, 0), CheckpointId(8, 1)]
    assert torch.equal(ck.load()["model"]["lin.weight"], runs[1])
    assert torch.equal(ck.load(8, timeline=0)["model"]["lin.weight"], runs[0])
    cb.close()


def test_two_save_events_of_one_step_share_one_checkpoint(tmp_path: Path) -> None:
    """The last step of an epoch that is also the last step of training: the step end and the
    epoch end both ask for a save, with no update between them: one checkpoint, no failure."""
    cb = _callback(tmp_path / "tier")
    trainer = _trainer(tmp_path / "out", cb, num_train_epochs=2, save_strategy="epoch")
    failures: list[Any] = []
    cb.checkpointer.add_event_callback(lambda e: None if e.ok else failures.append(e))
    trainer.train()
    assert cb.checkpointer.checkpoints() == [CheckpointId(2, 0), CheckpointId(4, 0)]
    assert failures == []
    cb.close()


# -- 2. load_best_model_at_end with another run's folder in output_dir ---------------------------
BEST = {
    "save_strategy": "epoch",
    "eval_strategy": "epoch",
    "load_best_model_at_end": True,
    "metric_for_best_model": "loss",
    "greater_is_better": False,
}


def _best_run(
    tmp_path: Path, tier: str, seed: int, **kw: Any
) -> tuple[Any, dict[int, torch.Tensor]]:
    cb = _callback(tmp_path / tier, **kw)
    trainer = _trainer(tmp_path / "out", cb, seed=seed, **BEST)
    saved: dict[int, torch.Tensor] = {}
    orig = cb.save

    def save(state: Any, *a: Any, **k: Any) -> None:
        saved[int(state.global_step)] = _weights(trainer)
        orig(state, *a, **k)

    cb.save = save  # type: ignore[method-assign]
    trainer.train()
    cb.close()
    return trainer, saved


def test_best_model_is_this_runs_not_a_stale_folders(tmp_path: Path) -> None:
    """Runs A and B share output_dir (their own tiers, other data); both find step 4 best. B
    ends with its own step-4 weights, not those A's end left in output_dir/checkpoint-4."""
    _, saved_a = _best_run(tmp_path, "tierA", seed=1)
    trainer_b, saved_b = _best_run(tmp_path, "tierB", seed=2)
    assert trainer_b.state.best_global_step == 4
    assert not torch.equal(saved_a[4], saved_b[4])
    assert torch.equal(_weights(trainer_b), saved_b[4])
    record = json.loads((tmp_path / "out" / "checkpoint-4" / "tierckpt.json").read_text())
    assert (record["step"], record["timeline"]) == (4, 0)
    assert record["locations"] == [str(tmp_path / "tierB")]


def test_best_model_replaces_a_foreign_trainer_folder(tmp_path: Path) -> None:
    """A folder the Trainer itself wrote for another run (no tierckpt.json) is not this run's
    checkpoint either (replace_hf_save=True: this run wrote none)."""
    foreign = tmp_path / "out" / "checkpoint-4"
    foreign.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file(
        {"lin.weight": torch.full((1, 4), 7.0), "lin.bias": torch.zeros(1)},
        str(foreign / "model.safetensors"),
    )
    trainer, saved = _best_run(tmp_path, "tier", seed=1)
    assert torch.equal(_weights(trainer), saved[4])


def test_best_model_with_the_trainers_own_saves_too(tmp_path: Path) -> None:
    """replace_hf_save=False: the Trainer wrote checkpoint-4 itself in this run; it is loaded
    as it is (no tierckpt.json), and it holds this run's step 4."""
    trainer, saved = _best_run(tmp_path, "tier", seed=1, replace_hf_save=False)
    assert torch.equal(_weights(trainer), saved[4])
    assert not (tmp_path / "out" / "checkpoint-4" / "tierckpt.json").exists()


# -- 3. train(resume_from_checkpoint=True) --------------------------------------------------------
class _Crash(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, cb: TierCkptCallback, at: int) -> None:
        self.cb, self.at = cb, at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == self.at:
            self.cb.checkpointer.wait()
            raise KeyboardInterrupt("killed")


def test_resume_from_checkpoint_true_resumes_from_the_tiers(tmp_path: Path) -> None:
    """The job dies at step 5 (step 4 committed, nothing in output_dir); a new Trainer with a
    new callback on the same tiers: train(resume_from_checkpoint=True) resumes at step 4 and
    ends where an uninterrupted run ends."""
    ref_cb = _callback(tmp_path / "ref_tier")
    ref = _trainer(tmp_path / "ref", ref_cb, save_strategy="steps", save_steps=2)
    ref.train()
    ref_cb.close()

    cb = _callback(tmp_path / "tier")
    first = _trainer(
        tmp_path / "out", cb, callbacks=(_Crash(cb, 5),), save_strategy="steps", save_steps=4
    )
    with pytest.raises(KeyboardInterrupt):
        first.train()
    cb.close()
    assert not os.path.exists(tmp_path / "out" / "checkpoint-4")

    cb = _callback(tmp_path / "tier")
    trainer = _trainer(tmp_path / "out", cb, save_strategy="steps", save_steps=4)
    trainer.train(resume_from_checkpoint=True)
    cb.close()
    assert trainer.state.global_step == 8
    assert torch.equal(_weights(trainer), _weights(ref))


def test_resume_true_never_takes_another_output_dirs_checkpoint(tmp_path: Path) -> None:
    """The tiers' newest checkpoint was saved by a Trainer of another output_dir: it is not
    written into this one, and resume_from_checkpoint=True fails as it does without tierckpt."""
    cb = _callback(tmp_path / "tier")
    _trainer(tmp_path / "other", cb, num_train_epochs=1).train()
    cb.close()
    cb = _callback(tmp_path / "tier")
    trainer = _trainer(tmp_path / "out", cb)
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path / "out"))
    with pytest.raises(ValueError, match="No valid checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    cb.close()


def test_resume_true_prefers_a_newer_folder_in_output_dir(tmp_path: Path) -> None:
    """A checkpoint folder in output_dir newer than the tiers' newest (the Trainer's own save,
    replace_hf_save=False) is what resume_from_checkpoint=True takes: nothing is written."""
    cb = _callback(tmp_path / "tier")
    _trainer(tmp_path / "out", cb, num_train_epochs=1).train()  # step 2 on the tiers
    cb.close()
    (tmp_path / "out" / "checkpoint-6").mkdir()
    cb = _callback(tmp_path / "tier")
    _trainer(tmp_path / "out", cb)
    assert sorted(os.listdir(tmp_path / "out")) == ["checkpoint-6"]
    cb.close()


# -- 4. the stored TrainerState --------------------------------------------------------------
def test_stored_trainer_state_is_the_trainers_own(tmp_path: Path) -> None:
    """With logging every step, the TrainerState stored at a save step holds that step's log
    entry and flags as the Trainer's own checkpoint-<step>/trainer_state.json (same run)."""
    cb = _callback(tmp_path / "tier", replace_hf_save=False)
    trainer = _trainer(
        tmp_path / "out",
        cb,
        save_strategy="steps",
        save_steps=2,
        num_train_epochs=2,
        logging_strategy="steps",
        logging_steps=1,
    )
    trainer.train()
    for step in (2, 4):
        folder = cb.materialize(str(tmp_path / "mat"), step=step)
        ours = json.loads(Path(folder, "trainer_state.json").read_text())
        native = json.loads(
            (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").read_text()
        )
        assert ours["log_history"][-1]["step"] == step
        for key in ("log_history", "total_flos", "global_step", "stateful_callbacks"):
            assert ours[key] == native[key], key
    cb.close()


# -- 5. every save failing ---------------------------------------------------------------------
def test_a_train_whose_last_checkpoint_committed_nowhere_fails_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save fails (a full disk): training runs to its end (each failure logged), then
    ``train()`` raises ``CheckpointFailed`` naming the lost step, as a failed ``torch.save`` of
    the ``Trainer``'s own would; it returned as if the state were saved."""
    from tierckpt.backends.local import LocalBackend

    def full(self: Any, *a: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    cb = _callback(tmp_path / "tier")
    try:
        monkeypatch.setattr(LocalBackend, "open_writer", full)
        trainer = _trainer(tmp_path / "out", cb)
        with pytest.raises(tierckpt.CheckpointFailed, match="step 8, was committed on no tier"):
            trainer.train()
        assert trainer.state.global_step == 8  # training was not stopped by the failures
        monkeypatch.undo()
        _trainer(tmp_path / "out2", cb).train()  # saves that commit: it ends quietly
        assert cb.checkpointer.checkpoints()[-1].step == 8
    finally:
        cb.close()


def _flip_chunk(tier: Path, step: int) -> None:
    """A flipped byte in the first chunk of ``step``'s shard on the local tier ``tier``."""
    from tierckpt.format import shard_name

    p = tier / shard_name(step, 0)
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))


def test_a_damaged_newest_checkpoint_names_the_trainers_way_back(tmp_path: Path) -> None:
    """resume_from_checkpoint=True prepares the newest checkpoint when the Trainer is built:
    where its data is damaged the Trainer cannot be built, and the error named
    ``load(fallback='previous')``, a call a Trainer's user does not make. It now names the
    callback's way (``resume_folder=False`` and ``materialize(output_dir, step=...)``), and
    that way resumes from the older step."""
    cb = _callback(tmp_path / "tier")
    _trainer(tmp_path / "out", cb, save_strategy="steps", save_steps=2, max_steps=6).train()
    cb.close()
    _flip_chunk(tmp_path / "tier", 6)
    with pytest.raises(tierckpt.CorruptCheckpoint) as err:
        _trainer(tmp_path / "out", _callback(tmp_path / "tier"), max_steps=8)
    said = str(err.value)
    assert "resume_folder=False" in said and "materialize(" in said, said
    assert "[2, 4]" in said, said  # the older steps
    cb = _callback(tmp_path / "tier", resume_folder=False)
    trainer = _trainer(tmp_path / "out", cb, save_strategy="steps", save_steps=2, max_steps=8)
    trainer.train(resume_from_checkpoint=cb.materialize(str(tmp_path / "out"), step=4))
    cb.close()
    assert trainer.state.global_step == 8


def test_a_second_callback_of_the_process_saves_where_the_first_trained(tmp_path: Path) -> None:
    """A script that trains, then builds a new callback and Trainer on the same tiers (a second
    stage) while the first is still referenced: the first gives its leases back at the end of
    train(), so the second saves (it was refused as another writer of this process); and the
    first, used again, takes them back."""
    first_cb = _callback(tmp_path / "tier")
    first = _trainer(tmp_path / "r1", first_cb, seed=1)
    first.train()
    second_cb = _callback(tmp_path / "tier")
    second = _trainer(tmp_path / "r2", second_cb, seed=2)
    second.train()  # raised WriterConflict before
    ck = second_cb.checkpointer
    assert [c.timeline for c in ck.checkpoints()] == [0] * 4 + [1] * 4
    assert torch.equal(ck.load()["model"]["lin.weight"], _weights(second))
    again = _trainer(tmp_path / "r3", first_cb, seed=3)
    again.train()
    assert torch.equal(ck.load()["model"]["lin.weight"], _weights(again))
    first_cb.close()
    second_cb.close()
