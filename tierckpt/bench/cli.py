"""``tierckpt bench``'s command line: options onto :class:`BenchConfig`, run, print the
tables, write JSON."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from tierckpt.bench.config import SAVE_CONTENDERS, TRAIN_VARIANTS, BenchConfig, MiB
from tierckpt.bench.report import format_table
from tierckpt.bench.runner import TargetsFn, run_bench, worker_main


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _names(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tierckpt bench",
        description="Benchmark tierckpt saves against torch.save, DCP and torch-checkpointing.",
    )
    d = BenchConfig()
    p.add_argument(
        "--sizes",
        type=_floats,
        default=d.sizes_gib,
        help="state sizes in GiB, comma separated (fractions allowed; default 1,4)",
    )
    p.add_argument("--runs", type=int, default=d.runs, help="measured saves per contender")
    p.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured saves first")
    p.add_argument(
        "--compute-s",
        type=float,
        default=d.compute_s,
        help="simulated forward/backward of the lazy case, seconds (default 1)",
    )
    p.add_argument(
        "--compute",
        choices=("sleep", "busy"),
        default=d.compute,
        help="lazy-case compute: sleep (host idle, as with a GPU) or busy CPU matmuls",
    )
    p.add_argument(
        "--arena-mib",
        type=int,
        default=d.arena_bytes // MiB,
        help="arena of the bounded-memory tierckpt row (default 256)",
    )
    p.add_argument(
        "--contenders",
        type=_names,
        default=d.contenders,
        help=f"comma separated, from {','.join(SAVE_CONTENDERS)}",
    )
    p.add_argument(
        "--train",
        type=_names,
        default=d.train_variants,
        help=f"training variants from {','.join(TRAIN_VARIANTS)}; '' to skip",
    )
    p.add_argument("--train-steps", type=int, default=d.train_steps)
    p.add_argument(
        "--train-every",
        type=int,
        default=d.train_every,
        help="checkpoint every k steps in the training loop",
    )
    p.add_argument(
        "--train-block",
        type=int,
        default=d.train_block,
        help="the training variants take turns in blocks of at least this many steps, each "
        "closed by a drain (its last save made durable); longer blocks come closer to a run "
        "that never stops",
    )
    p.add_argument("--train-layers", type=int, default=d.train_layers)
    p.add_argument("--train-dmodel", type=int, default=d.train_dmodel)
    p.add_argument(
        "--train-threads",
        type=int,
        default=d.train_threads,
        help="torch threads of the training loop (default: torch's own choice)",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where to write (default: the temp dir if it is on the same disk as "
        "the current directory and not tmpfs, else the current directory)",
    )
    p.add_argument(
        "--no-breakdown",
        action="store_true",
        help="skip the instrumented diagnostic save of tierckpt",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return replace(
        BenchConfig(),
        sizes_gib=tuple(a.sizes),
        runs=a.runs,
        warmup=a.warmup,
        compute_s=a.compute_s,
        compute=a.compute,
        arena_bytes=a.arena_mib * MiB,
        contenders=tuple(a.contenders),
        train_variants=tuple(a.train),
        train_steps=a.train_steps,
        train_every=a.train_every,
        train_block=a.train_block,
        train_layers=a.train_layers,
        train_dmodel=a.train_dmodel,
        train_threads=a.train_threads,
        directory=a.dir,
        breakdown=not a.no_breakdown,
        seed=a.seed,
    )


def main(argv: list[str] | None = None, *, targets: TargetsFn | None = None) -> int:
    """``tierckpt bench``: run the benchmark, print the tables, write JSON (``--json``).

    ``targets`` judges the results against goals (a "Targets" table follows the others);
    ``benchmarks/bench_save.py`` passes the project's own.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(args_list)
    if args.worker is not None:
        return worker_main(args.worker)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"tierckpt bench: {exc}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run_bench(cfg, log=log, argv=args_list, targets=targets)
    table = format_table(result)
    print(table)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {args.json_path}")
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    failed = [c for e in result["sizes"] for c, v in e["contenders"].items() if "error" in v]
    return 1 if failed else 0
