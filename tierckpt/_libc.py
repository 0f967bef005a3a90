"""libc calls that Python's standard library does not offer, bound once through ctypes.

ctypes releases the GIL for the length of a call, so a long ``madvise`` or
``sync_file_range`` on a background thread does not hold up the process's Python threads
(training's among them). Each binding is None where the platform lacks it; callers then do
without (the kernel faults pages on first write, writeback starts at fsync).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

__all__ = ["MADV_POPULATE_WRITE", "fs_magic", "madvise", "sync_file_range"]

#: ``madvise`` advice (Linux 5.14+): map a range for writing as write faults would, without
#: writing a byte (older kernels answer EINVAL)
MADV_POPULATE_WRITE = 23


def _bind(name: str, argtypes: list[Any]) -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


#: ``madvise(addr, length, advice)``, or None
madvise: Any = _bind("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
#: ``sync_file_range(fd, offset, nbytes, flags)``: starts writeback without waiting, or None
sync_file_range: Any = _bind(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
#: ``statfs(path, buf)``, or None
_statfs: Any = _bind("statfs", [ctypes.c_char_p, ctypes.c_void_p])


def fs_magic(path: str) -> int | None:
    """The file system type (``f_type``, the first field of ``struct statfs``) of ``path``,
    or None where it cannot be read."""
    if _statfs is None:
        return None
    buf = (ctypes.c_long * 32)()  # struct statfs is 120 bytes on 64-bit Linux
    if _statfs(os.fsencode(path), buf) != 0:
        return None
    return int(buf[0]) & 0xFFFFFFFF
