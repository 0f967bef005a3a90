"""The training process of ``tierckpt demo``: a small GPT trained on bytes, deterministically.

Run by :mod:`tierckpt.demo.scenario` as a child process, in one of two modes:

``--mode reference``
    an uninterrupted run that checkpoints the classic way, with a blocking ``torch.save``
    every ``--every`` steps (the baseline, and the losses to compare against).
``--mode tierckpt``
    the same run checkpointing through ``NodeRamTier -> LocalTier -> S3Tier`` (``MemoryTier``
    first instead without ``--node-ram``); with ``--resume`` it first restores the newest
    committed checkpoint (after a crash the node's RAM has it; on a fresh node only S3 does),
    counting the bytes it read from each tier, and continues from there.

``--wait-go``: the process imports and builds everything that does not touch a checkpoint,
then waits for a line on stdin before it opens its tiers, so that the demo can start it while
the previous process still trains (its start-up time is then hidden, not part of the story).

Everything that decides the numbers is fixed: seeds, deterministic kernels, one thread, the
batch of step ``s`` derived from ``s`` alone, and the RNG state (dropout) saved in the
checkpoint. So a run restored from step ``s`` must reproduce the uninterrupted run's losses
bit for bit. The process talks to its parent in JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TEXT", "TinyGPT", "batch_for_step", "main", "state_digest"]

#: the training text (original prose; the model learns to continue it byte by byte)
TEXT = """\
A training run is a long walk across a landscape that nobody has mapped. Every few minutes
the walker stops, looks back, and writes down where she stands, so that a storm, a fall, or
a tired machine does not send her back to the very beginning. Writing it down used to mean
standing still: the whole of the model, every weight and every moment of the optimizer,
copied out to a disk while the accelerators waited with nothing to do.

There is a better way to keep a record. Between two steps of the optimizer, the weights do
not move. The forward pass reads them, the backward pass reads them, and only the update at
the end writes them. So the copy can start the moment the update finishes and run beside
the next forward and backward pass, and training only has to wait if the copy is still
unfinished when the next update wants to begin.

Once the bytes sit in host memory, they flow outward through tiers: first the memory of the
machine itself, which is fast but forgets everything when the process dies; then the local
disk, which survives a crash of the program but not the loss of the node; and last an object
store far away, which survives the loss of the whole cluster. Each tier receives the same
checkpoint as a stream of chunks, and each tier commits it on its own, by writing a small
manifest after every byte of data is safely stored. A checkpoint exists on a tier when, and
only when, its manifest is there.

When a node is lost, a new one starts with empty disks. It lists the manifests in the object
store, picks the newest, reads the chunks in parallel, checks every checksum, and rebuilds
the state. If the run was written carefully, with its random number generators saved and its
data order derived from the step, the new node continues exactly where the old one stopped,
and the loss curve shows no seam at all.
"""


# -- the model --------------------------------------------------------------------------------
class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, -1).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (self.drop(att) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        out: torch.Tensor = x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))
        return out


class TinyGPT(nn.Module):
    """A GPT-style decoder on byte tokens, with the output head tied to the embedding."""

    def __init__(
        self,
        *,
        dim: int = 128,
        layers: int = 3,
        heads: int = 4,
        context: int = 64,
        dropout: float = 0.1,
        vocab: int = 256,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: two names, one storage in the checkpoint

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


# -- data and determinism ---------------------------------------------------------------------
def corpus() -> torch.Tensor:
    return torch.tensor(list(TEXT.encode("utf-8")), dtype=torch.long)


def batch_for_step(
    data: torch.Tensor, step: int, *, batch: int, context: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: a function of the step alone, so a restart sees the same data."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + context + 1] for s in starts.tolist()])
    return x, y


def deterministic(seed: int) -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass
    torch.manual_seed(seed)


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            yield from _tensors(obj[k], f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}.{i}")


def state_digest(state: Any) -> str:
    """sha256 over the names and bytes of every tensor (bit-exact comparison of states)."""
    h = hashlib.sha256()
    for name, t in _tensors(state):
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- talking to the parent ------------------------------------------------------------------
_out_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = json.dumps({"ev": event, **fields})
    with _out_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# -- the run ----------------------------------------------------------------------------------
def _lr_schedule(total: int, warmup: int) -> Callable[[int], float]:
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - warmup) / max(1, total - warmup)))

    return f


class ReadCounter:
    """Bytes each tier's backend read (wrappers on the backend objects' read methods)."""

    def __init__(self, ck: Any) -> None:
        self.bytes: dict[str, int] = {}
        for name in ck.tier_names:
            self._wrap(name, ck.backend(name))

    def _wrap(self, name: str, backend: Any) -> None:
        self.bytes[name] = 0
        read, read_into, pieces, get = (
            backend.read,
            backend.read_into,
            backend.read_into_pieces,
            backend.get,
        )

        def c_read(obj: str, offset: int, length: int) -> Any:
            self.bytes[name] += length
            return read(obj, offset, length)

        def c_read_into(obj: str, offset: int, out: memoryview) -> None:
            self.bytes[name] += out.nbytes
            read_into(obj, offset, out)

        def c_pieces(obj: str, offset: int, outs: Any) -> None:
            self.bytes[name] += sum(memoryview(o).nbytes for o in outs)
            pieces(obj, offset, outs)

        def c_get(obj: str) -> bytes:
            data: bytes = get(obj)
            self.bytes[name] += len(data)
            return data

        backend.read, backend.read_into = c_read, c_read_into
        backend.read_into_pieces, backend.get = c_pieces, c_get
        mapped_path = getattr(backend, "mapped_path", None)
        if mapped_path is not None:
            # a node-RAM load maps the shard file and checksums every byte of it in place
            # (no read call): count the mapped file's bytes
            def c_mapped(obj: str) -> str:
                path: str = mapped_path(obj)
                self.bytes[name] += os.path.getsize(path)
                return path

            backend.mapped_path = c_mapped


def run(args: argparse.Namespace) -> int:
    deterministic(args.seed)
    model = TinyGPT(dim=args.dim, layers=args.layers, heads=args.heads, context=args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_schedule(args.steps, args.steps // 10))
    data = corpus()

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }

    n_params = sum(p.numel() for p in model.parameters())
    ck = None
    start = 0
    if args.mode == "tierckpt":
        import tierckpt
        import tierckpt.backends.s3  # imported before the wait: start-up time

    if args.wait_go:
        sys.stdin.readline()
    if args.mode == "tierckpt":
        first: tierckpt.TierSpec = (
            tierckpt.NodeRamTier(path=args.node_ram, namespace="demo", stale_after_s=None)
            if args.node_ram
            else tierckpt.MemoryTier(namespace=f"demo-{os.getpid()}", keep_last=1)
        )
        tiers = [
            first,
            tierckpt.LocalTier(args.local_dir, keep_last=2),
            tierckpt.S3Tier(args.s3_url, endpoint_url=args.endpoint_url, keep_last=3),
        ]

        def on_commit(r: tierckpt.TierResult) -> None:
            emit(
                "commit",
                step=r.step,
                tier=r.tier,
                raw=r.raw_bytes,
                stored=r.stored_bytes,
                seconds=r.seconds,
                codec=r.codec,
            )

        ck = tierckpt.Checkpointer(tiers, host_buffer_bytes=64 << 20, on_commit=on_commit)
        ck.guard(opt, model)
        if args.resume:
            counter = ReadCounter(ck)
            t0 = time.perf_counter()
            loaded = ck.load()
            seconds = time.perf_counter() - t0
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
            sched.load_state_dict(loaded["scheduler"])
            if not args.no_rng_restore:
                torch.set_rng_state(loaded["rng"])
            start = int(loaded["step"])
            emit(
                "restored",
                step=start,
                seconds=seconds,
                tiers=ck.tier_steps(),
                read=counter.bytes,
                digest=state_digest(loaded),
            )
    emit("start", params=n_params, first_step=start + 1, pid=os.getpid())

    pending: list[Any] = []
    save_call: dict[int, float] = {}
    t_train = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        x, y = batch_for_step(data, step, batch=args.batch, context=args.context, seed=args.seed)
        loss = F.cross_entropy(model(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()  # with ck.guard(opt) this waits for an unfinished capture, if any
        sched.step()
        emit("loss", step=step, loss=loss.item())
        for h in [h for h in pending if h.captured]:
            emit(
                "blocked",
                step=h.step,
                seconds=h.blocked_seconds,
                save_call=save_call.get(h.step, 0.0),
            )
            pending.remove(h)
        if step % args.every == 0:
            if ck is not None:
                t0 = time.perf_counter()
                pending.append(ck.save(state(step), step))
                save_call[step] = time.perf_counter() - t0
            elif args.baseline_dir:
                path = os.path.join(args.baseline_dir, "checkpoint.pt")
                t0 = time.perf_counter()
                torch.save(state(step), path)
                t1 = time.perf_counter()
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                t2 = time.perf_counter()
                emit(
                    "torch_save",
                    step=step,
                    seconds=t1 - t0,
                    fsync_seconds=t2 - t1,
                    bytes=os.path.getsize(path),
                )
    train_seconds = time.perf_counter() - t_train
    if ck is not None:
        ck.wait()
        for h in pending:
            emit(
                "blocked",
                step=h.step,
                seconds=h.blocked_seconds,
                save_call=save_call.get(h.step, 0.0),
            )
        ck.close()
    emit("done", digest=state_digest(state(args.steps)), train_seconds=train_seconds)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m tierckpt.demo.train",
        description="The training child process of `tierckpt demo`.",
    )
    p.add_argument("--mode", choices=["reference", "tierckpt"], required=True)
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--local-dir", default="")
    p.add_argument("--s3-url", default="")
    p.add_argument("--endpoint-url", default=None)
    p.add_argument("--baseline-dir", default="")
    p.add_argument(
        "--node-ram",
        default="",
        help="the node's shared-memory folder: NodeRamTier first (else MemoryTier)",
    )
    p.add_argument("--resume", action="store_true")
    p.add_argument(
        "--wait-go", action="store_true", help="wait for a line on stdin before opening the tiers"
    )
    p.add_argument(
        "--no-rng-restore",
        action="store_true",
        help="(for tests) do not restore the RNG state: the losses must diverge",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
