"""Save and capture benchmark (a thin wrapper around :mod:`tierckpt.bench`).

    .venv/bin/python benchmarks/bench_save.py --sizes 1,4 --runs 5 --json bench_save.json
    .venv/bin/python benchmarks/plot.py bench_save.json --out docs/img

Every option of ``tierckpt bench`` applies; see ``--help`` and docs/benchmarks.md.
"""

from __future__ import annotations

import sys

from tierckpt.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
