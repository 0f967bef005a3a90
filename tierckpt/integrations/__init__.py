"""Integrations with training frameworks.

* :mod:`tierckpt.integrations.lightning`: :class:`TierCkptIO`, a PyTorch Lightning
  ``CheckpointIO`` plugin (needs ``lightning``).
* :mod:`tierckpt.integrations.hf`: :class:`TierCkptCallback`, a Hugging Face ``transformers``
  ``TrainerCallback`` (needs ``transformers``).
* A plain PyTorch loop needs no integration: ``ck.guard(optimizer)`` and ``ck.save(...)``
  (see ``examples/plain_loop.py``).

Each module imports its framework lazily, so ``import tierckpt`` never needs them; importing
a module whose framework is missing raises an ``ImportError`` that names the package.
"""

from __future__ import annotations

from tierckpt.integrations._common import sanitize_state

__all__ = ["sanitize_state"]
