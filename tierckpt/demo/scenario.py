"""``tierckpt demo``: train, crash, restart from node RAM, lose the node, restore from S3
elsewhere, continue bit for bit.

What it does, on this machine, with nothing to configure:

1. starts an S3 server (moto) on 127.0.0.1 in this process, so it outlives the children;
2. **reference**: a child process trains a small GPT on bytes for ``--steps`` steps,
   checkpointing the classic way (a blocking ``torch.save`` every ``--every`` steps);
3. **node 1**: a child trains the same run with tierckpt (``NodeRamTier -> LocalTier ->
   S3Tier``, default codec policy; node RAM is a folder in ``/dev/shm``) and is killed with
   SIGKILL at ``--crash-at`` (a crashed process);
4. **node 1, restarted** (as torchrun would): a new process restores from the node's RAM,
   reading nothing from the disk or S3 (counted), trains on, and at ``--kill-at`` the whole
   node is lost: the process is killed and its RAM and disk folders are removed;
5. **node 2**: a fresh child with empty RAM and disk folders restores the newest checkpoint
   committed on S3 and trains to the end;
6. checks that every child's losses equal the reference's bit for bit (and the final states'
   sha256), then prints tables: training time blocked per checkpoint against ``torch.save``,
   bytes written per tier, and per failure the tier the restore read and its time.

Each child after the first tierckpt one is started while its predecessor still trains and
waits (``--wait-go``) before it opens a tier, so Python's and torch's start-up is not on the
demo's clock. Exits 1 if the continuation is not bit-identical. The training itself is in
:mod:`tierckpt.demo.train`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from tierckpt.demo._child import BUCKET, ChildRun, _on_s3, _on_tier, run_child, start_child
from tierckpt.demo._report import _first_mismatch, report

__all__ = ["main"]


# -- the demo -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tierckpt demo",
        description="Train a small GPT with checkpoints through node RAM -> local disk -> S3 "
        "(moto on 127.0.0.1), kill -9 the trainer (a crash: it restarts from node RAM), then "
        "lose the node (a new node restores from S3) and check the loss continues bit for bit.",
    )
    p.add_argument("--steps", type=int, default=240, help="training steps (default 240)")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (default 10)")
    p.add_argument(
        "--crash-at",
        type=int,
        default=None,
        help="SIGKILL node 1's process after this step, then restart it on the same node "
        "(default: about a third of the way)",
    )
    p.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="lose node 1 (SIGKILL, RAM and disk wiped) after this step (default: a bit past "
        "the middle)",
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
    p.add_argument(
        "--shm",
        default=None,
        help="folder for the nodes' RAM tiers (default: a temp dir in /dev/shm)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folders afterwards")
    p.add_argument("--break-rng", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.every, args.dim, args.layers = 40, 5, 64, 2
    if args.steps < 2 * args.every or args.every < 1:
        p.error("--steps must cover at least two checkpoints (--every)")
    if args.kill_at is None:
        args.kill_at = args.steps * 11 // 20 + args.every // 3 + 1
    if args.crash_at is None:
        args.crash_at = max(args.every, args.steps * 3 // 10 + args.every // 3 + 1)
    if not args.every <= args.kill_at < args.steps:
        p.error(f"--kill-at must be in [{args.every}, {args.steps})")
    if not args.every <= args.crash_at < args.kill_at:
        p.error(f"--crash-at must be in [{args.every}, --kill-at={args.kill_at})")
    return args


def _node_ram_folder(args: argparse.Namespace, workdir: str) -> tuple[str, str]:
    """Where the nodes' RAM tiers live, and a note when it is not shared memory."""
    if args.shm:
        os.makedirs(args.shm, exist_ok=True)
        return args.shm, ""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return tempfile.mkdtemp(prefix="tierckpt-demo-", dir="/dev/shm"), ""
    return os.path.join(workdir, "shm"), " (no /dev/shm here: a disk folder stands in for it)"


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
    shm, shm_note = _node_ram_folder(args, workdir)
    paths["shm1"] = os.path.join(shm, "node1")
    paths["shm2"] = os.path.join(shm, "node2")
    server = start_moto()
    rc = 1
    try:
        rc = _demo(args, server, workdir, paths, t_start, shm_note)
        return rc
    finally:
        server.stop()
        if not args.keep and not args.shm:
            shutil.rmtree(shm, ignore_errors=True)  # the node's RAM: never left behind
        if rc == 0 and not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif rc != 0:
            print(f"work folder kept for inspection: {workdir}", file=sys.stderr)


def _demo(
    args: argparse.Namespace,
    server: Any,
    workdir: str,
    paths: dict[str, str],
    t_start: float,
    shm_note: str = "",
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
            # codec="auto" keeps what it measured per tier URL; the demo's URL is the same
            # every run but its server is new, so an earlier demo's measurements (or the
            # user's own folder) must not decide what this one stores
            "TIERCKPT_AUTO_STATE_DIR": os.path.join(workdir, "auto-state"),
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
    node1_tiers = ["--node-ram", paths["shm1"], "--local-dir", os.path.join(paths["node1"], "ckpt")]
    node2_tiers = ["--node-ram", paths["shm2"], "--local-dir", os.path.join(paths["node2"], "ckpt")]

    print(
        f"tierckpt demo: a {args.layers}-block GPT on bytes, {args.steps} steps, a checkpoint "
        f"every {args.every} steps; S3 (moto) at {server.endpoint_url}"
    )
    print("  1. reference run, blocking torch.save checkpoints")
    print(
        "  2. node 1: tierckpt through node RAM -> local disk -> S3; its process is killed "
        f"with SIGKILL after step {args.crash_at} (a crash){shm_note}"
    )
    print(
        "  3. node 1 restarted (as torchrun would): restores from the node's RAM, trains on; "
        f"after step {args.kill_at} the node is lost (SIGKILL, its RAM and disk wiped)"
    )
    print("  4. node 2: empty RAM and disk, restores from S3, trains to the end; losses compared\n")
    sys.stdout.flush()

    logs = {
        k: os.path.join(paths["logs"], f"{k}.log")
        for k in ("reference", "node1", "restart", "node2")
    }
    started: list[subprocess.Popen[str]] = []

    def start(argv: list[str], log: str, *, wait_go: bool = False) -> subprocess.Popen[str]:
        started.append(start_child(argv, env, log, wait_go=wait_go))
        return started[-1]

    try:
        ref = run_child(
            "1. reference (torch.save)",
            start(
                [*model, "--mode", "reference", "--baseline-dir", paths["baseline"]],
                logs["reference"],
            ),
            logs["reference"],
            total=args.steps,
        )
        if ref.returncode != 0 or ref.done is None:
            return _child_failed(ref)

        node1_proc = start([*model, *tiered, *node1_tiers], logs["node1"])
        restart_proc = start(
            [*model, *tiered, *node1_tiers, "--resume"], logs["restart"], wait_go=True
        )
        # the crash comes once node RAM holds the newest save before --crash-at (at once, on
        # any machine: it is the fastest tier), so that the restored step is the same
        crash_save = args.crash_at // args.every * args.every
        node1 = run_child(
            "2. node 1 (tierckpt, kill -9)",
            node1_proc,
            logs["node1"],
            total=args.steps,
            kill_when=lambda s, c: s >= args.crash_at and _on_tier(c, "noderam", crash_save),
        )
        if node1.killed_at is None:
            return _child_failed(node1)
        print(
            f"node 1's process killed with SIGKILL after step {node1.killed_at} (exit status "
            f"{node1.returncode}): a crash; its node RAM and disk are still there"
        )
        sys.stdout.flush()

        node2_proc = start(
            [*model, *tiered, *node2_tiers, "--resume"]
            + (["--no-rng-restore"] if args.break_rng else []),
            logs["node2"],
            wait_go=True,
        )
        # the node is lost once S3 has committed the newest save before --kill-at, so that
        # the story (and the restored step) is the same on a loaded machine as on a quiet one
        last_save = args.kill_at // args.every * args.every
        restart = run_child(
            "3. node 1 restarted (node RAM)",
            restart_proc,
            logs["restart"],
            total=args.steps,
            kill_when=lambda s, c: s >= args.kill_at and _on_s3(node1.commits + c, last_save),
        )
        if restart.killed_at is None or restart.restored is None:
            return _child_failed(restart)
        # the node is lost: its memory and its disk go with it
        shutil.rmtree(paths["shm1"], ignore_errors=True)
        shutil.rmtree(paths["node1"], ignore_errors=True)
        s3 = S3Backend(s3_url, client=admin)
        on_s3 = committed_steps(s3)
        print(
            f"node 1 lost after step {restart.killed_at} (its process killed with SIGKILL, "
            f"its RAM and disk folders removed); committed on S3: steps {on_s3 or 'none'}"
        )
        if not on_s3:
            print("no checkpoint reached S3 before the kill: raise --kill-at", file=sys.stderr)
            return 1
        rep = verify_checkpoint(s3, on_s3[-1])
        print(f"verified S3 step {on_s3[-1]}: {rep.chunks} chunk(s), every checksum ok, decoded\n")
        sys.stdout.flush()

        node2 = run_child(
            "4. node 2 (restore from S3)", node2_proc, logs["node2"], total=args.steps
        )
        if node2.returncode != 0 or node2.done is None or node2.restored is None:
            return _child_failed(node2)
    finally:
        for proc in started:  # a child started early and never let go, or left running
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    restored1 = int(restart.restored["step"])
    restored = int(node2.restored["step"])
    state_bytes = max((c["raw"] for c in node1.commits), default=0)
    print()
    print(report(ref, node1, restart, node2, state_bytes))
    print()
    ok = True
    checks = (
        ("node 1", node1, 1, max(node1.losses) + 1),
        ("restarted node 1", restart, restored1 + 1, max(restart.losses, default=0) + 1),
        ("node 2", node2, restored + 1, args.steps + 1),
    )
    for label, run, first, end in checks:
        bad = _first_mismatch(run.losses, ref.losses, range(first, end))
        if bad is not None:
            ok = False
            print(f"MISMATCH {label} vs reference at step {bad[0]}: {bad[1]!r} != {bad[2]!r}")
    assert ref.done is not None and node2.done is not None
    same_state = node2.done["digest"] == ref.done["digest"]
    if not same_state:
        ok = False
        print("MISMATCH: node 2's final state differs from the reference's")
    total = time.perf_counter() - t_start
    if ok:
        assert restart.killed_at is not None and node1.killed_at is not None
        print(
            f"Continuation is bit-identical: node 1's restarted process resumed at step "
            f"{restored1 + 1} from node RAM ({node1.killed_at - restored1} step(s) redone), "
            f"node 2 at step {restored + 1} from S3 (node 1 had reached {restart.killed_at}, "
            f"so {restart.killed_at - restored} step(s) were redone); their losses equal the "
            f"uninterrupted run's, as do node 1's {len(node1.losses)}; final state sha256 "
            f"{ref.done['digest'][:16]}... matches."
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
