"""What every command shares: logging set-up, exit-status-2 usage errors, output formatting,
opening a tier URL."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, TextIO

from tierckpt import config
from tierckpt.backends.base import Backend

log = logging.getLogger("tierckpt")


class UsageError(Exception):
    """A command line that cannot work (exit status 2)."""


#: loggers that print requests and responses, headers included (signatures, session tokens)
WIRE_LOGGERS = ("botocore", "boto3", "s3transfer", "urllib3")


def wire_debug_requested(flag: bool) -> bool:
    """``--debug-botocore`` or ``TIERCKPT_DEBUG_BOTOCORE`` set to a true value."""
    return config.debug_botocore(flag)


def configure_logging(debug: bool, wire: bool) -> None:
    """WARNING for everyone; DEBUG for tierckpt with ``debug``; botocore's DEBUG (its wire log)
    only when asked for by name (``wire``), since it prints credentials-bearing headers."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if debug or wire:
        logging.getLogger("tierckpt").setLevel(logging.DEBUG)
    if wire or debug:  # --debug alone keeps them quiet even if the root logger is at DEBUG
        for name in WIRE_LOGGERS:
            logging.getLogger(name).setLevel(logging.DEBUG if wire else logging.WARNING)


# -- formatting ---------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "?"


def table(
    rows: Sequence[Sequence[object]], header: Sequence[str], out: TextIO, right: Sequence[int] = ()
) -> None:
    """A plain text table; ``right``: indexes of right-aligned columns."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for n, r in enumerate(cells):
        line = "  ".join(
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)
        )
        out.write(line.rstrip() + "\n")
        if n == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")


def progress_bar(total: int, desc: str) -> Any:
    """A byte progress bar (size, rate, ETA) on stderr; silent when stderr is not a terminal."""
    from tqdm import tqdm

    from tierckpt.cli import _hints

    if _hints.current is not None:  # the bar shows progress from here: no "waiting for"
        _hints.current.quiet()
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None,
        dynamic_ncols=True,
        leave=False,
    )


# -- shared helpers -------------------------------------------------------------------------------
def open_url(args: argparse.Namespace, url: str, *, create: bool = False) -> Backend:
    from tierckpt.cli._hints import watch_retries
    from tierckpt.offline import open_backend

    try:
        backend = open_backend(url, endpoint_url=args.endpoint_url, create=create)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    watch_retries(backend)  # the wait line shows a retried request's attempt
    return backend


class _Closing(AbstractContextManager[Backend]):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __enter__(self) -> Backend:
        return self.backend

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


def opened(args: argparse.Namespace, url: str, *, create: bool = False) -> _Closing:
    return _Closing(open_url(args, url, create=create))
