"""``tierckpt demo``: train, lose the node, restore from S3 elsewhere, continue bit for bit.

What it does, on this machine, with nothing to configure:

1. starts an S3 server (moto) on 127.0.0.1 in this process, so it outlives the children;
2. **reference**: a child process trains a small GPT on bytes for ``--steps`` steps,
   checkpointing the classic way (a blocking ``torch.save`` every ``--every`` steps);
3. **node 1**: a child trains the same run with tierckpt (``MemoryTier -> LocalTier ->
   S3Tier``, default codec policy) and is killed with SIGKILL partway;
4. **node 2**: a fresh child with an empty local folder restores the newest checkpoint
   committed on S3 and trains to the end;
5. checks that node 1's losses and node 2's losses after the restore equal the reference's
   bit for bit (and the final states' sha256), then prints a table: training time blocked per
   checkpoint against ``torch.save``, bytes written per tier, compression, restore time.

Exits 1 if the continuation is not bit-identical. The training itself is in
:mod:`tierckpt.demo.train`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["main"]

BUCKET = "tierckpt-demo"
#: a child that makes no progress for this long is killed (never hang)
CHILD_TIMEOUT_S = 600


# -- running a child ------------------------------------------------------------------------------
@dataclass
class ChildRun:
    """Everything one child process reported."""

    name: str
    log_path: str = ""
    losses: dict[int, float] = field(default_factory=dict)
    commits: list[dict[str, Any]] = field(default_factory=list)
    blocked: dict[int, float] = field(default_factory=dict)
    torch_saves: list[dict[str, Any]] = field(default_factory=list)
    restored: dict[str, Any] | None = None
    done: dict[str, Any] | None = None
    killed_at: int | None = None
    returncode: int | None = None
    wall_seconds: float = 0.0


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=desc,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None,
        leave=True,
        bar_format="{desc:<34} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} "
        "[{elapsed}<{remaining}]{postfix}",
    )


def _on_s3(commits: list[dict[str, Any]], step: int) -> bool:
    return any(c.get("tier") == "s3" and int(c.get("step", -1)) >= step for c in commits)


def run_child(
    name: str,
    argv: list[str],
    env: dict[str, str],
    log_path: str,
    *,
    total: int,
    first_step: int = 1,
    kill_when: Callable[[int, list[dict[str, Any]]], bool] | None = None,
) -> ChildRun:
    """Run ``python -m tierckpt.demo.train argv``; SIGKILL it once ``kill_when(step,
    commits)`` (the commit events seen so far) holds."""
    run = ChildRun(name, log_path)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierckpt.demo.train", *argv],
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            bufsize=1,
        )
        watchdog = threading.Timer(CHILD_TIMEOUT_S, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        bar = _bar(total, name)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    log.write(line)
                    continue
                kind = ev.pop("ev", "")
                if kind == "loss":
                    step = int(ev["step"])
                    run.losses[step] = float(ev["loss"])
                    bar.update(1)
                    bar.set_postfix_str(f"loss {ev['loss']:.4f}", refresh=False)
                    kill = kill_when is not None and run.killed_at is None
                    if kill and kill_when is not None and kill_when(step, run.commits):
                        os.kill(proc.pid, signal.SIGKILL)
                        run.killed_at = step
                elif kind == "commit":
                    run.commits.append(ev)
                elif kind == "blocked":
                    run.blocked[int(ev["step"])] = float(ev["seconds"])
                elif kind == "torch_save":
                    run.torch_saves.append(ev)
                elif kind == "restored":
                    run.restored = ev
                    bar.update(int(ev["step"]) - first_step + 1)
                elif kind == "done":
                    run.done = ev
            run.returncode = proc.wait()
        finally:
            watchdog.cancel()
            bar.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    run.wall_seconds = time.perf_counter() - t0
    return run


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


def report(ref: ChildRun, node1: ChildRun, node2: ChildRun, state_bytes: int) -> str:
    out = []
    blocked = list(node1.blocked.values()) + list(node2.blocked.values())
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
    out.append("Bytes written per tier (node 1 until the kill, then node 2):")
    rows = []
    for tier in ("memory", "local", "s3"):
        cs = [c for c in node1.commits + node2.commits if c["tier"] == tier]
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
    if node2.restored:
        r = node2.restored
        out.append("")
        out.append(
            f"Restore on node 2 (empty local disk) from S3: step {r['step']}, "
            f"{_mib(state_bytes)} read, verified and decoded in {_ms(r['seconds'])} "
            "(node 1's disks are gone: only S3 had it)"
        )
    return "\n".join(out)


# -- the demo -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tierckpt demo",
        description="Train a small GPT with checkpoints through RAM -> local disk -> S3 "
        "(moto on 127.0.0.1), kill -9 the trainer partway, restore on a new node "
        "from S3 and check the loss continues bit for bit.",
    )
    p.add_argument("--steps", type=int, default=240, help="training steps (default 240)")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="SIGKILL node 1 after this step (default: a bit past the middle)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=int, default=3, help="transformer blocks (default 3)")
    p.add_argument(
        "--quick", action="store_true", help="a short run for tests: 40 steps, smaller model"
    )
    p.add_argument(
        "--workdir",
        default=None,
        help="folder for the nodes' local tiers and logs (default: a temp dir)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder afterwards")
    p.add_argument("--break-rng", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.dim, args.layers = 40, 5, 64, 2
    if args.steps < 2 * args.every or args.every < 1:
        p.error("--steps must cover at least two checkpoints (--every)")
    if args.kill_at is None:
        args.kill_at = args.steps * 11 // 20 + args.every // 3 + 1
    if not args.every <= args.kill_at < args.steps:
        p.error(f"--kill-at must be in [{args.every}, {args.steps})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from tierckpt.testing.s3servers import start_moto
    except ImportError as exc:  # pragma: no cover
        print(f"the demo needs moto's server: pip install 'moto[server]' ({exc})", file=sys.stderr)
        return 1
    t_start = time.perf_counter()
    workdir = args.workdir or tempfile.mkdtemp(prefix="tierckpt-demo-")
    os.makedirs(workdir, exist_ok=True)
    paths = {k: os.path.join(workdir, k) for k in ("node1", "node2", "baseline", "logs")}
    for p in paths.values():
        os.makedirs(p, exist_ok=True)
    try:
        import moto  # noqa: F401
    except ImportError:
        print("the demo needs moto's server: pip install 'moto[server]'", file=sys.stderr)
        return 1
    server = start_moto()
    rc = 1
    try:
        rc = _demo(args, server, workdir, paths, t_start)
        return rc
    finally:
        server.stop()
        if rc == 0 and not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif rc != 0:
            print(f"work folder kept for inspection: {workdir}", file=sys.stderr)


def _demo(
    args: argparse.Namespace, server: Any, workdir: str, paths: dict[str, str], t_start: float
) -> int:
    from tierckpt.backends.s3 import S3Backend
    from tierckpt.catalog import committed_steps
    from tierckpt.offline import verify_checkpoint

    admin = server.client()
    admin.create_bucket(Bucket=BUCKET)
    s3_url = f"s3://{BUCKET}/run-{args.seed}"
    # the children talk to the demo's server only: none of the user's AWS settings leak in
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": server.access_key,
            "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_DEFAULT_REGION": server.region,
            "AWS_ENDPOINT_URL": server.endpoint_url,
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONHASHSEED": "0",
            "PYTHONUNBUFFERED": "1",
        }
    )
    model = [
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--seed",
        str(args.seed),
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
    ]
    tiered = ["--mode", "tierckpt", "--s3-url", s3_url, "--endpoint-url", server.endpoint_url]

    print(
        f"tierckpt demo: a {args.layers}-block GPT on bytes, {args.steps} steps, a checkpoint "
        f"every {args.every} steps; S3 (moto) at {server.endpoint_url}"
    )
    print("  1. reference run, blocking torch.save checkpoints")
    print(
        "  2. node 1: tierckpt through memory -> local disk -> S3, killed with SIGKILL "
        f"after step {args.kill_at}"
    )
    print("  3. node 2: empty disks, restores from S3, trains to the end; losses compared\n")
    sys.stdout.flush()

    ref = run_child(
        "1. reference (torch.save)",
        [*model, "--mode", "reference", "--baseline-dir", paths["baseline"]],
        env,
        os.path.join(paths["logs"], "reference.log"),
        total=args.steps,
    )
    if ref.returncode != 0 or ref.done is None:
        return _child_failed(ref)

    # the kill waits for S3 to commit the newest save before --kill-at, so that the story
    # (and the restored step) is the same on a loaded machine as on a quiet one
    last_save = args.kill_at // args.every * args.every
    node1 = run_child(
        "2. node 1 (tierckpt, kill -9)",
        [*model, *tiered, "--local-dir", os.path.join(paths["node1"], "ckpt")],
        env,
        os.path.join(paths["logs"], "node1.log"),
        total=args.steps,
        kill_when=lambda s, commits: s >= args.kill_at and _on_s3(commits, last_save),
    )
    if node1.killed_at is None:
        return _child_failed(node1)
    s3 = S3Backend(s3_url, client=admin)
    on_s3 = committed_steps(s3)
    print(
        f"node 1 killed with SIGKILL after step {node1.killed_at} (exit status "
        f"{node1.returncode}); committed on S3: steps {on_s3 or 'none'}"
    )
    if not on_s3:
        print("no checkpoint reached S3 before the kill: raise --kill-at", file=sys.stderr)
        return 1
    rep = verify_checkpoint(s3, on_s3[-1])
    print(f"verified S3 step {on_s3[-1]}: {rep.chunks} chunk(s), every checksum ok, decoded\n")
    sys.stdout.flush()

    node2 = run_child(
        "3. node 2 (restore from S3)",
        [*model, *tiered, "--resume", "--local-dir", os.path.join(paths["node2"], "ckpt")]
        + (["--no-rng-restore"] if args.break_rng else []),
        env,
        os.path.join(paths["logs"], "node2.log"),
        total=args.steps,
    )
    if node2.returncode != 0 or node2.done is None or node2.restored is None:
        return _child_failed(node2)

    restored = int(node2.restored["step"])
    state_bytes = max((c["raw"] for c in node1.commits), default=0)
    print()
    print(report(ref, node1, node2, state_bytes))
    print()
    ok = True
    bad1 = _first_mismatch(node1.losses, ref.losses, range(1, max(node1.losses) + 1))
    bad2 = _first_mismatch(node2.losses, ref.losses, range(restored + 1, args.steps + 1))
    if bad1 is not None:
        ok = False
        print(f"MISMATCH node 1 vs reference at step {bad1[0]}: {bad1[1]!r} != {bad1[2]!r}")
    if bad2 is not None:
        ok = False
        print(f"MISMATCH node 2 vs reference at step {bad2[0]}: {bad2[1]!r} != {bad2[2]!r}")
    same_state = node2.done["digest"] == ref.done["digest"]
    if not same_state:
        ok = False
        print("MISMATCH: node 2's final state differs from the reference's")
    total = time.perf_counter() - t_start
    if ok:
        redone = node1.killed_at - restored
        print(
            f"Continuation is bit-identical: node 2 resumed at step {restored + 1} (node 1 had "
            f"reached {node1.killed_at}, so {redone} step(s) were redone) and its "
            f"{args.steps - restored} losses equal the uninterrupted run's, as do node 1's "
            f"{len(node1.losses)}; final state sha256 {ref.done['digest'][:16]}... matches."
        )
    else:
        print(f"Continuation is NOT bit-identical (logs in {paths['logs']}).")
    print(f"demo finished in {total:.0f} s" + (f"; files kept in {workdir}" if args.keep else ""))
    return 0 if ok else 1


def _child_failed(run: ChildRun) -> int:
    print(
        f"{run.name}: the training process failed (exit status {run.returncode}); "
        f"the end of its log ({run.log_path}):",
        file=sys.stderr,
    )
    try:
        with open(run.log_path) as f:
            print(f.read()[-3000:], file=sys.stderr)
    except OSError:
        pass
    return 1


if __name__ == "__main__":
    sys.exit(main())
