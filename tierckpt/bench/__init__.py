"""Save benchmark: how long training is blocked, how soon a checkpoint is durable, how much
host memory it costs — tierckpt against ``torch.save``, ``torch.distributed.checkpoint`` and
``torch-checkpointing``, in one run on this machine.

``python -m tierckpt.bench --sizes 1,4 --runs 5 --json bench.json`` (``tierckpt bench``
calls :func:`main`). For each state size and each contender a fresh subprocess builds the
same synthetic state (bf16 weights and fp32 optimizer moments of mixed sizes, with
thousands of small tensors), creates the contender, runs a warm-up save and then ``--runs``
measured saves, and reports medians. A fresh process per contender is the clean way to
measure its peak host memory: staging buffers a peer keeps between saves would otherwise
stay in the next contender's numbers.

Measured per save, from the moment the save call starts:

``returns``   the save call returned.
``staged``    the state may change again (capture / staging finished), waiting for it at
              once: the *immediate* case. For synchronous savers this is the whole save.
``lazy``      the call, then ``--compute-s`` of simulated forward/backward, then the wait
              for capture: time blocked = time in the call + time in the wait.
``committed`` durable on the local disk (fsync'd, committed). The raw sequential
              write + fsync of the same number of bytes, from a warm buffer, is measured in
              the same process between tierckpt's saves.
``memory``    peak extra host memory of the process tree while the contender exists (its
              staging buffers included), sampled every few milliseconds.

A second part trains a small transformer on the CPU and checkpoints every ``--train-every``
steps with each saver, against not checkpointing at all.

The package ships with tierckpt so that ``tierckpt bench`` runs from an installed package;
the runtime never imports it. One module per part: ``config`` (knobs), ``state`` (the
synthetic state), ``probes`` (memory, disk, compute), ``contenders``, ``save`` (one
contender's worker, with tierckpt's per-stage breakdown), ``train`` (the training loop),
``runner`` (processes, machine facts), ``report`` (ratios, tables), ``cli``. The project's
own goals are judged outside the package, by ``benchmarks/targets.py``.
"""

from __future__ import annotations

from tierckpt.bench.cli import main
from tierckpt.bench.config import BenchConfig
from tierckpt.bench.runner import run_bench
from tierckpt.bench.state import make_state, param_sizes

__all__ = ["BenchConfig", "main", "make_state", "param_sizes", "run_bench"]
