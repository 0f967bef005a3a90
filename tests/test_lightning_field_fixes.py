"""``TierCkptIO`` as Lightning users run it (field-test fixes), each against Lightning's own
``TorchCheckpointIO`` in the same configuration:

* a job killed after Lightning wrote ``last.ckpt`` but before that save committed resumes
  from the newest committed checkpoint (every restart failed: "step 9 is not committed");
* a weights-only and a full ``ModelCheckpoint`` at one step: ``last.ckpt`` is the full
  checkpoint (the second save was skipped as "already saved", and the resume had no
  optimizer state);
* saves at one step whose loop and callback state differ: each pointer gives back its own;
* a save after ``fit`` with changed weights is those weights;
* after a rollback, an old run's pointer loads the old run's checkpoint, not the resumed run's
  checkpoint of the same step (the pointer names the timeline).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import tierckpt

L = pytest.importorskip("lightning")

from tierckpt.integrations.lightning import TierCkptIO, read_pointer  # noqa: E402

# lightning 2.6 on torch 2.10+ warns about torch's own LeafSpec deprecation
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")


class _Module(L.LightningModule):  # type: ignore[misc]
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)
        self.lr = lr

    def training_step(self, batch: Any, _i: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def _data() -> Any:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(
    root: Path,
    io: TierCkptIO | None,
    max_steps: int,
    callbacks: list[Any],
    ckpt_path: str | None = None,
    lr: float = 0.05,
) -> tuple[Any, _Module]:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[io] if io is not None else [],
        callbacks=callbacks,
        default_root_dir=str(root),
    )
    model = _Module(lr)
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return trainer, model


def _sha(model: torch.nn.Module) -> str:
    return hashlib.sha256(
        b"".join(v.numpy().tobytes() for v in model.state_dict().values())
    ).hexdigest()


def _io(root: Path, **kw: Any) -> TierCkptIO:
    return TierCkptIO([tierckpt.LocalTier(root / "tier", keep_last=None, **kw)])


def _two_checkpoints(root: Path) -> list[Any]:
    """A weights-only export and a full, resumable checkpoint with last.ckpt at one step."""
    MC = L.pytorch.callbacks.ModelCheckpoint
    return [
        MC(dirpath=root / "weights", every_n_train_steps=4, save_top_k=2, monitor="train_loss",
           save_weights_only=True),
        MC(dirpath=root / "ckpts", every_n_train_steps=4, save_top_k=1, save_last=True),
    ]  # fmt: skip


def test_a_weights_only_and_a_full_checkpoint_at_one_step(tmp_path: Path) -> None:
    results = {}
    for kind in ("tier", "torch"):
        root = tmp_path / kind
        io = _io(root) if kind == "tier" else None
        _fit(root, io, 8, _two_checkpoints(root))
        last = str(root / "ckpts" / "last.ckpt")
        if io is not None:
            keys = sorted(io.load_checkpoint(last))
            io.close()
            io = _io(root)
        else:
            keys = sorted(torch.load(last, weights_only=False))
        assert "optimizer_states" in keys, (kind, keys)  # the full checkpoint, not the export
        _, model = _fit(root, io, 16, _two_checkpoints(root), ckpt_path=last)
        results[kind] = _sha(model)
        if io is not None:
            io.close()
    assert results["tier"] == results["torch"]  # the resume continued the same training


def test_a_pointer_to_a_save_that_never_committed_resumes_from_the_one_before(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning writes last.ckpt when the save starts: a job killed before it committed left
    it naming a step no tier holds, and every restart's fit(ckpt_path="last") failed."""
    io = _io(tmp_path)
    MC = L.pytorch.callbacks.ModelCheckpoint
    _fit(tmp_path, io, 6, [MC(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_last=True)])
    io.close()
    last = tmp_path / "ckpts" / "last.ckpt"
    pointer = read_pointer(str(last))
    assert pointer is not None and pointer["step"] == 6
    # what a kill between the save's start and its commit leaves: a pointer to step 9
    last.write_text(json.dumps({**pointer, "step": 9}))
    io = _io(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tierckpt"):
        state = io.load_checkpoint(str(last))
    assert state["global_step"] == 6
    assert "names step 9, which is not committed" in caplog.text and "from step 6" in caplog.text
    io.close()
    # nothing committed before it either: a clear error
    last.write_text(json.dumps({**pointer, "step": 2}))
    io = _io(tmp_path)
    with pytest.raises(tierckpt.CheckpointNotFound, match="no checkpoint before it"):
        io.load_checkpoint(str(last))
    io.close()  # its reader threads go (a later test counts them)


def test_saves_at_one_step_each_give_back_their_own_loop_and_callback_state(
    tmp_path: Path,
) -> None:
    """A ModelCheckpoint saving at batch end and another at epoch end, at the same step: the
    epoch-end pointer gave back the batch-end state (loop progress, callback paths), and a
    resume from it trained differently from Lightning's own. The tensors are the same, so
    they share one checkpoint and the pointer carries the values that differ."""
    MC = L.pytorch.callbacks.ModelCheckpoint
    shas = {}
    for kind in ("tier", "torch"):
        root = tmp_path / kind
        cbs = [
            MC(dirpath=root / "batch", every_n_train_steps=8, save_top_k=-1),
            MC(dirpath=root / "epoch", every_n_epochs=1, save_top_k=-1, filename="ep-{step}"),
        ]
        io = _io(root) if kind == "tier" else None
        _fit(root, io, 16, cbs)
        if io is not None:
            pointers = [read_pointer(str(p)) for p in sorted((root / "epoch").iterdir())]
            assert all(p is not None and p.get("values") for p in pointers), pointers
            ck_steps = sorted(c.step for c in io.checkpointer.checkpoints())
            assert ck_steps == [8, 16], ck_steps  # one checkpoint per step, shared
            io.close()
            io = _io(root)
        _, model = _fit(root / "r", io, 24, [], ckpt_path=str(root / "epoch" / "ep-step=8.ckpt"))
        shas[kind] = _sha(model)
        if io is not None:
            io.close()
    assert shas["tier"] == shas["torch"]


def test_a_save_after_fit_holds_the_weights_as_they_are_then(tmp_path: Path) -> None:
    io = _io(tmp_path)
    MC = L.pytorch.callbacks.ModelCheckpoint
    trainer, model = _fit(tmp_path, io, 8, [MC(dirpath=tmp_path / "ckpts", every_n_train_steps=8)])
    with torch.no_grad():
        model.net.weight.zero_()
    trainer.save_checkpoint(str(tmp_path / "final.ckpt"))
    state = io.load_checkpoint(str(tmp_path / "final.ckpt"))
    assert not state["state_dict"]["net.weight"].any()
    older = io.load_checkpoint(str(tmp_path / "ckpts" / "epoch=0-step=8.ckpt"))
    assert older["state_dict"]["net.weight"].any()  # the save during fit kept its weights
    io.close()


def test_after_a_rollback_an_old_pointer_loads_the_old_runs_checkpoint(tmp_path: Path) -> None:
    MC = L.pytorch.callbacks.ModelCheckpoint

    def callbacks() -> list[Any]:
        return [MC(dirpath=tmp_path / "ckpts", every_n_train_steps=4, save_top_k=-1,
                   filename="{step}-{train_loss:.4f}")]  # fmt: skip

    io = _io(tmp_path)
    _, run_a = _fit(tmp_path, io, 12, callbacks())
    a_weights = run_a.net.weight.detach().clone()
    io.close()
    a_files = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    step4 = next(f for f in a_files if f.startswith("step=4-"))
    step12 = next(f for f in a_files if f.startswith("step=12-"))
    io = _io(tmp_path)  # run B: back to step 4, another learning rate, on to step 12
    _fit(tmp_path, io, 12, callbacks(), ckpt_path=str(tmp_path / "ckpts" / step4), lr=0.01)
    io.close()
    io = _io(tmp_path)
    got = io.load_checkpoint(str(tmp_path / "ckpts" / step12))  # run A's step-12 pointer
    assert torch.equal(got["state_dict"]["net.weight"], a_weights)
    io.close()


def test_a_fit_whose_last_checkpoint_committed_nowhere_fails_at_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every save of the fit fails (a full disk): the fit trains on (each failure logged),
    and ends with ``CheckpointFailed`` naming the lost step, not as if its state were saved —
    as Lightning's ``AsyncCheckpointIO`` and ``TorchCheckpointIO`` raise a failed save."""
    from tierckpt.backends.local import LocalBackend

    def full(self: Any, *a: Any, **kw: Any) -> Any:
        raise OSError(28, "No space left on device")

    io = _io(tmp_path)
    callbacks = [
        L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=4)
    ]
    try:
        monkeypatch.setattr(LocalBackend, "open_writer", full)
        with pytest.raises(tierckpt.CheckpointFailed, match="step 8, was committed on no tier"):
            _fit(tmp_path, io, 8, callbacks)
        monkeypatch.undo()  # the disk has room again: a fit whose saves commit ends quietly
        trainer, _ = _fit(tmp_path, io, 12, callbacks, ckpt_path=None)
        assert trainer.global_step == 12
        assert [c.step for c in io.checkpointer.checkpoints()][-1] == 12
    finally:
        io.close()


def test_a_damaged_checkpoint_names_the_older_pointer_file(tmp_path: Path) -> None:
    """``fit(ckpt_path=...)`` of a checkpoint whose data is damaged raised the core's advice,
    ``load(fallback='previous')``, which a Lightning user does not call: it now names the
    pointer file of the newest older checkpoint beside it, and resuming from that works."""
    from tierckpt.format import shard_name

    MC = L.pytorch.callbacks.ModelCheckpoint
    every = MC(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    first = _io(tmp_path)
    _fit(tmp_path, first, 6, [every])
    first.close()
    p = tmp_path / "tier" / shard_name(6, 0)
    raw = bytearray(p.read_bytes())
    raw[10] ^= 0xFF
    p.write_bytes(bytes(raw))
    newest = tmp_path / "ckpts" / "epoch=0-step=6.ckpt"
    io = _io(tmp_path)
    with pytest.raises(tierckpt.CorruptCheckpoint) as err:
        _fit(tmp_path, io, 8, [], ckpt_path=str(newest))
    io.close()  # the failed fit's traceback holds it
    older = str(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")
    assert f"ckpt_path={older!r}" in str(err.value), str(err.value)
    trainer, _ = _fit(tmp_path, _io(tmp_path), 8, [], ckpt_path=older)
    assert trainer.global_step == 8


def test_a_second_trainer_of_the_process_saves_where_the_first_fit_saved(tmp_path: Path) -> None:
    """Two stages in one script, each with its own Trainer and TierCkptIO on the same tiers,
    the first trainer still referenced: the first IO gives its leases back at the end of its
    fit, so the second resumes from ``last.ckpt`` and saves (its first save raised
    WriterConflict: "another writer in this process"). Also a fit that failed: its IO,
    held by the traceback, does not refuse the retry's IO."""
    MC = L.pytorch.callbacks.ModelCheckpoint
    io1 = _io(tmp_path)
    first, _ = _fit(tmp_path, io1, 8, [MC(dirpath=tmp_path / "c", every_n_train_steps=4)])
    io2 = _io(tmp_path)
    second, model = _fit(
        tmp_path,
        io2,
        16,
        [MC(dirpath=tmp_path / "c", every_n_train_steps=4, save_top_k=-1)],
        ckpt_path=next(str(p) for p in (tmp_path / "c").iterdir() if "step=8" in p.name),
    )
    assert (first.global_step, second.global_step) == (8, 16)  # the first still referenced
    with tierckpt.Checkpointer([tierckpt.LocalTier(tmp_path / "tier")]) as ck:
        assert ck.steps() == [4, 8, 12, 16]
        assert (
            _sha(model)
            == hashlib.sha256(
                b"".join(v.numpy().tobytes() for v in ck.load()["state_dict"].values())
            ).hexdigest()
        )

    class _Fails(L.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *_: Any) -> None:
            if trainer.global_step == 6:
                raise RuntimeError("out of memory (simulated)")

    io3 = _io(tmp_path)
    with pytest.raises(RuntimeError, match="simulated"):
        _fit(tmp_path / "f", io3, 8, [MC(dirpath=tmp_path / "f", every_n_train_steps=4), _Fails()])
    retry_cb = [MC(dirpath=tmp_path / "f", every_n_train_steps=4)]
    io4 = _io(tmp_path)
    retry, _ = _fit(tmp_path / "f", io4, 8, retry_cb)  # refused before
    assert retry.global_step == 8
    for io in (io1, io2, io3, io4):  # all still referenced until here
        io.close()
