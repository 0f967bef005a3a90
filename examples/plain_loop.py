"""A plain PyTorch training loop with tierckpt: one line to guard the optimizer, one to save.

SIGTERM (a preemption) makes it save the step it is at and leave (``tierckpt.Preemption``).

    python examples/plain_loop.py --dir /tmp/run1 --steps 200          # trains, checkpoints
    python examples/plain_loop.py --dir /tmp/run1 --steps 400          # resumes at step 200
    python examples/plain_loop.py --dir /tmp/run1 --s3 s3://bucket/run1 --endpoint-url URL

``save()`` returns at once; the copy runs beside the next forward/backward pass, and
``ck.guard(optimizer, model)`` makes ``optimizer.step()`` wait only if that copy is unfinished
(module buffers, which forward writes, are copied at ``save()`` itself).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import tierckpt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="local checkpoint folder (the NVMe tier)")
    p.add_argument("--s3", default=None, help="optional s3://bucket/prefix tier")
    p.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    args = p.parse_args(argv)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    tiers: list[tierckpt.TierSpec] = [tierckpt.MemoryTier(), tierckpt.LocalTier(args.dir)]
    if args.s3:
        tiers.append(tierckpt.S3Tier(args.s3, endpoint_url=args.endpoint_url,
                                         every=5 * args.every))  # every 5th save
    with tierckpt.Checkpointer(tiers) as ck:
        ck.guard(opt, model)  # optimizer.step() waits for an unfinished capture: one extra line

        start = 0
        if ck.steps():  # resume from the newest committed checkpoint on any tier
            state = ck.load()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])
            start = state["step"]
            print(f"resumed at step {start}")

        def state(step: int) -> dict[str, object]:
            return {"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "rng": torch.get_rng_state(), "step": step}

        last = start
        with tierckpt.Preemption() as stop:  # SIGTERM: save the step we are at, then leave
            for step in range(start + 1, args.steps + 1):
                g = torch.Generator().manual_seed(step)  # data order derived from the step
                x = torch.randn(64, 32, generator=g)
                y = x.sum(dim=1, keepdim=True).sin()
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                last = step
                if stop.check():
                    ck.save(state(step), step).wait("local")  # the fast tier, in the grace
                    print(f"step {step}: asked to stop; checkpoint committed locally")
                    break
                if step % args.every == 0:
                    ck.save(state(step), step)
                    print(f"step {step}: loss {loss.item():.5f}, checkpoint started")
        ck.wait()  # every tier commits (leaving the `with` block would wait too)
        committed = ck.tier_steps()  # before close(): a closed S3 tier cannot be listed
    print(f"done at step {last}; committed: {committed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
