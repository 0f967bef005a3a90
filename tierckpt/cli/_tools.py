"""``tierckpt bench`` and ``tierckpt demo``: thin entry points into the benchmark and the demo,
imported only when run (the runtime never imports them)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from tierckpt import bench
    except ImportError as exc:
        print(f"tierckpt bench is not available in this installation ({exc})", file=sys.stderr)
        return 1
    main_fn: Callable[[list[str]], int] = bench.main
    return int(main_fn(list(args.bench_args)))


def cmd_demo(args: argparse.Namespace) -> int:
    from tierckpt import demo

    return demo.main(list(args.demo_args))
