"""The training benchmark's every-step mode reports what makes it readable on a shared machine:
the load average around the run, per-round paired ratios with and without each block's closing
drain, and the CPU the library's own threads spent per checkpoint (which other tenants' load
does not inflate as it does iteration times)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tierckpt.bench.config import BenchConfig
from tierckpt.bench.report import format_table, summarize_train
from tierckpt.bench.train import train_worker


def _tiny(train_block: int = 4) -> BenchConfig:
    """8 steps of a one-layer model, with and without a checkpoint every step."""
    return BenchConfig(
        sizes_gib=(1.0,),
        contenders=(),
        train_variants=("none", "tierckpt"),
        train_steps=8,
        train_every=1,
        train_layers=1,
        train_dmodel=64,
        train_threads=1,
        train_block=train_block,
    )


def test_every_step_training_reports_load_paired_ratios_and_library_cpu(tmp_path: Path) -> None:
    train = train_worker(str(tmp_path), _tiny())
    assert len(train["load_average"]) == 2 and all(x >= 0 for x in train["load_average"])
    vs = train["variants"]
    assert vs["tierckpt"]["saves"] == 8
    for v in vs.values():
        assert len(v["round_mean_run_s"]) == train["rounds"] == 2
        assert all(x > 0 for x in v["round_mean_run_s"])
    assert vs["tierckpt"]["library_cpu_s_per_save"] > 0  # the capture at least copies bytes
    assert vs["none"]["library_cpu_s_per_save"] is None
    train["summary"] = summary = summarize_train(train)
    assert summary["paired_median_over_none_no_drain"]["none"] == 1.0
    assert summary["paired_median_over_none_no_drain"]["tierckpt"] > 0
    table = format_table(
        {"meta": {"config": {"train_layers": 1, "train_dmodel": 64}}, "sizes": [], "train": train}
    )
    assert "load average" in table and "library CPU per checkpoint" in table


def test_longer_blocks_take_turns_less_often(tmp_path: Path) -> None:
    """``train_block`` sets the steps per turn (and so how often a drain closes one)."""
    train = train_worker(str(tmp_path), _tiny(train_block=8))
    assert train["block_steps"] == 8 and train["rounds"] == 1
    assert train["variants"]["tierckpt"]["saves"] == 8
    with pytest.raises(ValueError, match="train block"):
        BenchConfig(sizes_gib=(1.0,), train_block=0)


def test_a_memory_tier_variant_splits_the_library_from_the_disk(tmp_path: Path) -> None:
    """``tierckpt_memory`` (on request, not by default) saves the same states into host RAM
    only: it saves as often as the disk variant, and its library CPU and ratios are reported
    as that variant's are."""
    cfg = replace(_tiny(), train_variants=("none", "tierckpt", "tierckpt_memory"), train_steps=4)
    assert "tierckpt_memory" not in BenchConfig().train_variants
    train = train_worker(str(tmp_path), cfg)
    vs = train["variants"]
    assert vs["tierckpt_memory"]["saves"] == vs["tierckpt"]["saves"] == 4
    # reported as for the disk variant (None where a variant has no library): counted in
    # clock ticks of 10 ms, four small saves into RAM may well count none
    cpu = vs["tierckpt_memory"]["library_cpu_s_per_save"]
    assert isinstance(cpu, float) and cpu >= 0, cpu
    assert vs["none"]["library_cpu_s_per_save"] is None
    assert vs["tierckpt_memory"]["label"] == "tierckpt (guard, MemoryTier only)"
    summary = summarize_train(train)
    assert summary["paired_median_over_none_no_drain"]["tierckpt_memory"] > 0
