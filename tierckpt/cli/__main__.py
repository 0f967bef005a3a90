"""``python -m tierckpt.cli``: the ``tierckpt`` command."""

from __future__ import annotations

import sys

from tierckpt.cli import main

sys.exit(main())
