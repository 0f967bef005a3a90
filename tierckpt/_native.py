"""A host copy with non-temporal stores, compiled on first use; libc's ``memmove`` otherwise.

A plain copy of a block too big for the caches reads each destination line before writing
it (read for ownership): three memory transfers per byte. Non-temporal (streaming) stores
write whole lines without reading them first: two. On the 2-core EPYC the benches run on,
copying 85 MiB took ~9 ms of CPU this way against ~15-18 ms with ``memmove`` (glibc uses
such stores only from a size set for the whole process, ``GLIBC_TUNABLES``, which a library
cannot set), and the capture's copy-and-hash of 85 MiB ~14 ms against ~20.

Python offers no such copy, so this module compiles a small C function (SSE2 streaming
stores, AVX2 where the CPU has it) with the system's C compiler (``$CC``, else ``cc``) into a
per-user cache folder (``$XDG_CACHE_HOME/tierckpt/native``, else ``~/.cache/tierckpt/native``),
under a name made of the source's hash and the machine, written to a temporary name and
renamed into place (two processes compiling at once both end with a whole file), and loads it
with ctypes (which releases the GIL for the call).

Compiling takes about a second: :func:`prepare` starts it on a background thread (the
``Checkpointer``'s construction, or the first capture), and :func:`copier` never waits for
it: until it is done, or if there is no compiler, it fails, the machine is not x86-64, or
``TIERCKPT_NATIVE_COPY=0``, copies use ``memmove`` (one debug log line says why).
The compiled function is checked once on a few odd alignments before it is used.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
from typing import Any

from tierckpt import config

__all__ = ["SOURCE", "copier", "prepare", "wait"]

log = logging.getLogger("tierckpt")

#: the C source: ``tierckpt_nt_copy(dst, src, n)`` copies like ``memcpy`` (no overlap); the
#: destination's unaligned head and the tail shorter than one unrolled step go through
#: ``memcpy``, the body with streaming stores, then ``sfence`` orders them before the return
SOURCE = r"""
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define SMALL 4096

static void nt_sse2(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d) & 15;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
}

__attribute__((target("avx2")))
static void nt_avx2(char *d, const char *s, size_t n) {
    size_t head = (size_t)(-(uintptr_t)d) & 31;
    memcpy(d, s, head);
    d += head; s += head; n -= head;
    size_t body = n & ~(size_t)127;
    for (size_t i = 0; i < body; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    memcpy(d + body, s + body, n - body);
}

void tierckpt_nt_copy(void *dst, const void *src, size_t n) {
    static int avx2 = -1;
    if (n < SMALL) {
        memcpy(dst, src, n);
        return;
    }
    if (avx2 < 0) {
        __builtin_cpu_init();
        avx2 = __builtin_cpu_supports("avx2") ? 1 : 0;
    }
    if (avx2)
        nt_avx2((char *)dst, (const char *)src, n);
    else
        nt_sse2((char *)dst, (const char *)src, n);
    _mm_sfence();
}
"""

_FLAGS = ("-O2", "-shared", "-fPIC")
_SIG = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
#: seconds a compile may take before it is given up (memmove is used instead)
COMPILE_TIMEOUT_S = 120.0


class _State:
    """What :func:`prepare` found: the loaded function (GIL released / kept), or why not."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = False
        self.done = threading.Event()
        self.nogil: Any = None
        self.gil: Any = None
        self.why_not = ""


_state = _State()


def _restart_in_child() -> None:
    # forked while the helper was being built: that thread is not in the child, so the child
    # builds (or loads) it again rather than wait for a thread that will never finish
    global _state
    if not _state.done.is_set():
        _state = _State()


os.register_at_fork(after_in_child=_restart_in_child)


def _supported() -> str:
    """ "" when this platform can build the helper, else why not."""
    if not config.native_copy():
        return "TIERCKPT_NATIVE_COPY is off"
    if sys.platform not in ("linux", "darwin"):
        return f"not built on {sys.platform}"
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return f"no streaming-store copy for {machine or 'this machine'}"
    return ""


def _compiler() -> list[str]:
    return shlex.split(config.c_compiler())


def _library_path() -> str:
    """The helper's file: its name changes with the source, flags, compiler and machine."""
    key = "\0".join([SOURCE, *_FLAGS, *_compiler(), platform.machine(), sys.platform])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(config.native_cache_dir(), f"ntcopy-{platform.machine()}-{digest}.so")


def _compile(path: str) -> None:
    """Build the helper at ``path``: compile into a temporary file beside it, then rename it
    into place (atomic: a process loading ``path`` sees no file or a whole one)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ntcopy-", suffix=".tmp", dir=folder)
    os.close(fd)
    src = tmp + ".c"
    try:
        with open(src, "w") as f:
            f.write(SOURCE)
        proc = subprocess.run(
            [*_compiler(), *_FLAGS, "-o", tmp, src],
            capture_output=True,
            timeout=COMPILE_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise OSError(f"{_compiler()[0]} exited {proc.returncode}: {err[-1] if err else ''}")
        os.replace(tmp, path)
    finally:
        for p in (tmp, src):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def _self_check(fn: Any) -> None:
    """Copy a few awkward lengths at odd offsets and compare: a helper that copies wrong is
    never used."""
    n = 3 * 4096 + 77
    # byte i is i * 7 % 251, which repeats every 251 bytes: one period built in Python, the
    # rest repeated in C (a Python step per byte held the GIL for ms, while the load that
    # often follows a Checkpointer's construction was starting)
    pattern = bytes(i * 7 % 251 for i in range(251))
    src = (ctypes.c_ubyte * (n + 64)).from_buffer_copy((pattern * (n // 251 + 2))[: n + 64])
    for off_s, off_d, length in ((0, 0, n), (3, 1, n - 5), (1, 17, 4096), (5, 0, 4111)):
        dst = (ctypes.c_ubyte * (n + 64))()
        fn(ctypes.addressof(dst) + off_d, ctypes.addressof(src) + off_s, length)
        if bytes(dst)[off_d : off_d + length] != bytes(src)[off_s : off_s + length]:
            raise OSError("the compiled copy gave wrong bytes")


def _load() -> None:
    why = _supported()
    if why:
        _state.why_not = why
        return
    try:
        path = _library_path()
        if not os.path.exists(path):
            _compile(path)
        fns = []
        for loader in (ctypes.CDLL, ctypes.PyDLL):
            fn = loader(path).tierckpt_nt_copy
            fn.argtypes = _SIG
            fn.restype = None
            fns.append(fn)
        _self_check(fns[0])
    except (OSError, subprocess.SubprocessError, AttributeError, ValueError) as exc:
        _state.why_not = f"{type(exc).__name__}: {exc}"
        return
    _state.nogil, _state.gil = fns


def _run() -> None:
    try:
        _load()
    finally:
        if _state.nogil is None:
            log.debug("host copies use memmove (no streaming-store copy: %s)", _state.why_not)
        _state.done.set()


def prepare() -> None:
    """Start building (or loading) the helper on a background thread; once per process. A bad
    ``TIERCKPT_NATIVE_COPY`` raises ``ValueError`` here, in the caller (the writer's
    construction), as every other knob does, not as a traceback of that thread."""
    if _state.started:
        return
    config.native_copy()
    with _state.lock:
        if _state.started:
            return
        _state.started = True
    threading.Thread(target=_run, name="tierckpt-native", daemon=True).start()


def wait(timeout: float | None = None) -> bool:
    """Start the helper if not started and wait for it; True if it is in use."""
    prepare()
    _state.done.wait(timeout)
    return _state.nogil is not None


def copier(gil: bool = False) -> Any:
    """The streaming-store copy ``fn(dst_addr, src_addr, nbytes)`` if it is ready, else
    None (the caller uses ``memmove``); never waits. ``gil``: the binding that keeps the GIL
    (for short copies, see :data:`tierckpt.capture.RELEASE_GIL_BYTES`)."""
    return _state.gil if gil else _state.nogil
