"""The demo's tables: time blocked per checkpoint, bytes per tier, where each restore read."""

from __future__ import annotations

import statistics

from tierckpt.demo._child import ChildRun


# -- reporting ------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def _first_mismatch(
    got: dict[int, float], want: dict[int, float], steps: range
) -> tuple[int, float | None, float | None] | None:
    for s in steps:
        a, b = got.get(s), want.get(s)
        if a is None or b is None or a.hex() != b.hex():
            return s, a, b
    return None


def _table(rows: list[list[str]], header: list[str]) -> str:
    cells = [header, *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r)
        ).rstrip()
        for r in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join("  " + ln for ln in lines)


def report(
    ref: ChildRun, node1: ChildRun, restart: ChildRun, node2: ChildRun, state_bytes: int
) -> str:
    out = []
    tiered = (node1, restart, node2)
    blocked = [b for run in tiered for b in run.blocked.values()]
    saves = [e["seconds"] for e in ref.torch_saves]
    fsyncs = [e["fsync_seconds"] for e in ref.torch_saves]
    out.append(
        f"Checkpoint of {_mib(state_bytes)} (model + AdamW state + RNG), "
        "blocking time per checkpoint (lower is better):"
    )
    both = [a + b for a, b in zip(saves, fsyncs, strict=True)]
    rows = [
        [label, _ms(statistics.mean(v)), _ms(statistics.median(v)), _ms(max(v)), str(len(v))]
        for label, v in (
            ("tierckpt save() + wait before optimizer step", blocked),
            ("torch.save (blocking)", saves),
            ("torch.save + fsync (durable on disk)", both),
        )
        if v
    ]
    out.append(_table(rows, ["", "mean", "median", "max", "checkpoints"]))
    if blocked and saves:
        speedup = statistics.median(saves) / max(statistics.median(blocked), 1e-9)
        out.append(
            f"  -> median wait per checkpoint {speedup:.1f}x shorter than torch.save's, and "
            "tierckpt's copy also lands on local disk and in S3 in the background"
        )
    out.append("")
    out.append("Bytes written per tier (node 1, restarted node 1, node 2):")
    rows = []
    commits = [c for run in tiered for c in run.commits]
    for tier in ("noderam", "memory", "local", "s3"):
        cs = [c for c in commits if c["tier"] == tier]
        if not cs:
            continue
        raw = sum(c["raw"] for c in cs)
        stored = sum(c["stored"] for c in cs)
        codecs = ",".join(sorted({k for c in cs for k in c["codec"].split(",")}))
        rows.append(
            [
                tier,
                str(len(cs)),
                _mib(raw),
                _mib(stored),
                f"{raw / stored:.2f}x",
                codecs,
                _ms(statistics.mean(c["seconds"] for c in cs)),
            ]
        )
    out.append(
        _table(rows, ["tier", "commits", "raw", "written", "ratio", "codec", "save->commit"])
    )
    rows = []
    for failure, run in (
        ("process crash (node 1 restarted)", restart),
        ("node lost (node 2, empty RAM, disk)", node2),
    ):
        r = run.restored
        if r is None:
            continue
        read = {k: int(v) for k, v in r.get("read", {}).items()}
        rows.append(
            [
                failure,
                _source(read),
                str(r["step"]),
                *(_mib(read[t]) if read.get(t) else "0" for t in ("noderam", "local", "s3")),
                _ms(r["seconds"]),
            ]
        )
    if rows:
        out.append("")
        out.append("Restore after each failure (bytes read from each tier, counted):")
        out.append(_table(rows, ["failure", "from", "step", "node RAM", "local", "S3", "restore"]))
    if node2.restored:
        r = node2.restored
        out.append(
            f"  -> node 2 restored from S3: step {r['step']}, {_mib(state_bytes)} read, "
            f"verified and decoded in {_ms(r['seconds'])} (node 1's RAM and disks are gone: "
            "only S3 had it)"
        )
    return "\n".join(out)


#: how the restore table names a tier
_TIER_LABEL = {"noderam": "node RAM", "memory": "process RAM", "local": "local disk", "s3": "S3"}


def _source(read: dict[str, int]) -> str:
    """The tier a restore read its data from: the one that read the most bytes."""
    if not read or max(read.values()) == 0:
        return "?"
    tier = max(read, key=lambda t: read[t])
    return _TIER_LABEL.get(tier, tier)
