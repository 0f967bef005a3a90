"""The training benchmark: a small transformer trains on the CPU while each variant
checkpoints it every few steps, the variants taking turns in ABBA order."""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.config import LABELS, BenchConfig
from tierckpt.bench.probes import median


class TinyLM(torch.nn.Module):
    """A small decoder-style transformer language model, sized to train on two CPU cores."""

    def __init__(self, vocab: int, d_model: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d_model))
        layer = torch.nn.TransformerEncoderLayer(
            d_model,
            nhead=max(1, d_model // 64),
            dim_feedforward=4 * d_model,
            batch_first=True,
            norm_first=True,
            dropout=0.0,
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(d_model)
        self.head = torch.nn.Linear(d_model, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        out: torch.Tensor = self.head(self.norm(h))
        return out


class _TrainSaver:
    """What one training variant does at a checkpoint, before the optimizer step, and when
    its turn ends (``drain``: wait until everything it started is durable)."""

    def __init__(self, variant: str, out: Path, opt: torch.optim.Optimizer) -> None:
        self.variant = variant
        self.out = out
        out.mkdir(parents=True, exist_ok=True)
        self.paths: list[Path] = []
        self.commit_s: list[float] = []
        self.handles: list[Any] = []
        self.ck: Any = None
        self.stager: Any = None
        self.resp: Any = None
        self.blocked_s: list[float] = []  # per checkpoint: the save call + the wait before step
        self._pending_block: float | None = None
        if variant in ("tierckpt", "tierckpt_memory"):
            from tierckpt import Checkpointer, LocalTier, MemoryTier

            tier = (
                LocalTier(out, keep_last=2)
                if variant == "tierckpt"
                else MemoryTier(keep_last=2, namespace=f"bench-train-{id(self)}")
            )
            self.ck = Checkpointer([tier])
            self.ck.guard(opt)  # a no-op while this Checkpointer has nothing in flight
        elif variant == "dcp_async_stager":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(False, False, True, False))

    def before_step(self) -> None:
        t0 = time.perf_counter()
        if self.ck is not None and self.handles and not self.handles[-1].captured:
            self.ck.wait_captured()  # what guard() does inside optimizer.step(), timed here
        if self.resp is not None and hasattr(self.resp, "staging_completion"):
            self.resp.staging_completion.result()
        if self._pending_block is not None:
            self.blocked_s.append(self._pending_block + time.perf_counter() - t0)
            self._pending_block = None

    def _prune(self) -> None:
        while len(self.paths) > 2:
            p = self.paths.pop(0)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)

    def _finish_previous(self) -> None:
        if self.resp is None:
            return
        getattr(self.resp, "upload_completion", self.resp).result()
        self.resp = None

    def save(self, state: dict[str, Any], step: int) -> None:
        t0 = time.perf_counter()
        self._save(state, step)
        self._pending_block = time.perf_counter() - t0

    def _save(self, state: dict[str, Any], step: int) -> None:
        if self.ck is not None:
            self.handles.append(self.ck.save(state, step))
            return
        path = self.out / f"step-{step}"
        if self.variant == "torch_save":
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            self.commit_s.append(time.perf_counter() - t0)
        else:
            from torch.distributed.checkpoint import state_dict_saver as dcp

            self._finish_previous()  # DCP's usage: one upload in flight
            t0 = time.perf_counter()
            self.resp = dcp.async_save(state, checkpoint_id=str(path), async_stager=self.stager)
            up = getattr(self.resp, "upload_completion", self.resp)
            up.add_done_callback(lambda _f: self.commit_s.append(time.perf_counter() - t0))
        self.paths.append(path)
        self._prune()

    def drain(self) -> None:
        if self.ck is not None:
            self.ck.wait()
        self._finish_previous()

    def close(self) -> None:
        self.drain()
        if self.ck is not None:
            for h in self.handles:
                for r in h.results.values():  # the one tier's result
                    self.commit_s.append(r.seconds)
            self.ck.close()
        if self.stager is not None:
            self.stager.close()


def library_cpu_s() -> dict[int, float]:
    """CPU seconds used so far by each of this process's tierckpt threads (all named
    ``tierckpt-*``; alive ones, by native id): a measure of the background work that does not
    depend on how busy the rest of the machine is, as the iteration times do."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    for th in threading.enumerate():
        tid = th.native_id
        if not th.name.startswith("tierckpt") or tid is None:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # not Linux, or the thread just ended
            continue
        out[tid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_since(before: dict[int, float]) -> float:
    """CPU seconds the tierckpt threads alive now used since ``before`` (a thread started
    since counts from zero; one that ended since is lost, not counted negative)."""
    return sum(cpu - before.get(tid, 0.0) for tid, cpu in library_cpu_s().items())


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def train_schedule(variants: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, variant) blocks: one unmeasured warm-up round (-1), then ``rounds`` rounds in
    ABBA order, so a drift in the machine's load touches every variant alike."""
    out = [(-1, v) for v in variants]
    for r in range(rounds):
        out += [(r, v) for v in (variants if r % 2 == 0 else variants[::-1])]
    return out


def train_worker(directory: str, cfg: BenchConfig) -> dict[str, Any]:
    """Train one model; the variants take turns in blocks of ``train_every`` steps (at least
    ``train_block``, default 4).

    Interleaving in one process is what makes the comparison usable on a shared machine:
    separate runs minutes apart differed by 2-4x in iteration time from other tenants' load
    alone. A block's saves land mid-block; at its end the variant's outstanding checkpoint
    work is waited for and that wait is charged to the block's last iteration.
    """
    warnings.filterwarnings("ignore", category=UserWarning)
    if cfg.train_threads > 0:
        torch.set_num_threads(cfg.train_threads)
    torch.manual_seed(cfg.seed)
    vocab, seq, batch = 8192, 128, 8
    model = TinyLM(vocab, cfg.train_dmodel, cfg.train_layers, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (64, batch, seq + 1))
    out = Path(directory) / "train"
    savers = {v: _TrainSaver(v, out / v, opt) for v in cfg.train_variants if v != "none"}
    # one save or more per block, at least train_block steps
    block = cfg.train_every * max(1, -(-cfg.train_block // cfg.train_every))
    rounds = max(1, -(-cfg.train_steps // block))
    times: dict[str, list[float]] = {v: [] for v in cfg.train_variants}
    round_means: dict[str, list[float]] = {v: [] for v in cfg.train_variants}
    # the same without the block's closing drain (the wait until its last save is durable)
    round_run_means: dict[str, list[float]] = {v: [] for v in cfg.train_variants}
    library_cpu = dict.fromkeys(cfg.train_variants, 0.0)
    load_start = _load_average()
    saves = dict.fromkeys(cfg.train_variants, 0)
    state_bytes = 0
    step = 0
    try:
        for rnd, v in train_schedule(cfg.train_variants, rounds):
            saver = savers.get(v)
            block_times: list[float] = []
            cpu0 = library_cpu_s()
            for j in range(block):
                t0 = time.perf_counter()
                xy = data[step % data.shape[0]]
                logits = model(xy[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, vocab), xy[:, 1:].reshape(-1)
                )
                loss.backward()  # type: ignore[no-untyped-call]
                if saver is not None:
                    saver.before_step()
                opt.step()
                opt.zero_grad(set_to_none=True)
                # after the step, so the state is consistent
                if saver is not None and (j + 1 + cfg.train_every // 2) % cfg.train_every == 0:
                    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                    state_bytes = state_bytes or _tensor_bytes(state)
                    saver.save(state, step)
                    saves[v] += rnd >= 0
                block_times.append(time.perf_counter() - t0)
                step += 1
            run_mean = statistics.fmean(block_times)
            if saver is not None:
                t0 = time.perf_counter()
                saver.drain()
                block_times[-1] += time.perf_counter() - t0
            if rnd >= 0:
                times[v].extend(block_times)
                round_means[v].append(statistics.fmean(block_times))
                round_run_means[v].append(run_mean)
                library_cpu[v] += _cpu_since(cpu0)
        for s in savers.values():
            s.close()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    variants: dict[str, Any] = {}
    for v, ts in times.items():
        sv = savers.get(v)
        variants[v] = {
            "variant": v,
            "label": LABELS[v],
            "steps": len(ts),
            "saves": saves[v],
            "mean_iter_s": statistics.fmean(ts),
            "median_iter_s": statistics.median(ts),
            "p95_iter_s": sorted(ts)[int(0.95 * (len(ts) - 1))],
            "max_iter_s": max(ts),
            "round_mean_iter_s": round_means[v],
            "round_mean_run_s": round_run_means[v],
            "library_cpu_s_per_save": library_cpu[v] / saves[v] if saves[v] else None,
            "commit_s_median": median(sv.commit_s) if sv is not None else None,
            "blocked_s_median": median(sv.blocked_s) if sv is not None else None,
            "iter_s": ts,
        }
    return {
        "variants": variants,
        "every": cfg.train_every,
        "block_steps": block,
        "rounds": rounds,
        "state_bytes": state_bytes,
        "torch_threads": torch.get_num_threads(),
        "load_average": [load_start, _load_average()],
        "params": sum(p.numel() for p in model.parameters()),
    }


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0
