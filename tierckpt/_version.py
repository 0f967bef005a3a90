"""The library's version, in a module of its own so that modules the package's ``__init__``
imports can read it without importing the package back (an import cycle)."""

from __future__ import annotations

__version__ = "0.1.0"
