"""``tierckpt demo``: train, lose the node, restore from S3 elsewhere, continue bit for bit.

:mod:`~tierckpt.demo.scenario` runs the story (an S3 server, a reference run, node 1 killed
with SIGKILL, node 2 restoring from S3, the comparison and the closing table);
:mod:`~tierckpt.demo.train` is the training process it starts for each run. Shipped with
tierckpt so that ``tierckpt demo`` works from an installed package; the runtime never
imports it.
"""

from __future__ import annotations

from tierckpt.demo.scenario import main, parse_args

__all__ = ["main", "parse_args"]
