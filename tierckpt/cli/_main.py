"""The parser and the entry point of the ``tierckpt`` command."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from tierckpt._version import __version__
from tierckpt.cli import _hints
from tierckpt.cli._common import UsageError, configure_logging, wire_debug_requested
from tierckpt.cli._inspect import cmd_inspect, cmd_ls, cmd_verify
from tierckpt.cli._manage import cmd_export, cmd_gc, cmd_pull, cmd_push, cmd_unlock
from tierckpt.cli._tools import cmd_bench, cmd_demo
from tierckpt.errors import TierCkptError
from tierckpt.locations import canonical_url
from tierckpt.redact import redact, scrub_exception


# -- the parser -----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _step(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError("a step is >= 0")
    return v


def _timeline(text: str) -> int:
    from tierckpt.format import MAX_TIMELINE

    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a timeline number: {text!r}") from None
    if not 0 <= v <= MAX_TIMELINE:
        raise argparse.ArgumentTypeError(f"a timeline is in [0, {MAX_TIMELINE}]")
    return v


_TIMELINE_HELP = (
    "the checkpoint's timeline (default: the newest timeline holding the step; "
    "a run resumed from an older step saves on a new timeline)"
)


def _global_options(parser: argparse.ArgumentParser, *, after_command: bool) -> None:
    """The options every command takes, accepted before or after the command's name.

    The copy on each command's parser defaults to SUPPRESS so that an option given before
    the command (``tierckpt --debug ls URL``) is not reset by the command's own default.
    """
    unset: object = argparse.SUPPRESS if after_command else None
    off: object = argparse.SUPPRESS if after_command else False
    parser.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="the object store's endpoint (S3-compatible servers, emulators); default "
        "AWS_ENDPOINT_URL for s3://, STORAGE_EMULATOR_HOST for gs://",
        default=unset,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show tracebacks and tierckpt's debug log",
        default=off,
    )
    parser.add_argument(
        "--debug-botocore",
        action="store_true",
        help="also log botocore's requests and responses (their headers hold "
        "session tokens and signatures: never share this output); "
        "or TIERCKPT_DEBUG_BOTOCORE=1",
        default=off,
    )


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    _global_options(common, after_command=True)

    p = _Parser(
        prog="tierckpt",
        description="Look at, check, copy, clean up and export the checkpoints "
        "tierckpt stores; run its demo and benchmark.",
        epilog="URLs: a local folder, file:///path, s3://bucket/prefix, gs://bucket/prefix or "
        "az://container/prefix. "
        "`tierckpt COMMAND --help` describes each command.",
    )
    p.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    _global_options(p, after_command=False)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(
        name: str, fn: Callable[[argparse.Namespace], int], help_: str, desc: str | None = None
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=desc or help_)
        sp.set_defaults(func=fn)
        return sp

    sp = add(
        "ls",
        cmd_ls,
        "list committed checkpoints: step, created, sizes, tier, codecs",
        "List committed checkpoints, oldest first: step, created, sizes, tier, codecs, "
        "timeline. A run resumed from an older step saves on a new timeline; the older "
        "timeline's checkpoints are marked abandoned until retention removes them. Reads the "
        "manifests only: --check also checks each shard file; verify reads every chunk.",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    sp.add_argument(
        "--check",
        action="store_true",
        help="also check every listed checkpoint's shard files (there, at their size, with "
        "footer and index intact: what gc checks; one read of each file's tail); damaged ones "
        "are marked DAMAGED and the exit status is 1. A flipped byte in a chunk's data needs "
        "tierckpt verify",
    )
    sp.add_argument(
        "--json",
        action="store_true",
        help="machine-readable output; per checkpoint: step, timeline, created, raw_bytes and "
        "stored_bytes (of the chunks), file_count and file_bytes (its shard files: how many, "
        "their total size in bytes; files is file_bytes under its earlier name), codecs, "
        "world_size, tier, pinned, abandoned; with --check, damaged (why, or null)",
    )

    sp = add(
        "inspect",
        cmd_inspect,
        "tensors, dtypes, sizes and stored/raw ratio per group",
        "Show one checkpoint's tensors, and raw vs stored bytes per tensor group "
        "(top-level key or dtype). Reads only the manifest and the shard indexes.",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
    sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)
    sp.add_argument(
        "--by",
        choices=["key", "dtype"],
        default="key",
        help="group tensors by top-level key (default) or dtype",
    )
    sp.add_argument(
        "--limit", type=int, default=40, help="tensors to list (default 40; 0 lists all)"
    )
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = add(
        "verify",
        cmd_verify,
        "read every chunk of every rank; check checksums, decode",
        "Read every chunk of every rank, check its checksum and decode it. Exits 1 at "
        "the first bad chunk, naming the file and chunk.",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=_step, help="only this step (default: every committed step)")
    g.add_argument("--latest", action="store_true", help="only the newest committed step")
    sp.add_argument(
        "--timeline",
        type=_timeline,
        help=_TIMELINE_HELP + "; without --step or --latest: every checkpoint of that timeline",
    )

    for name, fn, a, b, h in (
        ("pull", cmd_pull, "src", "dest", "copy a checkpoint from S3 into a local tier folder"),
        ("push", cmd_push, "src", "dest", "copy a checkpoint from a local tier folder to S3"),
    ):
        sp = add(
            name,
            fn,
            h,
            h + ": shard files first (chunk checksums checked on the way), "
            "the manifest last, so the copy is committed only when whole. A copy already at "
            "DEST is checked first: read whole (as verify does) on a local disk or with "
            "--verify, else its files' sizes and indexes; skipped when intact, replaced "
            "when damaged, and another run's checkpoint of that step is not overwritten "
            "(exit 1).",
        )
        store = "s3://, gs:// or az://bucket/prefix"
        sp.add_argument(
            a, metavar="SRC", type=canonical_url, help=store if name == "pull" else "DIR"
        )
        sp.add_argument(
            b, metavar="DEST", type=canonical_url, help="DIR" if name == "pull" else store
        )
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--step", type=_step, help="step (default: newest committed)")
        g.add_argument("--all", action="store_true", help="every committed step")
        sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)
        sp.add_argument(
            "--verify",
            action="store_true",
            help="read a copy already at DEST whole, every chunk checked, before skipping it "
            "(always done on a local disk; on an object store the default checks its files' "
            "sizes and indexes, and reads no data)",
        )
        sp.add_argument(
            "--codec",
            default="auto",
            help="how the copy's chunks are stored, as the destination tier's codec= setting: "
            "auto (default: raw on a local disk, compressed on S3, as a save there would), "
            "raw, zstd, planes, ...; keep: the bytes as stored at the source (fastest)",
        )
        sp.add_argument(
            "--tier-name",
            default=None,
            help="the tier the copy's manifest names (ls shows it; default: local or s3, "
            "the name LocalTier / S3Tier get by default)",
        )

    sp = add(
        "gc",
        cmd_gc,
        "retention: keep the newest N checkpoints, remove leftovers",
        "Delete committed checkpoints beyond the newest N intact ones (manifest first, then "
        "data; the newest is never deleted) and the data of saves that never committed. "
        "Before deleting, the checkpoints it keeps are checked, newest first: manifest, each "
        "shard file's size, footer and index checksum (--verify: every chunk read and "
        "checked, as `tierckpt verify` does). A damaged one does not count toward N and is "
        "kept too (gc never deletes damage); gc then says which, and exits 1 after doing its "
        "safe work (as it does when it refuses or fails; 0: done, nothing damaged found).",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    sp.add_argument(
        "--keep-last",
        type=int,
        metavar="N",
        help="intact committed checkpoints to keep (>= 1); damaged ones are kept besides",
    )
    sp.add_argument(
        "--dead-runs",
        action="store_true",
        help="URL is a node-RAM folder (NodeRamTier's path, e.g. "
        "/dev/shm/tierckpt-<uid>): remove the runs in it whose writers are gone",
    )
    sp.add_argument(
        "--stale-after",
        type=float,
        default=600.0,
        metavar="S",
        help="with --dead-runs: only runs unchanged for S seconds (default 600)",
    )
    sp.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    sp.add_argument(
        "--verify",
        action="store_true",
        help="read the checkpoints kept whole and check every chunk (finds a flipped byte "
        "in a chunk's data, which the default check of sizes and indexes does not; reads "
        "N checkpoints' bytes)",
    )
    sp.add_argument(
        "--abort-incomplete",
        action="store_true",
        help="also discard unfinished writes (temporary files, open multipart "
        "uploads); only when no job is writing here",
    )
    sp.add_argument(
        "--force",
        action="store_true",
        help="run even though a live job holds this location's writer lease "
        "(gc refuses then: it could delete that job's saves in progress)",
    )

    sp = add(
        "unlock",
        cmd_unlock,
        "remove the writer lease of a dead job (show it first)",
        "Show and remove the writer lease (leases/rank-<r>.json) that lets one job at a "
        "time write to this location, so that a new job need not wait for the lease of a "
        "job that died on another machine to expire. A job that is still running loses "
        "the location: it stops writing there, so unlock refuses a writer this machine "
        "sees running (its process, or a process holding its lock file) unless --force; "
        "one presumed live only by its lease's age (another machine) is unlocked.",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    sp.add_argument("--rank", type=int, default=None, help="only this rank's lease (default: all)")
    sp.add_argument(
        "--force",
        action="store_true",
        help="remove it even from a writer this machine sees running (its process, or its "
        "lock file held): unlock refuses then, as that job would fail at every later save "
        "on this tier",
    )

    sp = add(
        "export",
        cmd_export,
        "export a checkpoint as safetensors files + state.json",
        "Export one checkpoint for Hugging Face users: tensors flattened to dotted names "
        "in safetensors files (one per top-level key, or one), non-tensor state in "
        "state.json beside them.",
    )
    sp.add_argument("url", type=canonical_url, help="tier URL")
    sp.add_argument("out_dir", metavar="OUT_DIR", help="output folder (created)")
    sp.add_argument("--format", choices=["safetensors"], default="safetensors")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
    sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)
    sp.add_argument("--rank", type=int, default=None, help="one rank only (default: all)")
    sp.add_argument(
        "--single-file",
        action="store_true",
        help="one state.safetensors instead of one file per top-level key",
    )
    sp.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="split a file above SIZE into shards with an index.json, as Hugging "
        "Face does (bytes, or 500MB, 5GB, 2GiB; default 5GB)",
    )

    sp = add("bench", cmd_bench, "run the benchmark (arguments go to tierckpt.bench)")
    sp.add_argument("bench_args", nargs=argparse.REMAINDER, help="benchmark arguments")

    sp = add(
        "demo",
        cmd_demo,
        "train, kill -9, restore from S3 on a new node, compare losses",
        "The end-to-end demo; `tierckpt demo --help` lists its options.",
    )
    sp.add_argument("demo_args", nargs=argparse.REMAINDER, help="demo arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierckpt`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `tierckpt bench ...` / `tierckpt demo ...`: everything after the command is theirs,
    # --help included (their own parsers describe their options)
    if argv and argv[0] in ("bench", "demo"):
        ns = argparse.Namespace(
            command=argv[0],
            debug=False,
            debug_botocore=False,
            endpoint_url=None,
            bench_args=argv[1:],
            demo_args=argv[1:],
            func=cmd_bench if argv[0] == "bench" else cmd_demo,
        )
    else:
        ns, extra = parser.parse_known_args(argv)
        if extra:  # said by the command's parser: its usage, and the option meant
            _unrecognized(parser, ns.command, extra)
    try:
        wire = wire_debug_requested(ns.debug_botocore)
    except ValueError as exc:
        print(f"tierckpt {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(ns.debug, wire)
    try:
        return _run(ns)
    except UsageError as exc:
        print(f"tierckpt {ns.command}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`tierckpt ls | head`): nothing to tell, as other tools do;
        # stdout goes to /dev/null so the interpreter's last flush does not complain either
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except Exception as exc:  # expected failures end with a message, not a traceback
        scrub_exception(exc)
        if ns.debug:
            raise
        kind = "" if isinstance(exc, TierCkptError) else f"{type(exc).__name__}: "
        print(f"tierckpt {ns.command}: error: {kind}{redact(str(exc))}", file=sys.stderr)
        urls = [getattr(ns, a, None) for a in ("url", "src", "dest")]
        hint = _hints.hint_for(
            exc, getattr(ns, "endpoint_url", None), [u for u in urls if isinstance(u, str)]
        )
        if hint:
            print(hint, file=sys.stderr)
        return 1


def _unrecognized(parser: argparse.ArgumentParser, command: str, extra: list[str]) -> NoReturn:
    """Exit 2 with ``command``'s usage for arguments it does not take; for an option close to
    one it takes, "did you mean --step?"."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cmd_parser: argparse.ArgumentParser = sub.choices[command]
    options = [o for a in cmd_parser._actions for o in a.option_strings if o.startswith("--")]
    meant = []
    for arg in extra:
        if arg.startswith("-"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
            meant += [f"{arg!r}: did you mean {close[0]}?"] if close else []
    more = f" ({'; '.join(meant)})" if meant else ""
    cmd_parser.error(f"unrecognized arguments: {' '.join(extra)}{more}")


def _run(ns: argparse.Namespace) -> int:
    """The command, with a "waiting for ..." line on stderr when it shows nothing for 2 s
    (bench and demo print their own progress)."""
    if ns.command in ("bench", "demo"):
        return int(ns.func(ns))
    urls = [getattr(ns, a) for a in ("url", "src", "dest") if isinstance(getattr(ns, a, None), str)]
    what = " -> ".join(redact(u) for u in urls) or ns.command
    with _hints.WaitNotice(what) as notice:
        _hints.current = notice
        try:
            return int(ns.func(ns))
        finally:
            _hints.current = None
