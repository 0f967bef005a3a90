"""``python -m tierckpt``: the ``tierckpt`` command."""

from __future__ import annotations

import sys

from tierckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
