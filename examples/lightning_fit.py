"""PyTorch Lightning with tierckpt: the ``TierCkptIO`` plugin, then a resume on a "new node".

    python examples/lightning_fit.py --dir /tmp/lit              # fit 4 epochs, then resume
                                                                  # from epoch 2 and compare

Lightning's ``ModelCheckpoint`` decides when to save and writes a small pointer file per
checkpoint; the state itself goes through the tiers (RAM -> local folder [-> S3]) without
blocking training.
"""

from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch

import tierckpt
from tierckpt.integrations.lightning import TierCkptIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> dict[str, object]:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.8)}


def data() -> torch.utils.data.DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    return torch.utils.data.DataLoader(ds, batch_size=16)


def fit(root: str, tiers: list[tierckpt.TierSpec], epochs: int,
        ckpt_path: str | None = None) -> Regressor:
    torch.manual_seed(0)
    model = Regressor()
    io = TierCkptIO(tiers)
    saver = L.pytorch.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpts"),
                                                every_n_epochs=1, save_top_k=-1, save_last=True)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        plugins=[io], callbacks=[saver], default_root_dir=root)
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    io.close()
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args(argv)

    tier_dir = os.path.join(args.dir, "tier")
    full = fit(os.path.join(args.dir, "run1"),
               [tierckpt.MemoryTier(namespace="lit-1"),
                tierckpt.LocalTier(tier_dir, keep_last=None)],
               args.epochs)
    # a new node: a fresh process would see only the local (or S3) tier
    pointer = os.path.join(args.dir, "run1", "ckpts", f"epoch=1-step={2 * 4}.ckpt")
    resumed = fit(os.path.join(args.dir, "run2"), [tierckpt.LocalTier(tier_dir, keep_last=None)],
                  args.epochs, ckpt_path=pointer)
    same = all(torch.equal(a, b) for a, b in zip(full.state_dict().values(),
                                                 resumed.state_dict().values(), strict=True))
    print(f"resumed from {os.path.basename(pointer)}; final weights identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
