"""The commands that read what is stored: ``ls``, ``inspect``, ``verify``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from tierckpt.cli._common import (
    fmt_bytes,
    fmt_time,
    opened,
    progress_bar,
    table,
)
from tierckpt.errors import CorruptChunk, TierCkptError
from tierckpt.redact import redact

log = logging.getLogger("tierckpt")


def _lease_doc(info: Any) -> dict[str, Any]:
    rec = info.record
    doc: dict[str, Any] = {
        "rank": info.rank,
        "alive": info.alive,
        "presumed": info.presumed,
        "why": info.why,
    }
    if rec is not None:
        doc.update(
            owner=rec.owner,
            host=rec.host,
            pid=rec.pid,
            started=rec.started,
            renewed=rec.renewed,
            ttl=rec.ttl,
        )
    return doc


def _status(c: Any, newest: Any, pinned: set[Any], damaged: dict[Any, str]) -> str:
    """``DAMAGED`` (``--check`` found it so), ``newest`` (what a load returns) or
    ``abandoned`` (an older timeline's), and ``pinned`` (retention keeps it until unpinned);
    or empty."""
    words = [
        "DAMAGED" if c.id in damaged else "",
        "newest" if c.id == newest else "abandoned" if c.abandoned else "",
    ]
    return ", ".join(w for w in [*words, "pinned" if c.id in pinned else ""] if w)


def _near_hint(args: argparse.Namespace, backend: Any) -> str:
    """The tier folder or prefix meant, where ``ls`` found no checkpoint at ``args.url``."""
    from tierckpt.cli._hints import tier_folders_near, tier_prefixes_near

    url = args.url
    if "://" not in url or url.startswith("file://"):
        return tier_folders_near(url)
    parts = urlsplit(url)
    try:
        with opened(args, f"{parts.scheme}://{parts.netloc}") as root:
            return tier_prefixes_near(backend, root)
    except Exception as exc:  # e.g. no right to list above the prefix: ls lists what it can
        log.debug("ls: no hint for %s: %s", redact(url), exc)
        return ""


def cmd_ls(args: argparse.Namespace) -> int:
    from tierckpt.cli._hints import stored_codecs
    from tierckpt.offline import id_text, leases, list_checkpoints, uncommitted_ids
    from tierckpt.offline._gc import quick_check
    from tierckpt.offline._listing import foreign_note
    from tierckpt.retention import pinned_ids

    with opened(args, args.url) as backend:
        listed = list_checkpoints(backend)
        pending = uncommitted_ids(backend)
        writers = leases(backend)
        pinned = set(pinned_ids(backend))
        # what the chunks are stored with (the manifest names the tier's setting, e.g. auto)
        codecs = {
            c.id: stored_codecs(backend, c.manifest) for c in listed if c.manifest is not None
        }
        # nothing here: a prefix or folder a level off is the usual reason (inside a tier,
        # whose data then lists as uncommitted saves, or above tiers)
        hint = _near_hint(args, backend) if not listed and not args.json else ""
        foreign = foreign_note(backend) if not listed and not args.json else ""
        # --check: each shard file there, at its size, with its footer and index (as gc checks)
        damaged = {
            c.id: why
            for c in (listed if args.check else [])
            if c.manifest is not None and (why := quick_check(backend, c.id))
        }
    newest = listed[-1].id if listed else None
    if args.json:
        doc = [
            {
                "step": c.step,
                "timeline": c.timeline,
                "abandoned": c.abandoned,
                "pinned": c.id in pinned,
                "error": c.error,
            }
            if c.manifest is None
            else {
                "step": c.step,
                "timeline": c.timeline,
                "abandoned": c.abandoned,
                "pinned": c.id in pinned,
                **({"damaged": damaged.get(c.id)} if args.check else {}),
                "created": c.manifest.created,
                "tier": c.manifest.tier,
                "world_size": c.manifest.world_size,
                "raw_bytes": c.manifest.raw_bytes,
                "stored_bytes": c.manifest.stored_bytes,
                "codecs": codecs[c.id],
                "file_count": len(c.manifest.shards),
                "file_bytes": sum(s.size for s in c.manifest.shards),
                # file_bytes under the name it always had: scripts read it as bytes
                "files": sum(s.size for s in c.manifest.shards),
            }
            for c in listed
        ]
        json.dump(
            {
                "url": backend.url,
                "checkpoints": doc,
                "uncommitted": sorted({c.step for c in pending}),
                "uncommitted_checkpoints": [
                    {"step": c.step, "timeline": c.timeline} for c in pending
                ],
                "leases": [_lease_doc(w) for w in writers],
            },
            sys.stdout,
            indent=1,
        )
        sys.stdout.write("\n")
        return _unreadable(listed, damaged)
    if not listed:
        print(f"{backend.url}: no committed checkpoint{foreign}")
        if hint:
            print(hint)
    else:
        rows = []
        for c in listed:
            m = c.manifest
            if m is None:
                what = "newer release" if c.newer else "unreadable"  # why: on stderr
                rows.append(
                    [
                        c.step,
                        what,
                        "",
                        "",
                        "",
                        "",
                        "",
                        "",
                        c.timeline,
                        _status(c, newest, pinned, damaged),
                    ]
                )
                continue
            ratio = m.raw_bytes / m.stored_bytes if m.stored_bytes else 1.0
            rows.append(
                [
                    m.step,
                    fmt_time(m.created),
                    fmt_bytes(m.raw_bytes),
                    fmt_bytes(m.stored_bytes),
                    f"{ratio:.2f}x",
                    m.world_size,
                    m.tier or "?",
                    ",".join(codecs[c.id]) or "?",
                    c.timeline,
                    _status(c, newest, pinned, damaged),
                ]
            )
        table(
            rows,
            [
                "STEP",
                "CREATED",
                "RAW",
                "STORED",
                "RATIO",
                "RANKS",
                "TIER",
                "CODECS",
                "TIMELINE",
                "STATUS",
            ],
            sys.stdout,
            right=(0, 2, 3, 4, 5, 8),
        )
        if any(c.abandoned for c in listed):
            print(
                "abandoned: checkpoints of an older timeline (the run went back to an older "
                "step and went on from there); retention removes them first, as older"
            )
        if any(c.id in pinned for c in listed):
            print("pinned: retention and tierckpt gc keep it until Checkpointer.unpin()")
    if pending:
        print(
            f"uncommitted (in progress, or leftovers of killed saves): "
            f"{', '.join(map(id_text, pending))}"
        )
    for w in writers:
        print(f"writer lease of rank {w.rank}: {w.describe()}")
    return _unreadable(listed, damaged)


def _unreadable(listed: Sequence[Any], damaged: dict[Any, str]) -> int:
    """Exit status of ``ls``: 1, with the reasons on stderr, when a manifest is unreadable or
    ``--check`` found a checkpoint damaged."""
    from tierckpt.offline import id_text

    bad = [c for c in listed if c.manifest is None]
    for c in bad:
        what = "written by a newer tierckpt" if c.newer else "unreadable"
        print(f"tierckpt ls: step {c.step} is {what}: {c.error}", file=sys.stderr)
    for cid, why in damaged.items():
        print(f"tierckpt ls: step {id_text(cid)} is DAMAGED: {why}", file=sys.stderr)
    if damaged:
        print(
            "tierckpt ls: load() raises CorruptCheckpoint for a damaged newest checkpoint; "
            'load(fallback="previous") loads the newest intact one; `tierckpt verify URL '
            "--step N` says more",
            file=sys.stderr,
        )
    return 1 if bad or damaged else 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from tierckpt.format import step_prefix
    from tierckpt.layout import describe as describe_layout
    from tierckpt.offline import inspect_checkpoint

    with opened(args, args.url) as backend:
        ins = inspect_checkpoint(backend, args.step, by=args.by, timeline=args.timeline)
    m = ins.manifest
    layout = describe_layout([s.file for s in m.shards], step_prefix(m.step, timeline=m.timeline))
    if args.json:
        json.dump(
            {
                "step": m.step,
                "timeline": m.timeline,
                "world_size": m.world_size,
                "tier": m.tier,
                "format": layout,
                "created": m.created,
                "raw_bytes": m.raw_bytes,
                "stored_bytes": m.stored_bytes,
                "codecs": ins.codecs,
                "metadata": m.metadata or {},
                "groups": [
                    {
                        "name": g.name,
                        "tensors": g.tensors,
                        "raw_bytes": g.raw_bytes,
                        "stored_bytes": round(g.stored_bytes),
                        "ratio": g.ratio,
                        "codecs": sorted(g.codecs),
                    }
                    for g in ins.groups
                ],
                "tensors": [
                    {
                        "rank": t.rank,
                        "name": t.path,
                        "dtype": t.dtype,
                        "shape": list(t.shape),
                        "bytes": t.nbytes,
                    }
                    for t in ins.tensors
                ],
            },
            sys.stdout,
            indent=1,
        )
        sys.stdout.write("\n")
        return 0
    ratio = m.raw_bytes / m.stored_bytes if m.stored_bytes else 1.0
    print(f"{m.id} at {backend.url} ({layout})")
    print(
        f"  created {fmt_time(m.created)} by tierckpt {m.library_version or '?'}, "
        f"{m.world_size} rank(s), tier {m.tier or '?'}"
    )
    print(
        f"  {len(ins.tensors)} tensors in {ins.chunks} chunks; raw {fmt_bytes(m.raw_bytes)}, "
        f"stored {fmt_bytes(m.stored_bytes)} ({ratio:.2f}x); codecs {', '.join(ins.codecs)}"
    )
    if m.metadata:
        print(f"  metadata {json.dumps(m.metadata)[:200]}")
    print()
    table(
        [
            [
                g.name,
                g.tensors,
                fmt_bytes(g.raw_bytes),
                fmt_bytes(g.stored_bytes),
                f"{g.ratio:.2f}x",
                ",".join(sorted(g.codecs)),
            ]
            for g in ins.groups
        ],
        ["GROUP" if args.by == "key" else "DTYPE", "TENSORS", "RAW", "STORED", "RATIO", "CODECS"],
        sys.stdout,
        right=(1, 2, 3, 4),
    )
    if len(ins.groups) > 1:
        print(
            "  (stored bytes are known per chunk: a chunk that holds several groups is split "
            "among them by raw bytes)"
        )
    print()
    shown = ins.tensors if args.limit == 0 else ins.tensors[: args.limit]
    multi = m.world_size > 1
    table(
        [
            ([t.rank] if multi else [])
            + [t.path, t.dtype, "x".join(map(str, t.shape)) or "()", fmt_bytes(t.nbytes)]
            for t in shown
        ],
        (["RANK"] if multi else []) + ["TENSOR", "DTYPE", "SHAPE", "BYTES"],
        sys.stdout,
        right=(4,) if multi else (3,),
    )
    if len(shown) < len(ins.tensors):
        print(f"... {len(ins.tensors) - len(shown)} more (--limit 0 shows all)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from tierckpt.catalog import committed_ids
    from tierckpt.offline import checkpoint_bytes, resolve_id, verify_checkpoint
    from tierckpt.offline._listing import foreign_note

    with opened(args, args.url) as backend:
        if args.latest or args.step is not None:
            ids = [resolve_id(backend, args.step, args.timeline)]
        else:
            ids = [
                c
                for c in committed_ids(backend)
                if args.timeline is None or c.timeline == args.timeline
            ]
        if not ids:
            print(
                f"{backend.url}: no committed checkpoint to verify{foreign_note(backend)}",
                file=sys.stderr,
            )
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
                    print(
                        f"  file: {backend.url}/{exc.file}\n  chunk: {exc.chunk}", file=sys.stderr
                    )
                return 1
            except TierCkptError as exc:
                bar.close()
                print(f"FAILED {cid}: {redact(str(exc))}", file=sys.stderr)
                return 1
            bar.close()
            dt = time.perf_counter() - t0
            node = (
                f" (a node-local copy: the files of rank(s) {list(rep.node_ranks)} are here, "
                "the other ranks' on their nodes)"
                if rep.node_ranks
                else ""
            )
            print(
                f"ok  {cid}: {rep.shards} shard(s), {rep.chunks} chunks, "
                f"{fmt_bytes(rep.stored_bytes)} stored -> {fmt_bytes(rep.raw_bytes)} raw, "
                f"checksums and decoding ok ({dt:.2f} s){node}"
            )
    return 0
