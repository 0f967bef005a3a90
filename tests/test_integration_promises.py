"""Integrations keep the frameworks' promises (issue 17), with the real packages.

* Lightning: retention never removes a step a live ``ModelCheckpoint`` pointer names, also
  after the job restarts; ``trainer.validate(ckpt_path=best)`` works with a small keep_last.
* Hugging Face: ``save_strategy="epoch"`` saves through tierckpt; ``load_best_model_at_end``
  sets ``best_model_checkpoint``, keeps the best step and loads it at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt

ROOT = Path(__file__).resolve().parents[1]

#: validation loss per epoch: the best is epoch 1, then it only gets worse
VAL_LOSSES = [0.5, 0.1, 0.9, 0.8, 0.7]


def _lightning_fit(root: Path, tier_dir: Path, epochs: int) -> tuple[Any, Any, Any, Any]:
    L = pytest.importorskip("lightning")
    from tierckpt.integrations.lightning import TierCkptIO

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _i: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def validation_step(self, batch: Any, _i: int) -> None:
            self.log("val_loss", VAL_LOSSES[min(self.current_epoch, len(VAL_LOSSES) - 1)])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, True)), batch_size=4
    )
    io = TierCkptIO([tierckpt.LocalTier(tier_dir, keep_last=1)])
    # the best by val_loss, and the newest every epoch (each keeps one pointer)
    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root / "ckpts", monitor="val_loss", mode="min", save_top_k=1, filename="best-{step}"
    )
    latest = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=root / "ckpts", save_top_k=1, every_n_epochs=1, filename="latest-{step}"
    )
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io],
        callbacks=[best, latest],
        default_root_dir=root,
    )
    model = Net()
    trainer.fit(model, loader, loader)
    return trainer, (best, latest), io, (model, loader)


# lightning 2.6 on torch 2.10+ warns about torch's own LeafSpec deprecation
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
def test_lightning_best_checkpoint_survives_keep_last(tmp_path: Path) -> None:
    from tierckpt.integrations.lightning import read_pointer

    tier_dir = tmp_path / "tier"
    trainer, (saver, latest), io, (model, loader) = _lightning_fit(tmp_path, tier_dir, 4)
    best = saver.best_model_path
    last = latest.best_model_path
    assert read_pointer(last)["step"] == 16  # type: ignore[index]
    best_step = read_pointer(best)["step"]  # type: ignore[index]
    assert best_step == 8  # epoch 1, 4 batches an epoch
    # the failure: CheckpointNotFound "step 8 is not committed on any tier"
    trainer.validate(model, loader, ckpt_path=best, verbose=False)
    at8 = io.checkpointer.load(8)["state_dict"]["lin.weight"]
    assert torch.equal(model.lin.weight.detach(), at8)  # the best step's weights
    assert not torch.equal(at8, io.checkpointer.load(16)["state_dict"]["lin.weight"])
    steps = io.checkpointer.steps()
    # the best and the newest stay; the others went (keep_last=1 still works)
    assert steps == [8, 16], steps
    io.close()

    # a restarted job (a fresh process) resumes from the latest and saves more steps: the
    # previous run's best pointer still protects its step, read from the pointer file
    code = textwrap.dedent(
        """
        import sys
        import tierckpt
        from tierckpt.integrations.lightning import TierCkptIO
        io = TierCkptIO([tierckpt.LocalTier(sys.argv[1], keep_last=1)])
        state = io.load_checkpoint(sys.argv[2])
        for step in (20, 24, 28):
            io.save_checkpoint({**state, "global_step": step}, sys.argv[2])
        io.checkpointer.wait()
        print("STEPS", io.checkpointer.steps())
        io.close()
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tier_dir), last],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "STEPS [8, 28]" in proc.stdout, proc.stdout
    # once Lightning removes the best pointer, its step follows retention again
    io2 = __import__("tierckpt.integrations.lightning", fromlist=["TierCkptIO"]).TierCkptIO(
        [tierckpt.LocalTier(tier_dir, keep_last=1)]
    )
    io2.load_checkpoint(last)
    io2.remove_checkpoint(best)
    io2.save_checkpoint({"global_step": 32, "x": torch.ones(2)}, str(tmp_path / "ckpts" / "n.ckpt"))
    io2.checkpointer.wait()
    assert io2.checkpointer.steps() == [28, 32]  # 28: the latest pointer still names it
    io2.close()


def test_protect_steps_failure_skips_retention(tmp_path: Path) -> None:
    """A protector that cannot answer: retention removes nothing (it never guesses)."""
    with tierckpt.Checkpointer([tierckpt.LocalTier(tmp_path, keep_last=1)]) as ck:
        ck.save({"w": torch.ones(2)}, 1).wait()

        def broken() -> list[int]:
            raise OSError("pointer folder unreachable")

        remove = ck.protect_steps(broken)
        ck.save({"w": torch.ones(2)}, 2).wait()
        assert ck.steps() == [1, 2]
        remove()
        ck.protect_steps(lambda: [2])
        ck.save({"w": torch.ones(2)}, 3).wait()
        assert ck.steps() == [2, 3]


# -- Hugging Face ------------------------------------------------------------------------------
HF_EVAL_LOSSES = [0.9, 0.2, 0.6, 0.7]  # per epoch: the best is epoch 2 (step 4)


def _hf_trainer(tmp_path: Path, **train_args: Any) -> tuple[Any, Any, Any]:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tierckpt.integrations.hf import TierCkptCallback

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            out = self.lin(x)
            loss = torch.nn.functional.mse_loss(out, labels) if labels is not None else None
            return {"loss": loss, "logits": out}

    class Data(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(i)
            x = torch.randn(4, generator=g)
            return {"x": x, "labels": x.sum(0, keepdim=True)}

    class Trainer(transformers.Trainer):  # type: ignore[misc]
        """Evaluation returns a scripted loss per epoch, so the best step is known."""

        def evaluate(self, *a: Any, **k: Any) -> dict[str, float]:
            epoch = round(self.state.epoch or 0) - 1
            metrics = {"eval_loss": HF_EVAL_LOSSES[epoch]}
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(
                self.args, self.state, self.control, metrics=metrics
            )
            return metrics

    callback = TierCkptCallback([tierckpt.LocalTier(tmp_path / "tier", keep_last=1)])
    defaults: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "num_train_epochs": 4,
        "learning_rate": 0.1,
        "report_to": [],
        "use_cpu": True,
        "logging_strategy": "no",
        "disable_tqdm": True,
    }
    args = transformers.TrainingArguments(**{**defaults, **train_args})
    torch.manual_seed(0)
    model = Tiny()
    trainer = Trainer(
        model=model, args=args, train_dataset=Data(), eval_dataset=Data(), callbacks=[callback]
    )
    return trainer, callback, model


def test_hf_save_strategy_epoch_saves_through_tierckpt(tmp_path: Path) -> None:
    trainer, callback, _ = _hf_trainer(tmp_path, save_strategy="epoch", eval_strategy="no")
    trainer.train()
    # every epoch (2 steps each) went through tierckpt; keep_last=1 left the newest
    assert sorted(callback._saved) == [2, 4, 6, 8]
    assert callback.checkpointer.steps() == [8]
    # and the Trainer's own blocking save did not run
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path / "out"))
    callback.close()


def test_hf_load_best_model_at_end(tmp_path: Path) -> None:
    trainer, callback, model = _hf_trainer(
        tmp_path,
        save_strategy="epoch",
        eval_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=False,
    )
    weights: dict[int, torch.Tensor] = {}
    orig_save = callback.save

    def save(state: Any, *a: Any, **k: Any) -> None:
        weights[int(state.global_step)] = model.lin.weight.detach().clone()
        orig_save(state, *a, **k)

    callback.save = save  # type: ignore[method-assign]
    trainer.train()
    state = trainer.state
    assert state.best_model_checkpoint == str(tmp_path / "out" / "checkpoint-4")
    assert state.best_metric == pytest.approx(0.2)
    # retention kept the best step (keep_last=1 would have removed it) and the newest
    assert callback.checkpointer.steps() == [4, 8]
    # the model holds the best step's weights, as with the Trainer's own saves
    assert torch.equal(model.lin.weight.detach(), weights[4])
    assert not torch.equal(weights[4], weights[8])
    folder = Path(state.best_model_checkpoint)
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 4
    callback.close()


def test_hf_save_strategy_best(tmp_path: Path) -> None:
    """save_strategy="best": saved through tierckpt when the metric improves, not by the
    Trainer."""
    trainer, callback, _ = _hf_trainer(
        tmp_path, save_strategy="best", eval_strategy="epoch", metric_for_best_model="loss"
    )
    trainer.train()
    assert sorted(callback._saved) == [2, 4]  # epochs 1 and 2 improved; 3 and 4 did not
    assert not any(p.startswith("checkpoint-") for p in os.listdir(tmp_path / "out"))
    callback.close()


def test_hf_best_survives_a_restart(tmp_path: Path) -> None:
    """The job dies after step 6 (the best is step 4); a new process resumes from the tiers:
    step 4 is still there (pinned on the tier), and the end loads it."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    code = textwrap.dedent(
        """
        import os, sys
        from pathlib import Path
        sys.path.insert(0, sys.argv[2])
        import transformers
        import test_integration_promises as t

        class Crash(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if state.global_step == 6:
                    callback.checkpointer.wait()
                    os._exit(0)  # killed: no close, no on_train_end

        trainer, callback, _ = t._hf_trainer(
            Path(sys.argv[1]), save_strategy="epoch", eval_strategy="epoch",
            load_best_model_at_end=True, metric_for_best_model="loss",
            greater_is_better=False)
        trainer.add_callback(Crash())
        trainer.train()
        sys.exit(3)  # not reached
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), str(ROOT / "tests")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer, callback, model = _hf_trainer(
        tmp_path,
        save_strategy="epoch",
        eval_strategy="epoch",
        load_best_model_at_end=True,
        metric_for_best_model="loss",
        greater_is_better=False,
    )
    assert callback.checkpointer.steps() == [4, 6]
    assert [c.step for c in callback.checkpointer.pinned()] == [4]
    resume = callback.materialize(str(tmp_path / "resume"))
    best4 = callback.checkpointer.load(4)["model"]["lin.weight"]
    trainer.train(resume_from_checkpoint=resume)
    assert trainer.state.best_global_step == 4
    assert callback.checkpointer.steps() == [4, 8]
    assert torch.equal(model.lin.weight.detach(), best4)
    callback.close()
