"""The project's own goals for the save benchmark, judged on a finished run.

The installed ``tierckpt bench`` measures and reports; whether the numbers meet *this
project's* targets (blocked time per GiB, capture speed, committed vs a raw write, bounded
memory, training overhead) is the repository's business, so the goals live here.
``benchmarks/bench_save.py`` (and ``make bench``) passes :func:`evaluate_targets` to the
runner; its verdicts are printed as the "Targets" table and stored under ``"targets"`` in
the JSON.
"""

from __future__ import annotations

from typing import Any

from tierckpt.bench.config import STAGING_PEERS, GiB, MiB
from tierckpt.bench.report import lookup


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The project's targets, each with the measured value and whether it was met."""
    out: list[dict[str, Any]] = []

    def add(
        name: str, value: float | None, limit: float | None, met: bool | None, detail: str
    ) -> None:
        out.append({"target": name, "value": value, "limit": limit, "met": met, "detail": detail})

    for e in result["sizes"]:
        gib = e["gib"]
        cs = {k: v for k, v in e["contenders"].items() if "error" not in v}
        for tk in ("tierckpt_256m", "tierckpt_default"):
            t = cs.get(tk)
            if t is None:
                continue
            m = t["median"]
            gib_real = t["state"]["nbytes"] / GiB
            lazy_per_gib = m["lazy_blocked_s"] / gib_real
            add(
                f"{gib:g} GiB {tk}: lazy blocked <= 10 ms/GiB",
                lazy_per_gib * 1e3,
                10.0,
                lazy_per_gib <= 0.010,
                f"{m['lazy_blocked_s'] * 1e3:.1f} ms for {gib_real:.2f} GiB (medians: save() "
                f"{m.get('lazy_returns_s', 0) * 1e3:.1f} ms, wait "
                f"{m.get('lazy_wait_s', 0) * 1e3:.1f} ms)",
            )
            cap_per_gib = m["staged_s"] / gib_real
            add(
                f"{gib:g} GiB {tk}: immediate capture <= 0.1 s/GiB",
                cap_per_gib,
                0.1,
                cap_per_gib <= 0.1,
                f"{m['staged_s']:.3f} s for {gib_real:.2f} GiB",
            )
            peers = {b: v["median"]["staged_s"] for b, v in cs.items() if b in STAGING_PEERS}
            if peers:
                fastest = min(peers, key=lambda b: peers[b])
                add(
                    f"{gib:g} GiB {tk}: immediate capture faster than every peer's staging",
                    m["staged_s"],
                    peers[fastest],
                    m["staged_s"] < peers[fastest],
                    f"tierckpt {m['staged_s']:.3f} s vs fastest peer {fastest} "
                    f"{peers[fastest]:.3f} s",
                )
            ratio = m.get("committed_over_raw")
            if ratio is not None:
                add(
                    f"{gib:g} GiB {tk}: committed <= 1.15x raw write+fsync",
                    ratio,
                    1.15,
                    ratio <= 1.15,
                    f"committed {m['committed_s']:.2f} s vs raw {m['raw_total_s']:.2f} s "
                    "(median of per-run ratios)",
                )
            arena = t.get("arena_bytes") or t.get("host_buffer_bytes")
            extra = t["peak_extra_bytes"]
            if arena:
                add(
                    f"{gib:g} GiB {tk}: extra host memory bounded by the arena",
                    extra / MiB,
                    arena / MiB,
                    extra <= arena * 1.10 + 64 * MiB,
                    f"peak extra {extra / MiB:.0f} MiB, arena {arena / MiB:.0f} MiB, "
                    f"state {t['state']['nbytes'] / MiB:.0f} MiB",
                )
    tr = result.get("train") or {}
    ratio = lookup(tr, "summary", "mean_iter_over_none", "tierckpt")
    if ratio is not None:
        v = tr["variants"]["tierckpt"]
        paired = lookup(tr, "summary", "paired_median_over_none", "tierckpt")
        budget = tr["every"] * tr["variants"]["none"]["mean_iter_s"]
        keeps_up = (v["commit_s_median"] or 0) < budget
        add(
            "training: iteration time with tierckpt <= 1.10x no checkpointing",
            ratio,
            1.10,
            ratio <= 1.10,
            f"{ratio:.2f}x of the means, {paired:.2f}x median of paired rounds; checkpoint every "
            f"{tr['every']} steps ({tr['state_bytes'] / MiB:.0f} MiB), committed in "
            f"{v['commit_s_median'] or 0:.2f} s vs {tr['every']} steps = {budget:.2f} s: the disk "
            f"{'keeps up' if keeps_up else 'does NOT keep up'}",
        )
    return out
