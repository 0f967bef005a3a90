"""What a checkpoint's disk writes cost a training loop beside them, by how they are written.

The training bench's small transformer (tierckpt.bench.train.TinyLM: 4 layers, d=256) trains on
the CPU; at the start of each step a thread writes one checkpoint-sized file (``--mib``, 85 by
default: the model with its AdamW state) from a pre-touched buffer with ``O_DIRECT``, fsyncs
it, renames it into place and fsyncs the folder, keeping the newest two files, in one of:

- ``fresh``: a new file each step, and the file two steps old is unlinked (what a local tier
  does: a new temporary file per save, retention unlinks the retired one);
- ``reuse``: the file two steps old is renamed to the new temporary name and overwritten in
  place (tried in the library as commit 84ee6de and reverted: see docs/benchmarks.md,
  thirteenth session);
- ``buffered``: as ``fresh`` but through the page cache;
- ``none``: no writes (the baseline).

The variants take turns in blocks of ``--block`` steps, their order alternating each round,
after a warm-up; the report gives each variant's median and mean step time, the ratio to
``none``, and the median wall time of its writes. No tierckpt code writes here: this isolates
what the kernel, the filesystem and the device charge for the same bytes.

    python benchmarks/bench_disk_reuse.py --rounds 8 --dir /path/on/the/disk
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch

from tierckpt.bench.train import TinyLM

VARIANTS = ("none", "fresh", "reuse", "buffered")


class Writer:
    """Writes step files into ``folder``, keeping the newest two."""

    def __init__(self, folder: str, mib: int, huge: bool = False) -> None:
        self.folder = folder
        self.buf = mmap.mmap(-1, mib << 20)  # page aligned, as O_DIRECT needs
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            self.buf.madvise(mmap.MADV_HUGEPAGE)  # as the host arena does (fewer pages to pin)
        self.buf.write(os.urandom(1 << 20) * mib)
        self.n = 0

    def _path(self, i: int) -> str:
        return os.path.join(self.folder, f"f{i}")

    def _finish(self, fd: int, tmp: str, i: int) -> None:
        os.fsync(fd)
        os.close(fd)
        os.rename(tmp, self._path(i))
        dfd = os.open(self.folder, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)

    def write(self, variant: str) -> None:
        i, self.n = self.n, self.n + 1
        tmp, old = self._path(i) + ".tmp", self._path(i - 2)
        direct = getattr(os, "O_DIRECT", 0) if variant != "buffered" else 0
        if variant == "reuse" and os.path.exists(old):
            os.rename(old, tmp)
            fd = os.open(tmp, os.O_WRONLY | direct)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        os.write(fd, self.buf)
        self._finish(fd, tmp, i)
        if os.path.exists(old):
            os.unlink(old)

    def close(self) -> None:
        self.buf.close()


def run(
    folder: str, variants: list[str], rounds: int, block: int, mib: int, huge: bool = False
) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    vocab, seq, batch = 8192, 128, 8
    model = TinyLM(vocab, 256, 4, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (64, batch, seq + 1))

    def step(k: int) -> None:
        xy = data[k % 64]
        logits = model(xy[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), xy[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    writers = {v: Writer(os.path.join(folder, v), mib, huge) for v in variants}
    for v, w in writers.items():
        os.makedirs(w.folder, exist_ok=True)
        for _ in range(3):  # warm-up: each variant's files exist, its buffer is touched
            if v != "none":
                w.write(v)
    for k in range(4):
        step(k)
    steps: dict[str, list[float]] = {v: [] for v in variants}
    io: dict[str, list[float]] = {v: [] for v in variants}
    k = 0
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            for _ in range(block):
                spent = [0.0]

                def job(v: str = v, spent: list[float] = spent) -> None:
                    t = time.perf_counter()
                    if v != "none":
                        writers[v].write(v)
                    spent[0] = time.perf_counter() - t

                th = threading.Thread(target=job)
                t0 = time.perf_counter()
                th.start()
                step(k)
                k += 1
                th.join()
                steps[v].append(time.perf_counter() - t0)
                io[v].append(spent[0])
    for w in writers.values():
        w.close()
    base_med = statistics.median(steps[variants[0]])
    base_mean = statistics.fmean(steps[variants[0]])
    return {
        v: {
            "step_median_s": statistics.median(steps[v]),
            "step_mean_s": statistics.fmean(steps[v]),
            "ratio_median": statistics.median(steps[v]) / base_med,
            "ratio_mean": statistics.fmean(steps[v]) / base_mean,
            "write_median_s": statistics.median(io[v]),
        }
        for v in variants
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=None, help="a folder on the disk to measure (default: cwd)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="the first is the baseline")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=8, help="steps per variant per round")
    p.add_argument("--mib", type=int, default=85, help="MiB written per step")
    p.add_argument(
        "--huge-pages", action="store_true", help="the written buffer asks for huge pages"
    )
    a = p.parse_args(argv)
    variants = a.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    folder = tempfile.mkdtemp(prefix=".bench-disk-reuse-", dir=a.dir or os.getcwd())
    try:
        res = run(folder, variants, a.rounds, a.block, a.mib, a.huge_pages)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"| variant | step median | step mean | vs {variants[0]} (median) | (mean) | write |")
    print("|---|---:|---:|---:|---:|---:|")
    for v, r in res.items():
        print(
            f"| {v} | {r['step_median_s'] * 1e3:.0f} ms | {r['step_mean_s'] * 1e3:.0f} ms | "
            f"{r['ratio_median']:.3f}x | {r['ratio_mean']:.3f}x | {r['write_median_s'] * 1e3:.0f} ms |"
        )
    return res


if __name__ == "__main__":
    main()
