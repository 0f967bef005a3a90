"""``python -m tierckpt.bench``: the benchmark's command line (and its worker processes)."""

from __future__ import annotations

import sys

from tierckpt.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
