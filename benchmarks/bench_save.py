"""Save and capture benchmark with the project's targets (``make bench``).

    .venv/bin/python benchmarks/bench_save.py --sizes 1,4 --runs 5 --json bench_save.json
    .venv/bin/python benchmarks/plot.py bench_save.json --out docs/img

Every option of ``tierckpt bench`` applies; see ``--help`` and docs/benchmarks.md. The
difference: this script also judges the run against the goals in ``benchmarks/targets.py``
(a "Targets" table after the others, ``"targets"`` in the JSON).
"""

from __future__ import annotations

import sys

from targets import evaluate_targets

from tierckpt.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], targets=evaluate_targets))
