"""The ``tierckpt`` command: look at, check, move and export stored checkpoints.

Every command takes tier URLs: a local folder (``/nvme/run1``, ``file:///nvme/run1``) or
``s3://bucket/prefix`` (with ``--endpoint-url`` or ``AWS_ENDPOINT_URL`` for S3-compatible
servers; credentials from boto3's usual chain). Exit status: 0 success, 1 failure (missing
checkpoint, corrupt data, storage error), 2 usage error. ``--debug`` shows tracebacks and
tierckpt's debug log; botocore's wire log (request headers, including session tokens) only with
``--debug-botocore`` or ``TIERCKPT_DEBUG_BOTOCORE=1``. Messages never show the credentials of an
endpoint URL (``http://KEY:SECRET@host`` is printed as ``http://***@host``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, NoReturn, TextIO

from tierckpt import config
from tierckpt._version import __version__
from tierckpt.backends.base import Backend
from tierckpt.errors import CorruptChunk, TierCkptError
from tierckpt.redact import redact, scrub_exception

__all__ = ["build_parser", "main"]

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


def table(rows: Sequence[Sequence[object]], header: Sequence[str], out: TextIO,
          right: Sequence[int] = ()) -> None:
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

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                file=sys.stderr, disable=None, dynamic_ncols=True, leave=False)


# -- shared helpers -------------------------------------------------------------------------------
def open_url(args: argparse.Namespace, url: str, *, create: bool = False) -> Backend:
    from tierckpt.offline import open_backend

    try:
        return open_backend(url, endpoint_url=args.endpoint_url, create=create)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


class _Closing(AbstractContextManager[Backend]):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __enter__(self) -> Backend:
        return self.backend

    def __exit__(self, *exc: object) -> None:
        self.backend.close()


def opened(args: argparse.Namespace, url: str, *, create: bool = False) -> _Closing:
    return _Closing(open_url(args, url, create=create))


# -- commands -------------------------------------------------------------------------------------
def _lease_doc(info: Any) -> dict[str, Any]:
    rec = info.record
    doc: dict[str, Any] = {"rank": info.rank, "alive": info.alive, "why": info.why}
    if rec is not None:
        doc.update(owner=rec.owner, host=rec.host, pid=rec.pid, started=rec.started,
                   renewed=rec.renewed, ttl=rec.ttl)
    return doc


def _status(c: Any, newest: Any) -> str:
    """``newest`` (what a load returns), ``abandoned`` (an older timeline's) or empty."""
    return "newest" if c.id == newest else "abandoned" if c.abandoned else ""


def cmd_ls(args: argparse.Namespace) -> int:
    from tierckpt.offline import id_text, leases, list_checkpoints, uncommitted_ids

    with opened(args, args.url) as backend:
        listed = list_checkpoints(backend)
        pending = uncommitted_ids(backend)
        writers = leases(backend)
    newest = listed[-1].id if listed else None
    if args.json:
        doc = [
            {"step": c.step, "timeline": c.timeline, "abandoned": c.abandoned, "error": c.error}
            if c.manifest is None else {
                "step": c.step, "timeline": c.timeline, "abandoned": c.abandoned,
                "created": c.manifest.created, "tier": c.manifest.tier,
                "world_size": c.manifest.world_size, "raw_bytes": c.manifest.raw_bytes,
                "stored_bytes": c.manifest.stored_bytes, "codecs": list(c.manifest.codecs),
                "files": sum(s.size for s in c.manifest.shards),
            }
            for c in listed
        ]
        json.dump({"url": backend.url, "checkpoints": doc,
                   "uncommitted": sorted({c.step for c in pending}),
                   "uncommitted_checkpoints": [{"step": c.step, "timeline": c.timeline}
                                               for c in pending],
                   "leases": [_lease_doc(w) for w in writers]},
                  sys.stdout, indent=1)
        sys.stdout.write("\n")
        return _unreadable(listed)
    if not listed:
        print(f"{backend.url}: no committed checkpoint")
    else:
        rows = []
        for c in listed:
            m = c.manifest
            if m is None:
                rows.append([c.step, "unreadable", "", "", "", "", "", c.error, c.timeline,
                             _status(c, newest)])
                continue
            ratio = m.raw_bytes / m.stored_bytes if m.stored_bytes else 1.0
            rows.append([m.step, fmt_time(m.created), fmt_bytes(m.raw_bytes),
                         fmt_bytes(m.stored_bytes), f"{ratio:.2f}x", m.world_size,
                         m.tier or "?", ",".join(m.codecs) or "?", c.timeline,
                         _status(c, newest)])
        table(rows, ["STEP", "CREATED", "RAW", "STORED", "RATIO", "RANKS", "TIER", "CODECS",
                     "TIMELINE", "STATUS"], sys.stdout, right=(0, 2, 3, 4, 5, 8))
        if any(c.abandoned for c in listed):
            print("abandoned: checkpoints of an older timeline (the run went back to an older "
                  "step and went on from there); retention removes them first, as older")
    if pending:
        print(f"uncommitted (in progress, or leftovers of killed saves): "
              f"{', '.join(map(id_text, pending))}")
    for w in writers:
        print(f"writer lease of rank {w.rank}: {w.describe()}")
    return _unreadable(listed)


def _unreadable(listed: Sequence[Any]) -> int:
    """Exit status of ``ls``: 1, with the reasons on stderr, when a manifest is unreadable."""
    bad = [c for c in listed if c.manifest is None]
    for c in bad:
        print(f"tierckpt ls: step {c.step} is unreadable: {c.error}", file=sys.stderr)
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from tierckpt.format import step_prefix
    from tierckpt.layout import describe as describe_layout
    from tierckpt.offline import inspect_checkpoint

    with opened(args, args.url) as backend:
        ins = inspect_checkpoint(backend, args.step, by=args.by, timeline=args.timeline)
    m = ins.manifest
    layout = describe_layout([s.file for s in m.shards], step_prefix(m.step, timeline=m.timeline))
    if args.json:
        json.dump({
            "step": m.step, "timeline": m.timeline, "world_size": m.world_size, "tier": m.tier,
            "format": layout,
            "created": m.created,
            "raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes, "codecs": ins.codecs,
            "metadata": m.metadata or {},
            "groups": [{"name": g.name, "tensors": g.tensors, "raw_bytes": g.raw_bytes,
                        "stored_bytes": round(g.stored_bytes), "ratio": g.ratio,
                        "codecs": sorted(g.codecs)} for g in ins.groups],
            "tensors": [{"rank": t.rank, "name": t.path, "dtype": t.dtype, "shape": list(t.shape),
                         "bytes": t.nbytes} for t in ins.tensors],
        }, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    ratio = m.raw_bytes / m.stored_bytes if m.stored_bytes else 1.0
    print(f"{m.id} at {backend.url} ({layout})")
    print(f"  created {fmt_time(m.created)} by tierckpt {m.library_version or '?'}, "
          f"{m.world_size} rank(s), tier {m.tier or '?'}")
    print(f"  {len(ins.tensors)} tensors in {ins.chunks} chunks; raw {fmt_bytes(m.raw_bytes)}, "
          f"stored {fmt_bytes(m.stored_bytes)} ({ratio:.2f}x); codecs {', '.join(ins.codecs)}")
    if m.metadata:
        print(f"  metadata {json.dumps(m.metadata)[:200]}")
    print()
    table([[g.name, g.tensors, fmt_bytes(g.raw_bytes), fmt_bytes(g.stored_bytes),
            f"{g.ratio:.2f}x", ",".join(sorted(g.codecs))] for g in ins.groups],
          ["GROUP" if args.by == "key" else "DTYPE", "TENSORS", "RAW", "STORED", "RATIO",
           "CODECS"], sys.stdout, right=(1, 2, 3, 4))
    if len(ins.groups) > 1:
        print("  (stored bytes are known per chunk: a chunk that holds several groups is split "
              "among them by raw bytes)")
    print()
    shown = ins.tensors if args.limit == 0 else ins.tensors[: args.limit]
    multi = m.world_size > 1
    table([([t.rank] if multi else []) + [t.path, t.dtype, "x".join(map(str, t.shape)) or "()",
                                          fmt_bytes(t.nbytes)] for t in shown],
          (["RANK"] if multi else []) + ["TENSOR", "DTYPE", "SHAPE", "BYTES"], sys.stdout,
          right=(4,) if multi else (3,))
    if len(shown) < len(ins.tensors):
        print(f"... {len(ins.tensors) - len(shown)} more (--limit 0 shows all)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tierckpt.catalog import committed_ids
    from tierckpt.offline import checkpoint_bytes, resolve_id, verify_checkpoint

    with opened(args, args.url) as backend:
        if args.latest or args.step is not None:
            ids = [resolve_id(backend, args.step, args.timeline)]
        else:
            ids = [c for c in committed_ids(backend)
                   if args.timeline is None or c.timeline == args.timeline]
        if not ids:
            print(f"{backend.url}: no committed checkpoint to verify", file=sys.stderr)
            return 1
        for cid in ids:
            bar = progress_bar(checkpoint_bytes(backend, cid), f"verify {cid}")
            t0 = time.perf_counter()
            try:
                rep = verify_checkpoint(backend, cid, progress=bar.update)
            except CorruptChunk as exc:
                bar.close()
                print(f"FAILED {cid}: {redact(str(exc))}", file=sys.stderr)
                if exc.file:
                    print(f"  file: {backend.url}/{exc.file}\n  chunk: {exc.chunk}",
                          file=sys.stderr)
                return 1
            except TierCkptError as exc:
                bar.close()
                print(f"FAILED {cid}: {redact(str(exc))}", file=sys.stderr)
                return 1
            bar.close()
            dt = time.perf_counter() - t0
            print(f"ok  {cid}: {rep.shards} shard(s), {rep.chunks} chunks, "
                  f"{fmt_bytes(rep.stored_bytes)} stored -> {fmt_bytes(rep.raw_bytes)} raw, "
                  f"checksums and decoding ok ({dt:.2f} s)")
    return 0


def _copy(args: argparse.Namespace, src_url: str, dst_url: str) -> int:
    from tierckpt.catalog import committed_ids
    from tierckpt.offline import checkpoint_bytes, copy_checkpoint, resolve_id

    with opened(args, src_url) as src, opened(args, dst_url, create=True) as dst:
        if args.all:
            ids = [c for c in committed_ids(src)
                   if args.timeline is None or c.timeline == args.timeline]
            if not ids:
                print(f"{src.url}: no committed checkpoint", file=sys.stderr)
                return 1
        else:
            ids = [resolve_id(src, args.step, args.timeline)]
        for cid in ids:
            total = checkpoint_bytes(src, cid)
            bar = progress_bar(total, f"{cid}")
            t0 = time.perf_counter()
            try:
                n = copy_checkpoint(src, dst, cid, progress=bar.update)
            except FileExistsError:
                bar.close()
                print(f"skip {cid}: already committed at {dst.url}")
                continue
            finally:
                bar.close()
            dt = time.perf_counter() - t0
            rate = n / dt / 2**20 if dt > 0 else 0.0
            print(f"copied {cid}: {src.url} -> {dst.url}, {fmt_bytes(n)} in {dt:.2f} s "
                  f"({rate:.1f} MiB/s), committed")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tierckpt.offline import is_s3_url

    if not is_s3_url(args.src) or is_s3_url(args.dest):
        raise UsageError("pull copies s3://bucket/prefix into a local folder: "
                         "tierckpt pull s3://bucket/prefix DIR (use push for the reverse)")
    return _copy(args, args.src, args.dest)


def cmd_push(args: argparse.Namespace) -> int:
    from tierckpt.offline import is_s3_url

    if is_s3_url(args.src) or not is_s3_url(args.dest):
        raise UsageError("push copies a local folder to s3://bucket/prefix: "
                         "tierckpt push DIR s3://bucket/prefix (use pull for the reverse)")
    return _copy(args, args.src, args.dest)


def cmd_gc(args: argparse.Namespace) -> int:
    from tierckpt.offline import gc, id_text

    if args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1 (the newest checkpoint is always kept)")
    with opened(args, args.url) as backend:
        plan = gc(backend, args.keep_last, dry_run=args.dry_run,
                  abort_incomplete=args.abort_incomplete, force=args.force)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{backend.url}: keeping step(s) {', '.join(map(id_text, plan.retained)) or 'none'}")
    print(f"{verb} {len(plan.expired)} expired checkpoint(s)"
          + (f": {', '.join(map(id_text, plan.expired))}" if plan.expired else ""))
    print(f"{verb} {len(plan.leftovers)} uncommitted leftover(s)"
          + (f": {', '.join(map(id_text, plan.leftovers))}" if plan.leftovers else ""))
    if args.abort_incomplete and not args.dry_run:
        print("aborted unfinished writes under steps/")
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    from tierckpt.offline import unlock

    with opened(args, args.url) as backend:
        removed = unlock(backend, args.rank)
    if not removed:
        which = f"rank {args.rank}'s " if args.rank is not None else ""
        print(f"{backend.url}: no {which}writer lease here")
        return 0
    for w in removed:
        print(f"removed the writer lease of rank {w.rank}: {w.describe()}")
        if w.alive:
            print("  that writer looked live: if it still runs, it stops writing and deleting "
                  "here at its next lease check, and its later saves to this tier fail")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tierckpt.export import export_safetensors
    from tierckpt.offline import resolve_id

    if args.format != "safetensors":  # pragma: no cover - argparse restricts choices
        raise UsageError(f"unsupported format {args.format!r}")
    with opened(args, args.url) as backend:
        cid = resolve_id(backend, args.step, args.timeline)
        step = cid.step
        results = export_safetensors(backend, step, args.out_dir, rank=args.rank,
                                     single_file=args.single_file, source=args.url,
                                     timeline=cid.timeline)
    for res in results:
        print(f"exported step {step} rank {res.rank}: {res.tensors} tensors")
        for f in res.files:
            print(f"  {f}")
        if res.skipped:
            print(f"  skipped (dtype not supported by safetensors): {', '.join(res.skipped)}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from tierckpt import bench
    except ImportError as exc:
        print(f"tierckpt bench is not available in this installation ({exc})", file=sys.stderr)
        return 1
    main_fn: Callable[[list[str]], int] = bench.main
    return int(main_fn(list(args.bench_args)))


def cmd_demo(args: argparse.Namespace) -> int:
    from tierckpt import demo

    return demo.main(list(args.demo_args))


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


_TIMELINE_HELP = ("the checkpoint's timeline (default: the newest timeline holding the step; "
                  "a run resumed from an older step saves on a new timeline)")


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--endpoint-url", metavar="URL", default=None,
                        help="S3 endpoint (S3-compatible servers); default AWS_ENDPOINT_URL")
    common.add_argument("--debug", action="store_true",
                        help="show tracebacks and tierckpt's debug log")
    common.add_argument("--debug-botocore", action="store_true",
                        help="also log botocore's requests and responses (their headers hold "
                             "session tokens and signatures: never share this output); "
                             "or TIERCKPT_DEBUG_BOTOCORE=1")

    p = _Parser(prog="tierckpt",
                description="Look at, check, copy, clean up and export the checkpoints "
                            "tierckpt stores; run its demo and benchmark.",
                epilog="URLs: a local folder, file:///path or s3://bucket/prefix. "
                       "`tierckpt COMMAND --help` describes each command.")
    p.add_argument("--version", action="version", version=f"tierckpt {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str,
            desc: str | None = None) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, parents=[common], help=help_, description=desc or help_)
        sp.set_defaults(func=fn)
        return sp

    sp = add("ls", cmd_ls, "list committed checkpoints: step, created, sizes, tier, codecs",
             "List committed checkpoints, oldest first: step, created, sizes, tier, codecs, "
             "timeline. A run resumed from an older step saves on a new timeline; the older "
             "timeline's checkpoints are marked abandoned until retention removes them.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = add("inspect", cmd_inspect, "tensors, dtypes, sizes and stored/raw ratio per group",
             "Show one checkpoint's tensors, and raw vs stored bytes per tensor group "
             "(top-level key or dtype). Reads only the manifest and the shard indexes.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
    sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)
    sp.add_argument("--by", choices=["key", "dtype"], default="key",
                    help="group tensors by top-level key (default) or dtype")
    sp.add_argument("--limit", type=int, default=40,
                    help="tensors to list (default 40; 0 lists all)")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = add("verify", cmd_verify, "read every chunk of every rank; check checksums, decode",
             "Read every chunk of every rank, check its checksum and decode it. Exits 1 at "
             "the first bad chunk, naming the file and chunk.")
    sp.add_argument("url", help="tier URL")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--step", type=_step, help="only this step (default: every committed step)")
    g.add_argument("--latest", action="store_true", help="only the newest committed step")
    sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP + "; without --step or "
                    "--latest: every checkpoint of that timeline")

    for name, fn, a, b, h in (
        ("pull", cmd_pull, "src", "dest", "copy a checkpoint from S3 into a local tier folder"),
        ("push", cmd_push, "src", "dest", "copy a checkpoint from a local tier folder to S3"),
    ):
        sp = add(name, fn, h, h + ": shard files first (chunk checksums checked on the way), "
                 "the manifest last, so the copy is committed only when whole.")
        sp.add_argument(a, metavar="SRC", help="s3://bucket/prefix" if name == "pull" else "DIR")
        sp.add_argument(b, metavar="DEST", help="DIR" if name == "pull" else "s3://bucket/prefix")
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--step", type=_step, help="step (default: newest committed)")
        g.add_argument("--all", action="store_true", help="every committed step")
        sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)

    sp = add("gc", cmd_gc, "retention: keep the newest N checkpoints, remove leftovers",
             "Delete committed checkpoints beyond the newest N (manifest first, then data; the "
             "newest is never deleted) and the data of saves that never committed.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--keep-last", type=int, required=True, metavar="N",
                    help="committed checkpoints to keep (>= 1)")
    sp.add_argument("--dry-run", action="store_true", help="say what would be deleted")
    sp.add_argument("--abort-incomplete", action="store_true",
                    help="also discard unfinished writes (temporary files, open multipart "
                         "uploads); only when no job is writing here")
    sp.add_argument("--force", action="store_true",
                    help="run even though a live job holds this location's writer lease "
                         "(gc refuses then: it could delete that job's saves in progress)")

    sp = add("unlock", cmd_unlock, "remove the writer lease of a dead job (show it first)",
             "Show and remove the writer lease (leases/rank-<r>.json) that lets one job at a "
             "time write to this location, so that a new job need not wait for the lease of a "
             "job that died on another machine to expire. A job that is still running loses "
             "the location: it stops writing there.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--rank", type=int, default=None, help="only this rank's lease (default: all)")

    sp = add("export", cmd_export, "export a checkpoint as safetensors files + state.json",
             "Export one checkpoint for Hugging Face users: tensors flattened to dotted names "
             "in safetensors files (one per top-level key, or one), non-tensor state in "
             "state.json beside them.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("out_dir", metavar="OUT_DIR", help="output folder (created)")
    sp.add_argument("--format", choices=["safetensors"], default="safetensors")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
    sp.add_argument("--timeline", type=_timeline, help=_TIMELINE_HELP)
    sp.add_argument("--rank", type=int, default=None, help="one rank only (default: all)")
    sp.add_argument("--single-file", action="store_true",
                    help="one state.safetensors instead of one file per top-level key")

    sp = add("bench", cmd_bench, "run the benchmark (arguments go to tierckpt.bench)")
    sp.add_argument("bench_args", nargs=argparse.REMAINDER, help="benchmark arguments")

    sp = add("demo", cmd_demo, "train, kill -9, restore from S3 on a new node, compare losses",
             "The end-to-end demo; `tierckpt demo --help` lists its options.")
    sp.add_argument("demo_args", nargs=argparse.REMAINDER, help="demo arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tierckpt`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `tierckpt bench ...` / `tierckpt demo ...`: everything after the command is theirs,
    # --help included (their own parsers describe their options)
    if argv and argv[0] in ("bench", "demo"):
        ns = argparse.Namespace(command=argv[0], debug=False, debug_botocore=False,
                                endpoint_url=None,
                                bench_args=argv[1:], demo_args=argv[1:],
                                func=cmd_bench if argv[0] == "bench" else cmd_demo)
    else:
        ns = parser.parse_args(argv)
    try:
        wire = wire_debug_requested(ns.debug_botocore)
    except ValueError as exc:
        print(f"tierckpt {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(ns.debug, wire)
    try:
        return int(ns.func(ns))
    except UsageError as exc:
        print(f"tierckpt {ns.command}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # expected failures end with a message, not a traceback
        scrub_exception(exc)
        if ns.debug:
            raise
        kind = "" if isinstance(exc, TierCkptError) else f"{type(exc).__name__}: "
        print(f"tierckpt {ns.command}: error: {kind}{redact(str(exc))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
