"""Results into words: ratios against the baselines, and the Markdown tables that are
printed and pasted into docs/benchmarks.md."""

from __future__ import annotations

import statistics
from typing import Any

from tierckpt.bench.config import LABELS, GiB, MiB


def lookup(d: dict[str, Any] | None, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is missing (results of failed parts are)."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize_size(entry: dict[str, Any]) -> dict[str, Any]:
    """Ratios of tierckpt against every baseline, for one size."""
    cs = {k: v for k, v in entry["contenders"].items() if "error" not in v}
    out: dict[str, Any] = {"speedup_immediate": {}, "speedup_lazy": {}}
    for tk in ("tierckpt_256m", "tierckpt_default"):
        t = cs.get(tk)
        if t is None:
            continue
        ti = t["median"]["staged_s"]
        tl = t["median"]["lazy_blocked_s"]
        peers = {b: v for b, v in cs.items() if not b.startswith("tierckpt")}
        out["speedup_immediate"][tk] = {b: v["median"]["staged_s"] / ti for b, v in peers.items()}
        out["speedup_lazy"][tk] = {b: v["median"]["lazy_blocked_s"] / tl for b, v in peers.items()}
    return out


def summarize_train(train: dict[str, Any]) -> dict[str, Any]:
    """Iteration time of every variant over no checkpointing: ratio of the means, and the
    median of the per-round ratios (each round's blocks ran minutes apart at most)."""
    vs = train["variants"]
    if "none" not in vs:
        return {}
    base = vs["none"]
    return {
        "mean_iter_over_none": {k: v["mean_iter_s"] / base["mean_iter_s"] for k, v in vs.items()},
        "paired_median_over_none": {
            k: statistics.median(
                a / b
                for a, b in zip(v["round_mean_iter_s"], base["round_mean_iter_s"], strict=True)
            )
            for k, v in vs.items()
        },
        "median_iter_over_none": {
            k: v["median_iter_s"] / base["median_iter_s"] for k, v in vs.items()
        },
        # the same pairing without each block's closing drain (older results lack it)
        "paired_median_over_none_no_drain": {
            k: statistics.median(
                a / b for a, b in zip(v["round_mean_run_s"], base["round_mean_run_s"], strict=True)
            )
            for k, v in vs.items()
            if v.get("round_mean_run_s") and base.get("round_mean_run_s")
        },
    }


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 0.1:
        return f"{x * 1e3:.1f} ms"
    return f"{x:.2f} s"


def _fmt_load(load: list[float | None] | None) -> str:
    if not load or None in load:
        return ""
    return f"; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end"


def _fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x" if x >= 10 else f"{x:.2f}x"


#: stages whose bytes per busy second say something (plan and commit handle metadata)
_RATE_STAGES = frozenset({"capture", "encode", "checksum", "write", "sync"})


def format_breakdown(bd: dict[str, Any]) -> list[str]:
    """The per-stage breakdown of one tierckpt save (``save.tierckpt_breakdown``) as a
    Markdown table; says so when the pipeline reported no stage at all."""
    rows = bd.get("stages") or []
    if not rows:
        why = bd.get("error") or "the pipeline reported no stage events"
        return ["", f"Per-stage breakdown unavailable: {why}"]
    out = [
        "",
        f"Per-stage breakdown of one immediate save (staged {_fmt_s(bd.get('staged_s'))}, "
        f"committed {_fmt_s(bd.get('committed_s'))}); busy time summed over the pipeline's "
        "threads, so overlapping stages add up to more than the save:",
        "",
        "| stage | tier | busy | bytes | rate | events |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        secs = r["seconds"]
        rate = "-"
        if r["stage"] in _RATE_STAGES and secs > 0:
            rate = f"{r['nbytes'] / secs / 1e9:.2f} GB/s"
        out.append(
            f"| {r['stage']} | {r['tier'] or 'all'} | {_fmt_s(secs)} | "
            f"{r['nbytes'] / MiB:,.1f} MiB | {rate} | {r['events']:,} |"
        )
    return out


def format_table(result: dict[str, Any]) -> str:
    """The results as Markdown tables (printed, and pasted into docs/benchmarks.md)."""
    lines: list[str] = []
    cfg = result["meta"]["config"]
    for e in result["sizes"]:
        cs = e["contenders"]
        any_ok = next((v for v in cs.values() if "error" not in v), None)
        if any_ok is None:
            continue
        st = any_ok["state"]
        lines.append(
            f"### {e['gib']:g} GiB state: {st['nbytes'] / GiB:.2f} GiB in {st['tensors']:,} "
            f"tensors ({st['small_tensors']:,} under 64 KiB), {st['bf16_bytes'] / GiB:.2f} GiB "
            f"bf16 + {st['fp32_bytes'] / GiB:.2f} GiB fp32; median of {cfg['runs']} runs"
        )
        lines.append("")
        lines.append(
            "| contender | call returns | staged (immediate) | blocked, lazy "
            f"({cfg['compute_s']:g} s {cfg['compute']}) | committed on disk | "
            "peak extra host memory |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|")
        raw = None
        for name, v in cs.items():
            if "error" in v:
                lines.append(f"| {LABELS[name]} | failed: {v['error']} | | | | |")
                continue
            m = v["median"]
            mem = v["peak_extra_bytes"]
            lines.append(
                f"| {v['label']} | {_fmt_s(m.get('returns_s'))} | {_fmt_s(m.get('staged_s'))} | "
                f"{_fmt_s(m.get('lazy_blocked_s'))} | {_fmt_s(m.get('committed_s'))} | "
                f"{mem / MiB:,.0f} MiB |"
            )
            if v.get("raw_write") and raw is None:
                raw = v["raw_write"]["median"]
        if raw:
            lines.append(f"| raw write + fsync (same bytes) | | | | {_fmt_s(raw['total_s'])} | |")
        for name, why in e.get("skipped", {}).items():
            lines.append(f"| {LABELS[name]} | skipped: {why} | | | | |")
        lines.append("")
        summ = e.get("summary", {})
        for tk, sp in summ.get("speedup_immediate", {}).items():
            lz = summ["speedup_lazy"][tk]
            parts = [f"{b}: {_fmt_x(sp[b])} / {_fmt_x(lz[b])}" for b in sp]
            lines.append(f"{LABELS[tk]} blocks less than (immediate / lazy): " + ", ".join(parts))
            lines.append("")
        for tk in ("tierckpt_256m", "tierckpt_default"):
            t = cs.get(tk)
            if t and "error" not in t:
                m = t["median"]
                lines.append(
                    f"{LABELS[tk]}: arena {(t.get('arena_bytes') or 0) / MiB:,.0f} MiB, "
                    f"committed / raw write+fsync = {m.get('committed_over_raw', 0):.2f}x "
                    f"(median of per-run ratios), raw {_fmt_s(m.get('raw_total_s'))}"
                )
                bd = t.get("breakdown")
                if bd:
                    lines += format_breakdown(bd)
                lines.append("")
    tr = result.get("train")
    if tr and tr.get("variants"):
        vs = tr["variants"]
        lines.append(
            f"### Training loop: {cfg['train_layers']}-layer d={cfg['train_dmodel']} transformer "
            f"({tr['params'] / 1e6:.1f} M parameters, {tr['torch_threads']} torch threads), "
            f"checkpoint every {tr['every']} steps ({tr['state_bytes'] / MiB:.0f} MiB); the "
            f"variants take turns in blocks of {tr['block_steps']} steps, {tr['rounds']} rounds "
            "in ABBA order after a warm-up round" + _fmt_load(tr.get("load_average"))
        )
        lines.append("")
        lines.append(
            "| variant | mean iteration | vs none (means) | vs none (median of rounds) "
            "| (drain excluded) | median | p95 | max | blocked per checkpoint "
            "| library CPU per checkpoint | committed |"
        )
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        summ = tr.get("summary", {})
        for name, v in vs.items():
            lines.append(
                f"| {v['label']} | {_fmt_s(v['mean_iter_s'])} | "
                f"{_fmt_x(lookup(summ, 'mean_iter_over_none', name))} | "
                f"{_fmt_x(lookup(summ, 'paired_median_over_none', name))} | "
                f"{_fmt_x(lookup(summ, 'paired_median_over_none_no_drain', name))} | "
                f"{_fmt_s(v['median_iter_s'])} | {_fmt_s(v['p95_iter_s'])} | "
                f"{_fmt_s(v['max_iter_s'])} | {_fmt_s(v.get('blocked_s_median'))} | "
                f"{_fmt_s(v.get('library_cpu_s_per_save'))} | "
                f"{_fmt_s(v['commit_s_median'])} |"
            )
        lines.append("")
    elif tr:
        lines.append(f"Training loop failed: {tr.get('error')}")
        lines.append("")
    if result.get("targets"):
        lines.append("### Targets")
        lines.append("")
        lines.append("| target | met | measured |")
        lines.append("|---|---|---|")
        for t in result["targets"]:
            lines.append(f"| {t['target']} | {'yes' if t['met'] else 'NO'} | {t['detail']} |")
        lines.append("")
    return "\n".join(lines)
