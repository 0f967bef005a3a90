"""What ``tierckpt.Preemption.check()`` costs a training step, against the all-reduce it is.

Starts ``--world`` gloo ranks on 127.0.0.1 (real processes), and in each times ``--calls``
calls of ``check()`` (no signal: the every-step case) and as many bare ``all_reduce`` calls of
one int32 tensor (the collective alone), interleaved in ``--rounds`` rounds after a warm-up
round, the order alternating. Prints the median per call of each and their ratio (rank 0's numbers).

    python benchmarks/bench_preemption.py --world 2 --calls 2000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rank(rank: int, world: int, calls: int, rounds: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from tierckpt import Preemption

    dist.init_process_group("gloo", rank=rank, world_size=world)
    stop = Preemption()
    flag = torch.zeros(1, dtype=torch.int32)
    ours, bare = [], []

    def timed(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    def reduce_one() -> object:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item()

    for r in range(rounds + 1):  # round 0 warms up; the order alternates
        first, second = (stop.check, reduce_one) if r % 2 else (reduce_one, stop.check)
        a, b = timed(first), timed(second)
        if r:
            ours.append(a if first is stop.check else b)
            bare.append(b if first is stop.check else a)
    stop.close()
    dist.destroy_process_group()
    return {
        "check_us": statistics.median(ours) * 1e6,
        "all_reduce_us": statistics.median(bare) * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank is not None:
        print(json.dumps(_rank(a.rank, a.world, a.calls, a.rounds)))
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    args = [f"--world={a.world}", f"--calls={a.calls}", f"--rounds={a.rounds}"]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *args, f"--rank={r}"], stdout=subprocess.PIPE, env=env
        )
        for r in range(a.world)
    ]
    outs = [json.loads(p.communicate()[0]) for p in procs]
    r0 = outs[0]
    print(
        f"{a.world} gloo ranks, {a.calls} calls x {a.rounds} rounds: check() "
        f"{r0['check_us']:.1f} us per call, bare all_reduce {r0['all_reduce_us']:.1f} us "
        f"({r0['check_us'] / r0['all_reduce_us']:.2f}x)"
    )


if __name__ == "__main__":
    main()
