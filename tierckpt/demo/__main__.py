"""``python -m tierckpt.demo``: the same as ``tierckpt demo``."""

from __future__ import annotations

import sys

from tierckpt.demo.scenario import main

if __name__ == "__main__":
    sys.exit(main())
