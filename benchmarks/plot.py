"""PNG plots of a save benchmark JSON (``tierckpt bench --json``).

    .venv/bin/python benchmarks/plot.py bench_save.json --out docs/img

Writes ``save_blocked.png`` (time training is blocked per checkpoint, immediate and lazy),
``save_committed.png`` (time until durable on disk, against raw write + fsync),
``save_memory.png`` (peak extra host memory against state and arena size) and
``train_iter.png`` (training iteration time relative to no checkpointing). Given the JSON of
``benchmarks/bench_restore.py`` it writes ``restore.png`` (restore time of every contender,
local and object store, against each group's baseline).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes

MiB = 1 << 20
GiB = 1 << 30
TIERCKPT_COLOR = "#d62728"
PEER_COLOR = "#7f7f7f"


def _ok(contenders: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in contenders.items() if "error" not in v}


_BREAKS = (
    ("dcp.async_save + reused DefaultStager", "dcp.async_save\n+ DefaultStager"),
    (" (defaults)", "\n(defaults)"),
    ("torch-checkpointing", "torch-\ncheckpointing"),
    ("tierckpt (", "tierckpt\n("),
    (" + fsync", "\n+ fsync"),
)


def _short(label: str) -> str:
    for a, b in _BREAKS:
        label = label.replace(a, b)
    return label


def _title(result: dict[str, Any], what: str) -> str:
    m = result["meta"]["machine"]
    ram = m["ram_bytes"] / GiB
    date = result["meta"]["date"][:10]
    return f"{what}\n{m['cpus']} CPUs, {ram:.0f} GiB RAM, {m['gpu'] or 'no GPU'}; {date}"


def _bars(
    ax: Axes, names: list[str], series: list[tuple[str, list[float], str]], ylabel: str, log: bool
) -> None:
    n = len(series)
    width = 0.8 / n
    for i, (label, values, hatch) in enumerate(series):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(names))]
        bars = ax.bar(
            xs,
            values,
            width,
            label=label,
            color=_colors(names),
            hatch=hatch,
            edgecolor="black",
            linewidth=0.5,
        )
        for b, v in zip(bars, values, strict=True):
            txt = f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.1f} s"
            ax.annotate(
                txt,
                (b.get_x() + b.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=6,
                rotation=90,
                xytext=(0, 2),
                textcoords="offset points",
            )
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)


def _colors(names: list[str]) -> list[str]:
    return [TIERCKPT_COLOR if n.startswith("tierckpt") else PEER_COLOR for n in names]


def _save(fig: Any, out: Path, filename: str) -> Path:
    fig.tight_layout()
    path = out / filename
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_size(
    result: dict[str, Any],
    out: Path,
    filename: str,
    what: str,
    draw: Callable[[Axes, dict[str, Any], list[str]], str],
    height: float = 4.5,
) -> Path | None:
    """One panel per state size, contenders on the x axis; ``draw`` fills a panel and
    returns its title."""
    sizes = [e for e in result["sizes"] if _ok(e["contenders"])]
    if not sizes:
        return None
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), height), squeeze=False)
    for ax, e in zip(axes[0], sizes, strict=True):
        cs = _ok(e["contenders"])
        names = list(cs)
        title = draw(ax, cs, names)
        ax.set_xticks(
            range(len(names)),
            [_short(cs[n]["label"]) for n in names],
            fontsize=7,
            rotation=30,
            ha="right",
        )
        ax.set_title(f"{e['gib']:g} GiB state{title}")
    fig.suptitle(_title(result, what), fontsize=9)
    return _save(fig, out, filename)


def plot_blocked(result: dict[str, Any], out: Path) -> Path | None:
    compute = result["meta"]["config"]["compute_s"]

    def draw(ax: Axes, cs: dict[str, Any], names: list[str]) -> str:
        _bars(
            ax,
            names,
            [
                (
                    "immediate: wait for staging at once",
                    [cs[n]["median"]["staged_s"] for n in names],
                    "",
                ),
                (
                    f"lazy: wait after {compute:g} s of compute",
                    [max(cs[n]["median"]["lazy_blocked_s"], 1e-4) for n in names],
                    "//",
                ),
            ],
            "training blocked per checkpoint (s, log)",
            log=True,
        )
        return f" ({cs[names[0]]['state']['tensors']:,} tensors)"

    what = "Time training is blocked per checkpoint (median, lower is better)"
    return _per_size(result, out, "save_blocked.png", what, draw, height=4.8)


def plot_committed(result: dict[str, Any], out: Path) -> Path | None:
    def draw(ax: Axes, cs: dict[str, Any], names: list[str]) -> str:
        committed = [cs[n]["median"]["committed_s"] for n in names]
        _bars(
            ax,
            names,
            [("committed (durable) on local disk", committed, "")],
            "seconds from the save call",
            log=False,
        )
        raws = [v["raw_write"]["median"]["total_s"] for v in cs.values() if v.get("raw_write")]
        if raws and raws[0]:
            ax.axhline(raws[0], color="black", linestyle="--", linewidth=1)
            ax.annotate(
                f"raw write + fsync {raws[0]:.2f} s",
                (-0.45, raws[0]),
                ha="left",
                va="bottom",
                fontsize=7,
            )
        return ""

    what = "Time until the checkpoint is durable on the local disk (median)"
    return _per_size(result, out, "save_committed.png", what, draw)


def plot_memory(result: dict[str, Any], out: Path) -> Path | None:
    def draw(ax: Axes, cs: dict[str, Any], names: list[str]) -> str:
        values = [cs[n]["peak_extra_bytes"] / MiB for n in names]
        bars = ax.bar(
            range(len(names)), values, color=_colors(names), edgecolor="black", linewidth=0.5
        )
        for b, v in zip(bars, values, strict=True):
            ax.annotate(
                f"{v:,.0f}",
                (b.get_x() + b.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=7,
            )
        state = cs[names[0]]["state"]["nbytes"] / MiB
        ax.axhline(state, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"state {state:,.0f} MiB", (-0.4, state), va="bottom", fontsize=7)
        arena = (cs.get("tierckpt_256m") or {}).get("arena_bytes")
        if arena:
            ax.axhline(arena / MiB, color=TIERCKPT_COLOR, linestyle=":", linewidth=1)
            ax.annotate(
                f"arena {arena / MiB:,.0f} MiB",
                (-0.4, arena / MiB),
                va="top",
                fontsize=7,
                color=TIERCKPT_COLOR,
            )
        ax.set_ylabel("peak extra host memory (MiB)")
        return ""

    what = "Peak extra host memory while saving (process tree)"
    return _per_size(result, out, "save_memory.png", what, draw)


def plot_train(result: dict[str, Any], out: Path) -> Path | None:
    tr = result.get("train") or {}
    vs = _ok(tr.get("variants") or {})
    if "none" not in vs:
        return None
    base = vs["none"]["mean_iter_s"]
    names = list(vs)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    values = [vs[n]["mean_iter_s"] / base for n in names]
    bars = ax.bar(range(len(names)), values, color=_colors(names), edgecolor="black", linewidth=0.5)
    for b, n in zip(bars, names, strict=True):
        rounds = vs[n].get("round_mean_iter_s") or []
        none_rounds = vs["none"].get("round_mean_iter_s") or []
        pts = [a / c for a, c in zip(rounds, none_rounds, strict=False)]
        ax.scatter([b.get_x() + b.get_width() / 2] * len(pts), pts, color="black", s=6, zorder=3)
    ax.axhline(1.10, color="black", linestyle="--", linewidth=1)
    ax.annotate("target 1.10x", (-0.45, 1.10), ha="left", va="bottom", fontsize=7)
    ax.set_xticks(
        range(len(names)),
        [
            f"{_short(vs[n]['label'])}\n{v:.2f}x, {vs[n]['mean_iter_s'] * 1e3:.0f} ms"
            for n, v in zip(names, values, strict=True)
        ],
        fontsize=7,
        rotation=30,
        ha="right",
    )
    ax.set_ylabel("mean iteration time / no checkpointing")
    ax.set_title(
        _title(
            result,
            f"Training loop, checkpoint every {tr['every']} steps; bars: mean iteration time, "
            "dots: each round",
        ),
        fontsize=9,
    )
    return _save(fig, out, "train_iter.png")


def plot_restore(result: dict[str, Any], out: Path) -> Path:
    """Restore seconds per contender (bench_restore.py's JSON), one panel per source."""
    cs = result["contenders"]
    groups = (
        (
            "local folder",
            "disk-read",
            [n for n in cs if n in ("disk-read", "dcp-fs") or n == "tierckpt-local"],
        ),
        (
            "SeaweedFS on 127.0.0.1 (volumes on disk)",
            "obstore-get",
            [n for n in cs if n not in ("disk-read", "dcp-fs", "tierckpt-local")],
        ),
    )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 3]})
    for ax, (what, base, names) in zip(axes, groups, strict=True):
        names = sorted(names, key=lambda n: cs[n]["median_s"])
        secs = [cs[n]["median_s"] for n in names]
        bars = ax.bar(
            range(len(names)), secs, color=_colors(names), edgecolor="black", linewidth=0.5
        )
        ref = cs.get(base, {}).get("median_s")
        for b, v in zip(bars, secs, strict=True):
            label = f"{v:.2f} s" + (f"\n{ref / v:.2f}x" if ref else "")
            ax.annotate(
                label,
                (b.get_x() + b.get_width() / 2, v),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(
            [n.replace("tierckpt-", "tierckpt\n") for n in names],
            fontsize=7,
            rotation=30,
            ha="right",
        )
        ax.set_title(f"{what}\n(ratio: {base}'s time / this time)", fontsize=9)
        ax.set_ylabel("seconds (median)")
        if secs:
            ax.set_ylim(0, max(secs) * 1.25)
    gib = result["state_bytes"] / GiB
    fig.suptitle(
        f"Restore of {gib:.2f} GiB ({result['tensors']} tensors), median of {result['runs']}, "
        f"{result['date']}, load average {result.get('loadavg', [0])[0]:.1f}\n"
        f"{result['machine']}",
        fontsize=9,
    )
    return _save(fig, out, "restore.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("json", help="the JSON written by tierckpt bench --json")
    p.add_argument("--out", default="docs/img", help="folder for the PNG files")
    p.add_argument("--prefix", default="", help="prefix of the file names")
    a = p.parse_args(argv)
    with open(a.json) as f:
        result = json.load(f)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if "contenders" in result and "state_bytes" in result:  # bench_restore.py's JSON
        print(f"wrote {plot_restore(result, out)}")
        return 0
    for fn in (plot_blocked, plot_committed, plot_memory, plot_train):
        path = fn(result, out)
        if path is not None:
            if a.prefix:
                path = path.rename(path.with_name(a.prefix + path.name))
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
