"""The configuration table: one :class:`Knob` per setting of tierckpt, each naming the argument
that sets it in code, the environment variable read when the argument is not given, the default,
the type and what it does. :mod:`tierckpt.config` resolves each knob and re-exports this table;
``docs/configuration.md`` shows it (:func:`knobs_markdown` renders it; a test keeps the page,
the table and the variables ``config`` reads equal).

This module imports nothing from tierckpt.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_S3_DRIVER", "KNOBS", "S3_DRIVERS", "Knob", "knobs_markdown"]

#: the S3 clients a tier can move bytes with. obstore is the default: measured faster on the
#: same bench and passing the same backend and reliability suites (docs/object-stores.md);
#: boto3 stays selectable (driver="boto3", TIERCKPT_S3_DRIVER=boto3, or a boto3 client=)
S3_DRIVERS = ("obstore", "boto3")
DEFAULT_S3_DRIVER = "obstore"


@dataclass(frozen=True, slots=True)
class Knob:
    """One row of the configuration table."""

    #: the argument (or field) that sets it in code; "" when only the environment does
    argument: str
    #: the environment variable(s) read when the argument is not given
    env: str
    default: str
    kind: str
    what: str


KNOBS: tuple[Knob, ...] = (
    Knob(
        "Checkpointer / TierWriter(host_buffer_bytes=)",
        "TIERCKPT_HOST_BUFFER_BYTES",
        "1/8 of RAM, at most 32 GiB, divided by LOCAL_WORLD_SIZE, at least 256 MiB",
        "int > 0 (bytes)",
        "the host arena budget: state is captured into it and written out from it",
    ),
    Knob(
        "",
        "LOCAL_WORLD_SIZE",
        "1",
        "int >= 1",
        "ranks on this node (torchrun sets it): the default arena budget is shared among them",
    ),
    Knob(
        "",
        "TIERCKPT_ARENA_PREBUILD",
        "on when CUDA is available",
        "bool",
        "allocate, touch and pin the host arena on a background thread started when the "
        "writer is made, not in the first save",
    ),
    Knob(
        "",
        "TIERCKPT_NATIVE_COPY, CC",
        "on (x86-64 with a C compiler), cc",
        "bool, command",
        "copy host state into the arena with streaming (non-temporal) stores, from a small C "
        "helper compiled once with $CC (else cc) into $XDG_CACHE_HOME/tierckpt/native (else "
        "~/.cache/tierckpt/native); off, or without a compiler: libc memmove",
    ),
    Knob(
        "Checkpointer / TierWriter(chunk_bytes=)",
        "TIERCKPT_CHUNK_BYTES",
        "64 MiB",
        "int > 0 (bytes), a multiple of 4096",
        "target chunk size; lowered to a quarter of the arena (4096-aligned) so at least four "
        "chunks are in flight",
    ),
    Knob(
        "Checkpointer / TierWriter(io_threads=)",
        "TIERCKPT_IO_THREADS",
        "2",
        "int >= 1",
        "threads that encode chunks at save (one pool, shared by the tiers); a Checkpointer's "
        "loads read on max(2, 2 * io_threads) threads",
    ),
    Knob(
        "LocalBackend(direct_io=)",
        "TIERCKPT_DIRECT_IO",
        "on",
        "bool (1/true/yes/on, 0/false/no/off)",
        "raw chunks are written to local tiers with O_DIRECT (off: through the page cache)",
    ),
    Knob(
        "Checkpointer(exit_timeout_s=)",
        "TIERCKPT_EXIT_TIMEOUT_S",
        "60",
        "float (seconds; negative: 0)",
        "at interpreter exit, how long in-flight saves get to finish before they are "
        "abandoned, never committed (0: at once); a bad value is logged and the default used",
    ),
    Knob(
        "Checkpointer(save_deadline=)",
        "TIERCKPT_SAVE_DEADLINE",
        "30",
        "float > 0 (seconds; inf: no deadline)",
        "the longest a save holds training behind a tier fed from the arena that makes no "
        "progress; past it that tier's copy of the save is given up, never committed",
    ),
    Knob(
        "distributed.knobs(commit_timeout=)",
        "TIERCKPT_COMMIT_TIMEOUT_S",
        "600",
        "float > 0 (seconds)",
        "multi-rank: how long rank 0 waits for every rank's completion record before failing "
        "the tier's save",
    ),
    Knob(
        "distributed.knobs(poll_max=)",
        "TIERCKPT_COMMIT_POLL_MAX_S",
        "2",
        "float > 0 (seconds)",
        "multi-rank: the largest pause between two polls for completion records",
    ),
    Knob(
        "S3Tier(read_concurrency=)",
        "TIERCKPT_NODE_S3_CONNECTIONS, LOCAL_WORLD_SIZE",
        "64, 1",
        "int >= 1 each",
        "restore: the node's budget of concurrent S3 GETs, shared by the ranks on the node "
        "(LOCAL_WORLD_SIZE, set by torchrun): a rank issues at most budget // ranks at once",
    ),
    Knob(
        "",
        "TIERCKPT_AUTO_STATE_DIR, XDG_CACHE_HOME",
        "$XDG_CACHE_HOME/tierckpt/auto, else ~/.cache/tierckpt/auto",
        "folder, or off (0/false/no/off)",
        'codec="auto": where each remote tier\'s policy keeps what loads measured (raw and '
        "compressed restore rates, one small file per tier URL and rank), so a restarted job "
        "does not measure again from scratch; off: each process learns alone",
    ),
    Knob(
        "",
        "TIERCKPT_NODE",
        "the host name",
        "string",
        "multi-rank load: which node this rank is on; the node's lowest rank reads each "
        "manifest and shares it with the node's ranks",
    ),
    Knob(
        "",
        "TIERCKPT_PRIVATE_TIERS",
        "none",
        "comma-separated tier names",
        "multi-rank: tiers other ranks cannot read (node-local disks); each rank commits its "
        "own copy there (RAM tiers are always private)",
    ),
    Knob(
        "NodeRamTier(namespace=)",
        "TORCHELASTIC_RUN_ID",
        "default",
        "a run id (set by torchrun)",
        "the node-RAM tier's run folder in /dev/shm: the same for a run's restarted workers",
    ),
    Knob(
        "",
        "TIERCKPT_ATTEMPT_ID",
        "empty",
        "[0-9A-Za-z._-], at most 100",
        "multi-rank without a torch.distributed group: names this job attempt in completion "
        "records (set one per attempt)",
    ),
    Knob(
        "",
        "TIERCKPT_LEASE_TTL",
        "60",
        "float in (0, 604800] (seconds)",
        "how long a writer lease held from another machine stays valid without renewal",
    ),
    Knob(
        "",
        "TIERCKPT_LEASE_WAIT_S",
        "10",
        "float in (0, 604800] (seconds)",
        "how long a save waits for the first lease acquisition, and the first save for the "
        "tiers' listings (a slow store), before going on",
    ),
    Knob(
        "tierckpt --debug-botocore",
        "TIERCKPT_DEBUG_BOTOCORE",
        "off",
        "bool (1/true/yes/on, 0/false/no/off)",
        "CLI: print botocore's wire log (request headers: credentials-bearing)",
    ),
    Knob(
        "S3Tier(driver=)",
        "TIERCKPT_S3_DRIVER",
        DEFAULT_S3_DRIVER,
        "obstore | boto3",
        "the client that moves s3:// bytes (tiers, offline tools, CLI): obstore, measured "
        "faster; boto3 if obstore is absent or a tier is given a boto3 client=",
    ),
    Knob(
        "",
        "TIERCKPT_S3_DIRECT_READS",
        "on",
        "bool (1/true/yes/on, 0/false/no/off)",
        "obstore driver: a load's ranged GETs of s3:// data are read off the socket straight "
        "into the tensors' storages (signed http.client requests; obstore for everything "
        "else and wherever these would differ from its own)",
    ),
    Knob(
        "GCSTier(endpoint_url=)",
        "STORAGE_EMULATOR_HOST",
        "Google",
        "host:port or URL",
        "gs:// tiers and tools talk to this GCS emulator (no OAuth) instead of Google",
    ),
    Knob(
        "open_backend(endpoint_url=)",
        "AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL",
        "AWS",
        "URL",
        "offline tools and the CLI: the S3-compatible endpoint for s3:// URLs",
    ),
)


def knobs_markdown() -> str:
    """:data:`KNOBS` as a Markdown table (the one in ``docs/configuration.md``)."""
    rows = ["| environment | argument | default | type | what it does |", "|---|---|---|---|---|"]
    for k in KNOBS:
        env = ", ".join(f"`{e.strip()}`" for e in k.env.split(","))
        arg = f"`{k.argument}`" if k.argument else "-"
        rows.append(f"| {env} | {arg} | {k.default} | {k.kind} | {k.what} |")
    return "\n".join(rows) + "\n"
