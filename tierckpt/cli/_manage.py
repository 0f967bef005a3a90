"""The commands that copy, remove or write: ``pull``, ``push``, ``gc``, ``unlock``, ``export``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import TYPE_CHECKING, Any

from tierckpt.backends.base import Backend
from tierckpt.cli._common import (
    UsageError,
    fmt_bytes,
    opened,
    progress_bar,
)
from tierckpt.format import CheckpointId, manifest_name

if TYPE_CHECKING:
    from tierckpt.offline import GcPlan


def _copy(args: argparse.Namespace, src_url: str, dst_url: str) -> int:
    from tierckpt.catalog import committed_ids
    from tierckpt.codecs import codec_ids
    from tierckpt.offline import resolve_id

    codec = getattr(args, "codec", "auto") or "auto"
    if codec not in ("auto", "keep") and codec not in codec_ids():
        raise UsageError(
            f"--codec {codec!r} is not a codec here: auto, keep, or one of "
            f"{', '.join(sorted(codec_ids()))}"
        )
    # the copy's manifest names the tier it is on now, not the one it was copied from
    label = getattr(args, "tier_name", None) or _STORE_LABEL.get(
        dst_url.partition("://")[0], "local"
    )
    failed = 0
    with opened(args, src_url) as src, opened(args, dst_url, create=True) as dst:
        if args.all:
            ids = [
                c
                for c in committed_ids(src)
                if args.timeline is None or c.timeline == args.timeline
            ]
            if not ids:
                print(f"{src.url}: no committed checkpoint", file=sys.stderr)
                return 1
        else:
            ids = [resolve_id(src, args.step, args.timeline)]
        for cid in ids:
            failed += not _copy_one(src, dst, cid, codec, label, args.verify)
    return 1 if failed else 0


def _copy_one(
    src: Backend, dst: Backend, cid: CheckpointId, codec: str, label: str, read_whole: bool
) -> bool:
    """Copy ``cid`` unless ``dst`` has an intact copy of it; replace a damaged one. False
    (said on stderr) where ``dst`` holds another checkpoint under that id. ``read_whole``:
    read a copy already at ``dst`` whole (always on a local disk)."""
    from tierckpt.offline import checkpoint_bytes, copy_checkpoint
    from tierckpt.offline._recode import recode_checkpoint
    from tierckpt.offline._repair import destination_copy, replace_copy

    total = checkpoint_bytes(src, cid)
    read_whole = read_whole or not dst.is_remote
    bar = progress_bar(total if read_whole else 0, f"check {cid} at the destination")
    try:  # a copy already there: read whole and checked as `tierckpt verify` does, or (on an
        # object store, unless --verify) its files' sizes and indexes
        found = destination_copy(src, dst, cid, progress=bar.update, read_whole=read_whole)
    finally:
        bar.close()
    if found.state == "intact":
        how = "verified intact" if read_whole else "sizes and indexes checked; --verify reads it"
        print(f"skip {cid}: already committed at {dst.url} ({how})")
        return True
    if found.state == "other":
        print(
            f"not copied {cid}: {dst.url} holds another checkpoint as {cid}, not a copy of "
            f"{src.url}'s ({found.why}); nothing was changed there. Copy into another folder "
            "or prefix, or remove that checkpoint there first "
            f"({manifest_name(cid.step, timeline=cid.timeline)}, then `tierckpt gc`)",
            file=sys.stderr,
        )
        return False

    def copy(bar: Any) -> int:
        if codec == "keep":
            return copy_checkpoint(src, dst, cid, progress=bar.update, tier_label=label)
        # stored as a tier with that codec there stores it (auto: compressed on S3, raw on
        # a local disk), not as the source happened to store it
        return recode_checkpoint(src, dst, cid, codec, progress=bar.update, tier_label=label)

    bar = progress_bar(total, f"{cid}")
    t0 = time.perf_counter()
    gone = False
    try:
        if found.state == "damaged":
            print(
                f"{dst.url}: its copy of {cid} is damaged ({found.why}): replacing it with "
                f"{src.url}'s (uncommitted until the new copy is whole)",
                file=sys.stderr,
            )
            try:
                n = replace_copy(dst, cid, lambda: copy(bar))
            except BaseException:  # a refusal (a writer there) changed nothing: no note
                with contextlib.suppress(Exception):
                    gone = not dst.exists(manifest_name(cid.step, timeline=cid.timeline))
                if gone:
                    print(
                        f"{dst.url}: the damaged copy of {cid} is no longer committed; run "
                        "this again to copy it",
                        file=sys.stderr,
                    )
                raise
        else:
            n = copy(bar)
    except FileExistsError:
        print(f"skip {cid}: committed at {dst.url} meanwhile (by another copy)")
        return True
    finally:
        bar.close()
    dt = time.perf_counter() - t0
    rate = total / dt / 2**20 if dt > 0 else 0.0
    how = "as stored" if codec == "keep" else f"codec {codec}"
    verb = "replaced the damaged copy of" if found.state == "damaged" else "copied"
    print(
        f"{verb} {cid}: {src.url} -> {dst.url}, {fmt_bytes(total)} read, "
        f"{fmt_bytes(n)} stored ({how}) in {dt:.2f} s ({rate:.1f} MiB/s), committed"
    )
    return True


#: an object store's scheme -> the tier name a copy's manifest gets there (as the tiers' own)
_STORE_LABEL = {"s3": "s3", "gs": "gcs", "az": "azure"}


def _in_store(url: str) -> bool:
    return url.partition("://")[0] in _STORE_LABEL and "://" in url


def cmd_pull(args: argparse.Namespace) -> int:
    if not _in_store(args.src) or _in_store(args.dest):
        raise UsageError(
            "pull copies an object store's checkpoints (s3://, gs:// or az://bucket/prefix) "
            "into a local folder: tierckpt pull s3://bucket/prefix DIR (push for the reverse)"
            + ("; both locations given are local" if not _in_store(args.src) else "")
        )
    return _copy(args, args.src, args.dest)


def cmd_push(args: argparse.Namespace) -> int:
    if _in_store(args.src) or not _in_store(args.dest):
        raise UsageError(
            "push copies a local folder's checkpoints to an object store (s3://, gs:// or "
            "az://bucket/prefix): tierckpt push DIR s3://bucket/prefix (pull for the reverse)"
        )
    return _copy(args, args.src, args.dest)


def cmd_gc(args: argparse.Namespace) -> int:
    from tierckpt.offline import gc, id_text

    if args.dead_runs:
        return _gc_dead_runs(args)
    if args.keep_last is None:
        raise UsageError("gc needs --keep-last N (or --dead-runs for a node-RAM folder)")
    if args.keep_last < 1:
        raise UsageError("--keep-last must be at least 1 (the newest checkpoint is always kept)")
    with opened(args, args.url) as backend:
        plan = gc(
            backend,
            args.keep_last,
            dry_run=args.dry_run,
            abort_incomplete=args.abort_incomplete,
            force=args.force,
            read_whole=args.verify,
        )
    verb = "would delete" if args.dry_run else "deleted"
    bad = dict(plan.damaged)
    kept = [
        id_text(c)
        + (" (pinned)" if c in plan.kept_pinned else "")
        + (" (DAMAGED)" if c in bad else "")
        + (" (newer release)" if c in plan.newer else "")
        for c in plan.retained
    ]
    print(f"{backend.url}: keeping step(s) {', '.join(kept) or 'none'}")
    if plan.newer:
        print(
            f"kept {', '.join(map(id_text, plan.newer))}: written by a newer tierckpt (a "
            "manifest version this one does not read), whatever their age; upgrade to read them"
        )
    for cid, why in plan.damaged:
        print(f"DAMAGED {id_text(cid)}: {why}")
    if plan.kept_pinned:
        print(
            f"{len(plan.kept_pinned)} older than --keep-last {args.keep_last} kept because pinned "
            "(Checkpointer.unpin(step) lets gc remove them)"
        )
    print(
        f"{verb} {len(plan.expired)} expired checkpoint(s)"
        + (f": {', '.join(map(id_text, plan.expired))}" if plan.expired else "")
    )
    print(
        f"{verb} {len(plan.leftovers)} uncommitted leftover(s)"
        + (f": {', '.join(map(id_text, plan.leftovers))}" if plan.leftovers else "")
    )
    if plan.dead_saves:
        print(
            f"  of which {', '.join(map(id_text, plan.dead_saves))}: not older than the newest "
            "checkpoint, but only unfinished writes of a killed writer (no process holds "
            "their locks), which gc removes whatever their step"
        )
    if plan.dead_writes:
        ids = ", ".join(map(id_text, plan.dead_writes))
        print(
            f"{'would discard' if args.dry_run else 'discarded'} the unfinished writes of a "
            f"killed writer (no process holds their locks) in {ids}; what else is there stays"
        )
    if plan.kept_uncommitted and not args.abort_incomplete:
        print(
            f"kept {len(plan.kept_uncommitted)} uncommitted save(s) not older than the newest "
            f"checkpoint: {', '.join(_kept_save(c, plan) for c in plan.kept_uncommitted)}"
        )
    if args.abort_incomplete and args.url.startswith(("gs://", "az://")):
        print(
            "--abort-incomplete: no unfinished writes to abort on gs:// or az:// (a resumable "
            "upload or uncommitted blocks are not listed there): a lifecycle rule removes them "
            "(Azure drops uncommitted blocks after 7 days)"
        )
    elif args.abort_incomplete:
        ids = ", ".join(map(id_text, plan.kept_uncommitted))
        print(
            f"{'would abort' if args.dry_run else 'aborted'} every unfinished write (temporary "
            "files, open multipart uploads)" + (f", those of {ids} included" if ids else "")
        )
    if plan.refused:
        print(f"without --dry-run gc would refuse and delete nothing: {plan.refused}")
    if not plan.damaged:
        return 0
    how = "every chunk read: --verify" if args.verify else "sizes and indexes checked"
    older = ", ".join(map(id_text, plan.kept_for_damage))
    print(
        f"tierckpt gc: {len(plan.damaged)} damaged checkpoint(s) found ({how}): "
        f"{', '.join(id_text(c) for c, _ in plan.damaged)}. They were not counted toward "
        f"--keep-last {args.keep_last} and were not deleted"
        + (f"; older intact checkpoint(s) kept because of them: {older}" if older else "")
        + ". Deleting damage is yours to decide: `tierckpt verify URL --step N` says more; "
        'load(fallback="previous") loads the newest intact one. Exit status 1',
        file=sys.stderr,
    )
    return 1


def _kept_save(cid: CheckpointId, plan: GcPlan) -> str:
    """A save ``gc`` kept, with why (what gc saw of its unfinished writes before it ran)."""
    from tierckpt.offline import id_text
    from tierckpt.offline._unfinished import Unfinished

    writes = plan.unfinished.get(cid, Unfinished())
    if writes.live:
        why = "a save in progress: a live process holds its unfinished writes"
    elif writes.unknown:
        why = (
            "the store cannot tell whether the writer of its unfinished writes lives: once "
            "no job writes here, --abort-incomplete discards them"
        )
    elif writes.dead and not plan.retained:  # gc removes nothing before the first commit
        why = "a killed writer's unfinished writes: gc removes them once a checkpoint commits"
    else:
        why = (
            "shard files without a manifest: a save in progress, or a killed one's, which gc "
            "removes once a newer checkpoint commits"
        )
    return f"{id_text(cid)} ({why})"


def _gc_dead_runs(args: argparse.Namespace) -> int:
    """``gc --dead-runs PATH``: remove the node-RAM folders of runs whose writers are gone."""
    from tierckpt.noderam import clean_dead_runs

    dead = clean_dead_runs(args.url, stale_after_s=args.stale_after, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for d in dead:
        print(f"{verb} dead run {d.namespace!r} ({d.bytes} bytes): {d.why}")
    print(f"{args.url}: {verb} {len(dead)} dead run(s); live runs are never touched")
    return 0


def cmd_unlock(args: argparse.Namespace) -> int:
    from tierckpt.offline import unlock

    # refused (WriterConflict, exit 1) where this machine sees the holder run, unless --force
    with opened(args, args.url) as backend:
        removed = unlock(backend, args.rank, force=args.force)
    if not removed:
        which = f"rank {args.rank}'s " if args.rank is not None else ""
        print(f"{backend.url}: no {which}writer lease here")
        return 0
    for w in removed:
        print(f"removed the writer lease of rank {w.rank}: {w.describe()}")
        if w.presumed:
            print(
                "  that writer was presumed live only by its lease's age (no process or lock "
                "file on this machine to ask): if it still runs, it stops writing and deleting "
                "here at its next lease check, and its later saves to this tier fail"
            )
        elif w.record is None:
            print(
                "  it could not be read, so nobody could tell whether a writer holds it: if one "
                "does, it stops writing and deleting here at its next lease check"
            )
        elif w.alive:
            print(
                "  that writer was live (--force): it stops writing and deleting here at its "
                "next lease check, and its later saves to this tier fail"
            )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tierckpt.export import export_safetensors, shard_size_bytes
    from tierckpt.offline import resolve_id

    if args.format != "safetensors":  # pragma: no cover - argparse restricts choices
        raise UsageError(f"unsupported format {args.format!r}")
    try:
        max_shard_size = shard_size_bytes(args.max_shard_size)
    except ValueError as exc:
        raise UsageError(f"--max-shard-size: {exc}") from None
    with opened(args, args.url) as backend:
        cid = resolve_id(backend, args.step, args.timeline)
        step = cid.step
        results = export_safetensors(
            backend,
            step,
            args.out_dir,
            rank=args.rank,
            single_file=args.single_file,
            source=args.url,
            timeline=cid.timeline,
            max_shard_size=max_shard_size,
        )
    for res in results:
        print(f"exported step {step} rank {res.rank}: {res.tensors} tensors")
        for f in res.files:
            print(f"  {f}")
        if res.skipped:
            print(f"  skipped (dtype not supported by safetensors): {', '.join(res.skipped)}")
    return 0
