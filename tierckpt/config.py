"""Every knob of tierckpt in one place: the table :data:`KNOBS` (kept in :mod:`tierckpt._knobs`,
re-exported here) and one function per knob that resolves it (an argument, else the
environment variable, else the default).

The runtime package reads the environment only here (a test parses the package to hold that),
so each variable is parsed one way and a bad value gives one clear :class:`ValueError` that
names the variable, the value and what it expects. ``docs/configuration.md`` shows the table
(:func:`knobs_markdown` renders it; a test keeps the page and the table equal).

This module imports only the table from tierckpt: every other module may import it.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from tierckpt._knobs import DEFAULT_S3_DRIVER, KNOBS, S3_DRIVERS, Knob, knobs_markdown

__all__ = [
    "CHUNK_ALIGN",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_COMMIT_POLL_MAX_S",
    "DEFAULT_COMMIT_TIMEOUT_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "DEFAULT_IO_THREADS",
    "DEFAULT_LEASE_TTL_S",
    "DEFAULT_LEASE_WAIT_S",
    "DEFAULT_S3_DRIVER",
    "DEFAULT_SAVE_DEADLINE_S",
    "KNOBS",
    "LEASE_MAX_S",
    "Knob",
    "WriterConfig",
    "attempt_id",
    "auto_state_dir",
    "commit_poll_max_s",
    "commit_timeout_s",
    "debug_botocore",
    "direct_io",
    "exit_timeout_s",
    "host_buffer_bytes",
    "knobs_markdown",
    "torchelastic_run_id",
    "lease_ttl_s",
    "lease_wait_s",
    "node_name",
    "private_tiers",
    "resolve_writer_config",
    "S3_DRIVERS",
    "gcs_emulator_host",
    "obstore_get_settings",
    "proxy_in_environment",
    "s3_direct_reads",
    "s3_driver",
    "s3_endpoint_url",
    "s3_read_concurrency",
    "save_deadline_s",
    "total_ram",
]

#: chunks and arena slots are multiples of this (O_DIRECT writes straight from the arena)
CHUNK_ALIGN = 4096
DEFAULT_CHUNK_BYTES = 64 << 20
DEFAULT_IO_THREADS = 2
DEFAULT_EXIT_TIMEOUT_S = 60.0
DEFAULT_SAVE_DEADLINE_S = 30.0
DEFAULT_COMMIT_TIMEOUT_S = 600.0
DEFAULT_COMMIT_POLL_MAX_S = 2.0
DEFAULT_LEASE_TTL_S = 60.0
DEFAULT_LEASE_WAIT_S = 10.0
#: the longest lease ttl / wait accepted (a week)
LEASE_MAX_S = 7 * 86400.0
#: an attempt id goes into completion-record names: a short, path-safe word
_ATTEMPT_RE = re.compile(r"^[0-9A-Za-z._-]{0,100}$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# -- parsing the environment ------------------------------------------------------------------
def _raw(name: str) -> str | None:
    """The variable's value stripped; None when unset or blank (blank means the default)."""
    text = os.environ.get(name, "").strip()
    return text or None


def _env_int(name: str, minimum: int) -> int | None:
    text = _raw(name)
    if text is None:
        return None
    try:
        v = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a whole number (e.g. {1 << 26})") from None
    if v < minimum:
        raise ValueError(f"{name}={text!r}: expected a number >= {minimum}")
    return v


def _env_seconds(name: str, *, low: float, high: float, low_ok: bool) -> float | None:
    """A number of seconds in [low, high] (``low_ok``) or (low, high]; None when unset."""
    text = _raw(name)
    if text is None:
        return None
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a number of seconds") from None
    above = v >= low if low_ok else v > low
    if math.isnan(v) or not above or v > high:
        bounds = f"{'[' if low_ok else '('}{low:g}, {high:g}]"
        raise ValueError(f"{name}={text!r}: expected seconds in {bounds}")
    return v


def _env_bool(name: str) -> bool | None:
    text = _raw(name)
    if text is None:
        return None
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected one of {', '.join(_TRUE + _FALSE)}")


# -- one function per knob --------------------------------------------------------------------
def total_ram() -> int:
    """Physical memory in bytes (16 GiB where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def host_buffer_bytes(arg: int | None = None) -> int:
    """The host arena budget: ``arg`` (0 or None: not given), else
    ``TIERCKPT_HOST_BUFFER_BYTES``, else 1/8 of physical RAM, at most 32 GiB, divided by the
    ranks that share the node (``LOCAL_WORLD_SIZE``, as torchrun sets it), at least 256 MiB."""
    if arg:
        if arg < 0:
            raise ValueError(f"host_buffer_bytes must be > 0, got {arg}")
        return arg
    env = _env_int("TIERCKPT_HOST_BUFFER_BYTES", 1)
    if env is not None:
        return env
    return max(256 << 20, min(total_ram() // 8, 32 << 30) // local_world_size())


def local_world_size() -> int:
    """The ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun), else 1."""
    return _env_int("LOCAL_WORLD_SIZE", 1) or 1


def arena_prebuild() -> bool:
    """Whether a writer allocates, touches and pins its host arena on a background thread
    started at construction (not in the first save): ``TIERCKPT_ARENA_PREBUILD`` (1/0), else
    on when CUDA is available (pinning a large arena takes seconds)."""
    env = _env_bool("TIERCKPT_ARENA_PREBUILD")
    if env is not None:
        return env
    import torch

    return bool(torch.cuda.is_available())


def native_copy() -> bool:
    """Whether host copies may use the compiled streaming-store copy (``tierckpt._native``):
    ``TIERCKPT_NATIVE_COPY`` (1/0), on by default."""
    env = _env_bool("TIERCKPT_NATIVE_COPY")
    return True if env is None else env


def c_compiler() -> str:
    """The C compiler that builds the streaming-store copy: ``CC``, else ``cc``."""
    return _raw("CC") or "cc"


def native_cache_dir() -> str:
    """Where compiled helpers are kept: ``$XDG_CACHE_HOME/tierckpt/native``, else
    ``~/.cache/tierckpt/native``."""
    return _user_cache("native")


def _user_cache(name: str) -> str:
    """``$XDG_CACHE_HOME/tierckpt/<name>``, else ``~/.cache/tierckpt/<name>``."""
    cache = _raw("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "tierckpt", name)


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """The resolved sizes of a writer (``Checkpointer`` or DCP ``TierWriter``)."""

    host_buffer_bytes: int
    #: a multiple of :data:`CHUNK_ALIGN`, at most a quarter of the arena
    chunk_bytes: int
    io_threads: int


def resolve_writer_config(
    host_buffer_bytes: int | None = None,
    chunk_bytes: int | None = None,
    io_threads: int | None = None,
) -> WriterConfig:
    """Arena budget, chunk size and encoder threads from the arguments (0 or None: not given),
    else ``TIERCKPT_HOST_BUFFER_BYTES`` / ``TIERCKPT_CHUNK_BYTES`` / ``TIERCKPT_IO_THREADS``,
    else the defaults.

    The chunk size is lowered to a quarter of the arena (rounded down to 4096, at least 4096)
    so that capture and writes overlap; a chunk size that is not a multiple of 4096 is refused
    (local tiers write chunks straight from the 4096-aligned arena with O_DIRECT).
    """
    host = _host_buffer(host_buffer_bytes)
    if chunk_bytes and chunk_bytes < 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    chunk = chunk_bytes or _env_int("TIERCKPT_CHUNK_BYTES", 1) or DEFAULT_CHUNK_BYTES
    # keep at least 4 slots in the arena so capture and writes overlap
    chunk = min(chunk, max(CHUNK_ALIGN, host // 4 // CHUNK_ALIGN * CHUNK_ALIGN))
    if chunk < CHUNK_ALIGN or chunk % CHUNK_ALIGN:
        raise ValueError(
            f"chunk_bytes must be a multiple of {CHUNK_ALIGN}, got {chunk} (the chunk_bytes "
            "argument or TIERCKPT_CHUNK_BYTES)"
        )
    if io_threads and io_threads < 0:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    threads = io_threads or _env_int("TIERCKPT_IO_THREADS", 1) or DEFAULT_IO_THREADS
    return WriterConfig(host, chunk, threads)


_host_buffer = host_buffer_bytes  # resolve_writer_config's argument shadows the function


def direct_io(arg: bool | None = None) -> bool:
    """Local tiers write raw chunks with O_DIRECT: ``arg``, else ``TIERCKPT_DIRECT_IO``, else
    on."""
    if arg is not None:
        return arg
    env = _env_bool("TIERCKPT_DIRECT_IO")
    return True if env is None else env


#: proxy variables obstore's HTTP client honours (lower case too)
PROXY_VARIABLES = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "all_proxy",
)


def proxy_in_environment() -> str | None:
    """The first of :data:`PROXY_VARIABLES` set in the environment, else None (with a proxy,
    the object-store driver's direct reads stay off: obstore's requests go through it)."""
    return next((n for n in PROXY_VARIABLES if os.environ.get(n, "").strip()), None)


#: variables obstore's S3 store reads that change how it sends a GET (a customer key, requester
#: pays, no signature, S3 Express): with any set, the direct reads leave every read to it
OBSTORE_GET_VARIABLES = (
    "AWS_SSE_CUSTOMER_KEY_BASE64",
    "AWS_REQUEST_PAYER",
    "AWS_SKIP_SIGNATURE",
    "AWS_S3_EXPRESS",
)


def obstore_get_settings() -> list[str]:
    """The :data:`OBSTORE_GET_VARIABLES` set in the environment."""
    return [n for n in OBSTORE_GET_VARIABLES if os.environ.get(n, "").strip()]


def s3_direct_reads() -> bool:
    """The object-store driver reads a load's ``s3://`` data off the socket into place:
    ``TIERCKPT_S3_DIRECT_READS``, else on."""
    env = _env_bool("TIERCKPT_S3_DIRECT_READS")
    return True if env is None else env


def exit_timeout_s(arg: float | None = None) -> float:
    """Seconds in-flight saves get at interpreter exit: ``arg`` (negative: 0), else
    ``TIERCKPT_EXIT_TIMEOUT_S`` (a number; negative: 0), else :data:`DEFAULT_EXIT_TIMEOUT_S`."""
    if arg is not None:
        return max(0.0, float(arg))
    env = _env_seconds("TIERCKPT_EXIT_TIMEOUT_S", low=-math.inf, high=math.inf, low_ok=True)
    return DEFAULT_EXIT_TIMEOUT_S if env is None else max(0.0, env)


def save_deadline_s(arg: float | None = None) -> float:
    """Seconds a save may wait behind a tier that makes no progress: ``arg``, else
    ``TIERCKPT_SAVE_DEADLINE`` (``inf``: no deadline), else :data:`DEFAULT_SAVE_DEADLINE_S`."""
    if arg is not None:
        if isinstance(arg, bool) or not isinstance(arg, (int, float)) or not arg > 0:
            raise ValueError(
                f"save_deadline must be a number of seconds > 0 (inf: no deadline), got {arg!r}"
            )
        return float(arg)
    env = _env_seconds("TIERCKPT_SAVE_DEADLINE", low=0.0, high=math.inf, low_ok=False)
    return DEFAULT_SAVE_DEADLINE_S if env is None else env


def commit_timeout_s() -> float | None:
    """``TIERCKPT_COMMIT_TIMEOUT_S``, or None (the multi-rank knobs' default applies)."""
    return _env_seconds("TIERCKPT_COMMIT_TIMEOUT_S", low=0.0, high=math.inf, low_ok=False)


def commit_poll_max_s() -> float | None:
    """``TIERCKPT_COMMIT_POLL_MAX_S``, or None (the multi-rank knobs' default applies)."""
    return _env_seconds("TIERCKPT_COMMIT_POLL_MAX_S", low=0.0, high=math.inf, low_ok=False)


#: the node's default budget of concurrent S3 GETs at restore (TIERCKPT_NODE_S3_CONNECTIONS)
DEFAULT_NODE_S3_CONNECTIONS = 64


def s3_read_concurrency(arg: int | None = None) -> int:
    """How many ranged GETs one rank's S3 backend runs at once: ``arg``, else its share of the
    node's budget, ``TIERCKPT_NODE_S3_CONNECTIONS`` (64) // ``LOCAL_WORLD_SIZE`` (torchrun's
    ranks on this node; 1), at least 1. The ranks of a node restoring together then never
    open more connections than the node's budget."""
    if arg is not None:
        if type(arg) is not int or arg < 1:
            raise ValueError(f"read_concurrency must be an int >= 1, got {arg!r}")
        return arg
    budget = _env_int("TIERCKPT_NODE_S3_CONNECTIONS", 1) or DEFAULT_NODE_S3_CONNECTIONS
    local = _env_int("LOCAL_WORLD_SIZE", 1) or 1
    return max(1, budget // local)


def node_name() -> str | None:
    """``TIERCKPT_NODE`` (None when unset: the host name tells the nodes apart)."""
    return _raw("TIERCKPT_NODE")


def auto_state_dir() -> str | None:
    """Where ``codec="auto"`` keeps what loads measured (None: nowhere, ``off``):
    ``TIERCKPT_AUTO_STATE_DIR``, else ``$XDG_CACHE_HOME/tierckpt/auto``, else
    ``~/.cache/tierckpt/auto``."""
    text = _raw("TIERCKPT_AUTO_STATE_DIR")
    if text is not None:
        return None if text.lower() in _FALSE else os.path.expanduser(text)
    return _user_cache("auto")


def private_tiers() -> frozenset[str]:
    """Tier names in ``TIERCKPT_PRIVATE_TIERS`` (comma-separated; blanks ignored)."""
    text = _raw("TIERCKPT_PRIVATE_TIERS") or ""
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def torchelastic_run_id() -> str:
    """torchrun's run id (``TORCHELASTIC_RUN_ID``; "" when unset): the same for the restarted
    workers of a run, so the node-RAM tier names its folder after it."""
    return _raw("TORCHELASTIC_RUN_ID") or ""


def attempt_id() -> str:
    """``TIERCKPT_ATTEMPT_ID`` ("" when unset): at most 100 of [0-9A-Za-z._-]."""
    text = _raw("TIERCKPT_ATTEMPT_ID") or ""
    if not _ATTEMPT_RE.match(text):
        raise ValueError(
            f"TIERCKPT_ATTEMPT_ID={text[:120]!r}: may hold only [0-9A-Za-z._-], 100 at most"
        )
    return text


def lease_ttl_s() -> float:
    """``TIERCKPT_LEASE_TTL`` (seconds in (0, a week]), else :data:`DEFAULT_LEASE_TTL_S`."""
    env = _env_seconds("TIERCKPT_LEASE_TTL", low=0.0, high=LEASE_MAX_S, low_ok=False)
    return DEFAULT_LEASE_TTL_S if env is None else env


def lease_wait_s() -> float:
    """``TIERCKPT_LEASE_WAIT_S`` (seconds in (0, a week]), else :data:`DEFAULT_LEASE_WAIT_S`."""
    env = _env_seconds("TIERCKPT_LEASE_WAIT_S", low=0.0, high=LEASE_MAX_S, low_ok=False)
    return DEFAULT_LEASE_WAIT_S if env is None else env


def debug_botocore(flag: bool = False) -> bool:
    """botocore's wire log: ``flag`` (``--debug-botocore``) or ``TIERCKPT_DEBUG_BOTOCORE``."""
    return flag or bool(_env_bool("TIERCKPT_DEBUG_BOTOCORE"))


def s3_endpoint_url(arg: str | None = None) -> str | None:
    """The S3 endpoint: ``arg``, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``, else
    None (AWS)."""
    return arg or _raw("AWS_ENDPOINT_URL_S3") or _raw("AWS_ENDPOINT_URL") or None


def aws_environment() -> dict[str, str | None]:
    """The AWS variables that boto3's credential chain reads first (None: unset), so that the
    object-store driver takes static keys from the environment without importing boto3:
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``,
    ``AWS_DEFAULT_REGION``, ``AWS_REGION``."""
    names = (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_REGION",
        "AWS_REGION",
    )
    return {n: _raw(n) for n in names}


def s3_driver(arg: str | None = None) -> str:
    """The S3 client: ``arg``, else ``TIERCKPT_S3_DRIVER``, else :data:`DEFAULT_S3_DRIVER`
    (boto3 when obstore is not installed)."""
    choice = arg or (_raw("TIERCKPT_S3_DRIVER") or "").strip().lower() or None
    if choice is not None:
        if choice not in S3_DRIVERS:
            raise ValueError(f"TIERCKPT_S3_DRIVER={choice!r}: use one of {', '.join(S3_DRIVERS)}")
        return choice
    if DEFAULT_S3_DRIVER == "obstore":
        import importlib.util

        if importlib.util.find_spec("obstore") is None:
            return "boto3"
    return DEFAULT_S3_DRIVER


def gcs_emulator_host(arg: str | None = None) -> str | None:
    """The GCS endpoint override: ``arg``, else ``STORAGE_EMULATOR_HOST`` (the variable Google's
    own clients read), else None (Google)."""
    return arg or _raw("STORAGE_EMULATOR_HOST")
