"""Draw the figures of docs/concepts.md: ``python docs/make_figures.py`` (needs matplotlib).

Writes ``docs/img/concepts-timeline.png`` (a blocking ``torch.save`` against lazy capture and
streaming through tiers) and ``docs/img/concepts-tiers.png`` (what each tier holds, when it
commits, what it survives). The numbers are illustrative, not measurements.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "img")

FWD = "#7aa6d6"
OPT = "#2f5d8c"
SAVE = "#d9534f"
CAPTURE = "#f0ad4e"
TIER = {"RAM": "#9bc995", "local NVMe": "#5aa469", "S3": "#2e7d32"}


def _bar(ax: plt.Axes, y: float, x0: float, x1: float, color: str, label: str = "",
         h: float = 0.6, text_color: str = "white") -> None:
    ax.barh(y, x1 - x0, left=x0, height=h, color=color, edgecolor="white", linewidth=1)
    if label:
        ax.text((x0 + x1) / 2, y, label, ha="center", va="center", fontsize=8,
                color=text_color)


def _iterations(ax: plt.Axes, y: float, start: float, n: int, fb: float, opt: float,
                stall_after: int | None = None, stall: float = 0.0,
                stall_label: str = "") -> list[float]:
    """Draw ``n`` iterations (forward/backward then optimizer step); returns step end times."""
    t = start
    ends = []
    for i in range(n):
        _bar(ax, y, t, t + fb, FWD, "fwd + bwd")
        t += fb
        _bar(ax, y, t, t + opt, OPT, "opt")
        t += opt
        ends.append(t)
        if stall_after is not None and i == stall_after:
            _bar(ax, y, t, t + stall, SAVE, stall_label)
            t += stall
    return ends


def timeline() -> str:
    fb, opt = 3.0, 0.6
    fig, ax = plt.subplots(figsize=(11, 4.4), dpi=150)

    # classic: a blocking torch.save after iteration 1
    _iterations(ax, 5, 0, 4, fb, opt, stall_after=0, stall=4.2,
                stall_label="torch.save: training blocked")
    # tierckpt: save() right after iteration 1's optimizer step
    ends = _iterations(ax, 3.6, 0, 5, fb, opt)
    t_save = ends[0]
    ax.annotate("save(state, step) returns at once", xy=(t_save, 3.92),
                xytext=(t_save + 0.3, 4.32), fontsize=8, ha="left", va="center",
                arrowprops={"arrowstyle": "->", "lw": 0.8})
    # capture runs beside the next forward/backward, finishes before the next optimizer step
    cap_end = t_save + fb * 0.7
    _bar(ax, 2.7, t_save, cap_end, CAPTURE, "copy to host arena", h=0.5, text_color="black")
    ax.add_patch(FancyArrowPatch((cap_end, 2.95), (ends[1] - opt, 3.3), arrowstyle="->",
                                 mutation_scale=8, lw=0.8, color="gray"))
    ax.text(ends[1] - opt + 0.1, 3.05, "optimizer step waits only\nif capture is unfinished",
            fontsize=7, color="gray", va="center")
    # chunks stream through the tiers as soon as they land, each tier commits on its own
    lanes = [("RAM", 1.9, 0.25, 1.8, "copy"), ("local NVMe", 1.2, 0.45, 2.8, "pwrite + fsync"),
             ("S3", 0.5, 0.8, 7.0, "compress -> multipart upload")]
    for name, y, lag, dur, what in lanes:
        x0 = t_save + lag
        _bar(ax, y, x0, x0 + dur, TIER[name], what, h=0.5)
        ax.plot([x0 + dur], [y], marker="D", color="black", markersize=6)
        ax.text(x0 + dur + 0.15, y, "manifest = commit", fontsize=7, va="center")

    ax.set_yticks([5, 3.6, 2.7, 1.9, 1.2, 0.5])
    ax.set_yticklabels(["torch.save", "tierckpt: training", "capture (D2H)", "tier: RAM",
                        "tier: local", "tier: S3"], fontsize=8)
    ax.set_xlabel("time (illustrative)")
    ax.set_xlim(-0.2, 20.5)
    ax.set_ylim(0, 5.6)
    ax.set_xticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title("Lazy capture: the copy overlaps the next forward/backward pass; "
                 "flushing overlaps everything", fontsize=10)
    fig.tight_layout()
    path = os.path.join(OUT, "concepts-timeline.png")
    fig.savefig(path)
    plt.close(fig)
    return path


def tiers() -> str:
    fig, ax = plt.subplots(figsize=(11, 3.2), dpi=150)
    ax.axis("off")
    boxes = [
        ("host arena", "#f0ad4e", "bounded, reused\nnot a tier: a staging buffer"),
        ("RAM tier", TIER["RAM"], "commit: manifest in RAM\nsurvives: nothing beyond\n"
         "this process"),
        ("local NVMe tier", TIER["local NVMe"], "commit: fsync, rename,\nfsync dir, "
         "manifest last\nsurvives: crash, reboot"),
        ("S3 tier", TIER["S3"], "commit: upload complete,\nthen manifest, create-only\n"
         "survives: loss of the node"),
    ]
    w, gap = 0.215, 0.04
    for i, (title, color, body) in enumerate(boxes):
        x = 0.02 + i * (w + gap)
        ax.add_patch(plt.Rectangle((x, 0.35), w, 0.45, color=color, transform=ax.transAxes))
        ax.text(x + w / 2, 0.72, title, ha="center", va="center", fontsize=10, weight="bold",
                color="black" if i == 0 else "white", transform=ax.transAxes)
        ax.text(x + w / 2, 0.52, body, ha="center", va="center", fontsize=7,
                color="black" if i == 0 else "white", transform=ax.transAxes)
        if i:
            ax.annotate("", xy=(x, 0.575), xytext=(x - gap, 0.575), xycoords="axes fraction",
                        arrowprops={"arrowstyle": "->", "lw": 1.2})
    ax.text(0.5, 0.15, "every chunk: encode (codec per tier) -> checksum -> each tier in order;  "
            "load(): newest committed step, fastest tier first, fall back on a bad chunk",
            ha="center", fontsize=8, transform=ax.transAxes)
    ax.text(0.5, 0.93, "Tiers, fastest first: each commits on its own, a checkpoint exists on a "
            "tier iff its manifest does", ha="center", fontsize=10, transform=ax.transAxes)
    path = os.path.join(OUT, "concepts-tiers.png")
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    for path in (timeline(), tiers()):
        print(f"wrote {os.path.relpath(path, os.path.dirname(HERE))}")


if __name__ == "__main__":
    main()
