"""The ``tierckpt`` command: look at, check, move and export stored checkpoints.

Every command takes tier URLs: a local folder (``/nvme/run1``, ``file:///nvme/run1``) or
``s3://bucket/prefix`` (with ``--endpoint-url`` or ``AWS_ENDPOINT_URL`` for S3-compatible
servers; credentials from boto3's usual chain). Exit status: 0 success, 1 failure (missing
checkpoint, corrupt data, storage error), 2 usage error. ``--debug`` shows tracebacks.
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

from tierckpt import __version__
from tierckpt.backends.base import Backend
from tierckpt.errors import CorruptChunk, TierCkptError

__all__ = ["build_parser", "main"]

log = logging.getLogger("tierckpt")


class UsageError(Exception):
    """A command line that cannot work (exit status 2)."""


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
    from tierckpt.tools import open_backend

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
def cmd_ls(args: argparse.Namespace) -> int:
    from tierckpt.tools import list_checkpoints, uncommitted_steps

    with opened(args, args.url) as backend:
        listed = list_checkpoints(backend)
        pending = uncommitted_steps(backend)
    if args.json:
        doc = [
            {"step": c.step, "error": c.error} if c.manifest is None else {
                "step": c.step, "created": c.manifest.created, "tier": c.manifest.tier,
                "world_size": c.manifest.world_size, "raw_bytes": c.manifest.raw_bytes,
                "stored_bytes": c.manifest.stored_bytes, "codecs": list(c.manifest.codecs),
                "files": sum(s.size for s in c.manifest.shards),
            }
            for c in listed
        ]
        json.dump({"url": backend.url, "checkpoints": doc, "uncommitted": pending},
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
                rows.append([c.step, "unreadable", "", "", "", "", "", c.error])
                continue
            ratio = m.raw_bytes / m.stored_bytes if m.stored_bytes else 1.0
            rows.append([m.step, fmt_time(m.created), fmt_bytes(m.raw_bytes),
                         fmt_bytes(m.stored_bytes), f"{ratio:.2f}x", m.world_size,
                         m.tier or "?", ",".join(m.codecs) or "?"])
        table(rows, ["STEP", "CREATED", "RAW", "STORED", "RATIO", "RANKS", "TIER", "CODECS"],
              sys.stdout, right=(0, 2, 3, 4, 5))
    if pending:
        print(f"uncommitted (in progress, or leftovers of killed saves): "
              f"{', '.join(map(str, pending))}")
    return _unreadable(listed)


def _unreadable(listed: Sequence[Any]) -> int:
    """Exit status of ``ls``: 1, with the reasons on stderr, when a manifest is unreadable."""
    bad = [c for c in listed if c.manifest is None]
    for c in bad:
        print(f"tierckpt ls: step {c.step} is unreadable: {c.error}", file=sys.stderr)
    return 1 if bad else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from tierckpt.tools import inspect_checkpoint

    with opened(args, args.url) as backend:
        ins = inspect_checkpoint(backend, args.step, by=args.by)
    m = ins.manifest
    if args.json:
        json.dump({
            "step": m.step, "world_size": m.world_size, "tier": m.tier, "created": m.created,
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
    print(f"step {m.step} at {backend.url}")
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
    from tierckpt.retention import committed_steps
    from tierckpt.tools import checkpoint_bytes, resolve_step, verify_checkpoint

    with opened(args, args.url) as backend:
        if args.latest:
            steps = [resolve_step(backend, None)]
        elif args.step is not None:
            steps = [resolve_step(backend, args.step)]
        else:
            steps = committed_steps(backend)
        if not steps:
            print(f"{backend.url}: no committed checkpoint to verify", file=sys.stderr)
            return 1
        for step in steps:
            bar = progress_bar(checkpoint_bytes(backend, step), f"verify step {step}")
            t0 = time.perf_counter()
            try:
                rep = verify_checkpoint(backend, step, progress=bar.update)
            except CorruptChunk as exc:
                bar.close()
                print(f"FAILED step {step}: {exc}", file=sys.stderr)
                if exc.file:
                    print(f"  file: {backend.url}/{exc.file}\n  chunk: {exc.chunk}",
                          file=sys.stderr)
                return 1
            except TierCkptError as exc:
                bar.close()
                print(f"FAILED step {step}: {exc}", file=sys.stderr)
                return 1
            bar.close()
            dt = time.perf_counter() - t0
            print(f"ok  step {step}: {rep.shards} shard(s), {rep.chunks} chunks, "
                  f"{fmt_bytes(rep.stored_bytes)} stored -> {fmt_bytes(rep.raw_bytes)} raw, "
                  f"checksums and decoding ok ({dt:.2f} s)")
    return 0


def _copy(args: argparse.Namespace, src_url: str, dst_url: str) -> int:
    from tierckpt.retention import committed_steps
    from tierckpt.tools import checkpoint_bytes, copy_checkpoint, resolve_step

    with opened(args, src_url) as src, opened(args, dst_url, create=True) as dst:
        if args.all:
            steps = committed_steps(src)
            if not steps:
                print(f"{src.url}: no committed checkpoint", file=sys.stderr)
                return 1
        else:
            steps = [resolve_step(src, args.step)]
        for step in steps:
            total = checkpoint_bytes(src, step)
            bar = progress_bar(total, f"step {step}")
            t0 = time.perf_counter()
            try:
                n = copy_checkpoint(src, dst, step, progress=bar.update)
            except FileExistsError:
                bar.close()
                print(f"skip step {step}: already committed at {dst.url}")
                continue
            finally:
                bar.close()
            dt = time.perf_counter() - t0
            rate = n / dt / 2**20 if dt > 0 else 0.0
            print(f"copied step {step}: {src.url} -> {dst.url}, {fmt_bytes(n)} in {dt:.2f} s "
                  f"({rate:.1f} MiB/s), committed")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from tierckpt.tools import is_s3_url

    if not is_s3_url(args.src) or is_s3_url(args.dest):
        raise UsageError("pull copies s3://bucket/prefix into a local folder: "
                         "tierckpt pull s3://bucket/prefix DIR (use push for the reverse)")
    return _copy(args, args.src, args.dest)


def cmd_push(args: argparse.Namespace) -> int:
    from tierckpt.tools import is_s3_url

    if is_s3_url(args.src) or not is_s3_url(args.dest):
        raise UsageError("push copies a local folder to s3://bucket/prefix: "
                         "tierckpt push DIR s3://bucket/prefix (use pull for the reverse)")
    return _copy(args, args.src, args.dest)


def cmd_gc(args: argparse.Namespace) -> int:
    from tierckpt.tools import gc

    if args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1 (the newest checkpoint is always kept)")
    with opened(args, args.url) as backend:
        plan = gc(backend, args.keep_last, dry_run=args.dry_run,
                  abort_incomplete=args.abort_incomplete)
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{backend.url}: keeping step(s) {', '.join(map(str, plan.retained)) or 'none'}")
    print(f"{verb} {len(plan.expired)} expired checkpoint(s)"
          + (f": {', '.join(map(str, plan.expired))}" if plan.expired else ""))
    print(f"{verb} {len(plan.leftovers)} uncommitted leftover(s)"
          + (f": {', '.join(map(str, plan.leftovers))}" if plan.leftovers else ""))
    if args.abort_incomplete and not args.dry_run:
        print("aborted unfinished writes under steps/")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tierckpt.export import export_safetensors
    from tierckpt.tools import resolve_step

    if args.format != "safetensors":  # pragma: no cover - argparse restricts choices
        raise UsageError(f"unsupported format {args.format!r}")
    with opened(args, args.url) as backend:
        step = resolve_step(backend, args.step)
        results = export_safetensors(backend, step, args.out_dir, rank=args.rank,
                                     single_file=args.single_file, source=args.url)
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


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--endpoint-url", metavar="URL", default=None,
                        help="S3 endpoint (S3-compatible servers); default AWS_ENDPOINT_URL")
    common.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")

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

    sp = add("ls", cmd_ls, "list committed checkpoints: step, created, sizes, tier, codecs")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = add("inspect", cmd_inspect, "tensors, dtypes, sizes and stored/raw ratio per group",
             "Show one checkpoint's tensors, and raw vs stored bytes per tensor group "
             "(top-level key or dtype). Reads only the manifest and the shard indexes.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
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

    sp = add("export", cmd_export, "export a checkpoint as safetensors files + state.json",
             "Export one checkpoint for Hugging Face users: tensors flattened to dotted names "
             "in safetensors files (one per top-level key, or one), non-tensor state in "
             "state.json beside them.")
    sp.add_argument("url", help="tier URL")
    sp.add_argument("out_dir", metavar="OUT_DIR", help="output folder (created)")
    sp.add_argument("--format", choices=["safetensors"], default="safetensors")
    sp.add_argument("--step", type=_step, help="step (default: newest committed)")
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
        ns = argparse.Namespace(command=argv[0], debug=False, endpoint_url=None,
                                bench_args=argv[1:], demo_args=argv[1:],
                                func=cmd_bench if argv[0] == "bench" else cmd_demo)
    else:
        ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if ns.debug else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(ns.func(ns))
    except UsageError as exc:
        print(f"tierckpt {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # expected failures end with a message, not a traceback
        if ns.debug:
            raise
        kind = "" if isinstance(exc, TierCkptError) else f"{type(exc).__name__}: "
        print(f"tierckpt {ns.command}: error: {kind}{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
