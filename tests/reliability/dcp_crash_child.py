"""The child process of the DCP crash test: resume with ``dcp.load``, save every step with
``dcp.save``, get killed.

It loads the newest committed DCP checkpoint of its tiers (a local folder and an S3 prefix), if
any, and logs ``loaded STEP HASH``; then, from the step after it, computes each step's state
from the previous one (deterministic: a resumed run reproduces an unbroken run's states) and
logs, fsync'd, ``intent STEP HASH`` before ``dcp.save`` and ``commit STEP`` after it returned.

Run: ``python dcp_crash_child.py --local DIR --endpoint URL --bucket B --log LOG --steps N``.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from rel_util import state_hash

from tierckpt import LocalTier, S3Tier

#: one state: 24 tensors of 64 KiB-512 KiB (a few chunks per save)
SHAPES = [(64 * (1 + i % 8), 256) for i in range(24)]


def first_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(*s, generator=g) for i, s in enumerate(SHAPES)}


def next_state(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    return {k: v * 0.5 + float(step) for k, v in state.items()}


def tiers(local: str, endpoint: str, bucket: str) -> list[object]:
    return [
        LocalTier(local, keep_last=2),
        S3Tier(f"s3://{bucket}/run", endpoint_url=endpoint, keep_last=2),
    ]


def _log(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser()
    for a in ("--local", "--endpoint", "--bucket", "--log"):
        ap.add_argument(a, required=True)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    import torch.distributed.checkpoint as dcp

    from tierckpt.dcp import TierReader, TierWriter

    ts = tiers(args.local, args.endpoint, args.bucket)
    state = first_state()
    reader = TierReader(ts)
    try:
        dcp.load(state, storage_reader=reader, no_dist=True)
        start = int(reader.loaded_step or 0) + 1
        _log(args.log, f"loaded {reader.loaded_step} {state_hash(state)}")
    except BaseException as exc:  # DCP wraps it: only "nothing committed" starts over
        if "no committed checkpoint" not in str(exc):
            raise
        state, start = first_state(), 1
        _log(args.log, "fresh")
    with TierWriter(ts) as w:
        for step in range(start, start + args.steps):
            state = next_state(state, step)
            _log(args.log, f"intent {step} {state_hash(state)}")
            w.reset(str(step))
            dcp.save(state, storage_writer=w, no_dist=True)
            _log(args.log, f"commit {step}")
    sys.exit(0)


if __name__ == "__main__":
    main()
