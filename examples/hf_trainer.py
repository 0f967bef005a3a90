"""Hugging Face Trainer with tierckpt: save through the tiers, resume elsewhere, compare.

    python examples/hf_trainer.py --dir /tmp/hf

A tiny GPT-2 built from a config (no downloads) trains for a few steps; ``TierCkptCallback``
saves on every save step instead of the Trainer's blocking ``torch.save``. Then a second
Trainer resumes from step 4 through ``callback.materialize()`` and must end with the same
weights as the uninterrupted run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import tierckpt
from tierckpt.integrations.hf import TierCkptCallback


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (48, 16), generator=g)]


def trainer(out: str, cb: TierCkptCallback, steps: int) -> Trainer:
    args = TrainingArguments(output_dir=out, max_steps=steps, save_strategy="steps",
                             save_steps=2, per_device_train_batch_size=4, report_to=[],
                             use_cpu=True, seed=0, disable_tqdm=True, logging_steps=1)
    return Trainer(model=tiny_gpt2(), args=args, train_dataset=dataset(), callbacks=[cb])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--resume-step", type=int, default=4)
    args = p.parse_args(argv)
    tier_dir = os.path.join(args.dir, "tier")

    cb = TierCkptCallback([tierckpt.MemoryTier(namespace="hf-example"),
                           tierckpt.LocalTier(tier_dir, keep_last=None)])
    first = trainer(os.path.join(args.dir, "out1"), cb, args.steps)
    first.train()
    cb.close()
    final: dict[str, Any] = first.model.state_dict()

    # a new node: only the durable tier is there
    cb2 = TierCkptCallback([tierckpt.LocalTier(tier_dir, keep_last=None)])
    folder = cb2.materialize(os.path.join(args.dir, "resume"), step=args.resume_step)
    second = trainer(os.path.join(args.dir, "out2"), cb2, args.steps)
    second.train(resume_from_checkpoint=folder)
    cb2.close()
    same = all(torch.equal(final[k], v) for k, v in second.model.state_dict().items())
    print(f"resumed from {folder}; final weights identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
