"""A small data-parallel training loop that checkpoints with tierckpt, run by torchrun.

    torchrun --standalone --nproc-per-node=2 examples/torchrun_train.py --dir /tmp/tck-run

Every rank saves its own state (model, optimizer, its RNG and step) to its own shard file on
each tier; rank 0 commits a checkpoint once every rank's shard is durable. ``ck.guard(opt, model)``
makes ``optimizer.step()`` wait only until the state is captured into host memory, so the
writes overlap the next forward/backward. Run it again and it resumes from the newest step
that every rank can read (add ``--s3 s3://bucket/prefix --endpoint-url ...`` for an S3 tier).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tierckpt
from tierckpt.distributed import wait_committed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="local checkpoint folder (shared by the ranks)")
    p.add_argument("--s3", help="optional S3 tier, s3://bucket/prefix")
    p.add_argument("--endpoint-url", help="S3 endpoint (MinIO, SeaweedFS, moto)")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    tiers: list[tierckpt.TierSpec] = [tierckpt.LocalTier(args.dir, keep_last=3)]
    if args.s3:
        tiers.append(tierckpt.S3Tier(args.s3, endpoint_url=args.endpoint_url, every=2 * args.every))
    ck = tierckpt.Checkpointer(tiers)
    ck.guard(opt, model)  # optimizer.step() waits until pending saves are captured

    start = 0
    gen = torch.Generator().manual_seed(1000 + rank)
    try:
        state = ck.load()  # every rank agrees on the same step
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        gen.set_state(state["rng"])
        start = state["step"]
    except tierckpt.CheckpointNotFound:
        pass
    if rank == 0:
        print(f"world {world}: resumed from step {start}", flush=True)

    handles = []
    t0 = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        x = torch.randn(64, 32, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()  # the guard waits here for a pending capture (usually already done)
        if step % args.every == 0:
            state = {
                "model": model.module.state_dict(),
                "optim": opt.state_dict(),
                "rng": gen.get_state(),
                "step": step,
            }
            handles.append(ck.save(state, step))
    train_s = time.perf_counter() - t0
    ck.wait()  # this rank's writes; on rank 0 also the commits
    if handles:
        # on other ranks a finished save means "my shard is durable"; rank 0 commits
        last = handles[-1]
        wait_committed(ck.backend("local"), last.step, timeout=120, timeline=last.timeline)
    if rank == 0:
        blocked_ms = sum(h.blocked_seconds for h in handles) * 1e3
        print(
            f"trained steps {start + 1}..{args.steps} in {train_s:.2f} s; training was blocked "
            f"{blocked_ms:.1f} ms by {len(handles)} saves; committed steps {ck.steps()}",
            flush=True,
        )
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
