"""A training job run the way long jobs are run: killed, restarted, rolled back, its node's
folder lost, its S3 store failing and hanging, and checked after every restart.

The parent starts an S3 server (moto, in this process) behind a fault proxy and runs the job
(``--child``) again and again. Each child resumes with ``load()`` (or, now and then, rolls back
to an older step it lists and trains on from there), saves every step to a local folder
(``keep_last=3``) and S3 (``keep_last=4``), and logs to a JSON-lines file what it saves (the
step and the SHA-256 of the state at ``save()``) and each commit its callback reports. The
parent meanwhile makes S3 fail (errors, resets, a hang of a few seconds) and ends the child at a
random moment (SIGKILL, or SIGTERM); before some restarts it deletes the local folder (a
replaced node). Checked at every restart, from the log:

* the state ``load()`` returns is byte for byte one the job saved at that step;
* it is not older than the newest commit a callback reported (on a tier whose copy still
  exists: after the local folder was deleted, S3's), so nothing committed was lost;
* the child raised nothing into its training loop (a ``WriterConflict``, a ``BackendError``).

    python benchmarks/chaos.py --rounds 30 --seed 1

Exits 1 on the first broken rule, printing the log lines that show it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch


def _sha(state: dict[str, Any]) -> str:
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(state)
    return h.hexdigest()


def _log(path: Path, **rec: Any) -> None:
    line = (json.dumps(rec) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)  # one write of an appended line: whole or absent after a kill
    finally:
        os.close(fd)


# -- the job ---------------------------------------------------------------------------------
def child(root: Path, endpoint: str, bucket: str, log: Path, rollback: bool, seed: int) -> int:
    import tierckpt
    from tierckpt import Checkpointer, LocalTier, S3Tier
    from tierckpt.errors import CheckpointNotFound

    pid = os.getpid()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tiers = [
        LocalTier(root / "nvme", keep_last=3),
        S3Tier(
            f"s3://{bucket}/run",
            endpoint_url=endpoint,
            keep_last=4,
            connect_timeout=1,
            read_timeout=2,
            max_attempts=2,
        ),
    ]
    ck = Checkpointer(tiers, save_deadline=3.0)
    ck.guard(opt, model)
    step = 0
    try:
        if rollback:
            steps = ck.steps()
            older = [s for s in steps if s < max(steps, default=0)]
            target = random.Random(seed).choice(older) if older else None
            st = ck.load(step=target) if target is not None else ck.load()
        else:
            st = ck.load()
    except CheckpointNotFound:
        st = None
    if st is not None:
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        step = int(st["step"])
        loaded = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        _log(log, ev="loaded", pid=pid, step=step, sha=_sha(loaded), rollback=rollback)
    else:
        _log(log, ev="loaded", pid=pid, step=None, sha=None, rollback=rollback)

    def committed(r: tierckpt.TierResult) -> None:
        _log(log, ev="committed", pid=pid, step=r.step, timeline=r.timeline, tier=r.tier)

    ck.add_callback(committed)
    _log(log, ev="training", pid=pid)
    while True:
        step += 1
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 64, generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        _log(log, ev="saving", pid=pid, step=step, sha=_sha(state))
        ck.save(state, step)
        time.sleep(0.02)


# -- the checks ------------------------------------------------------------------------------
def _records(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def check_load(recs: list[dict[str, Any]]) -> str | None:
    """The last record must be a child's ``loaded``: judge it against what came before."""
    loaded = recs[-1]
    before = recs[:-1]
    wiped_at = max((i for i, r in enumerate(before) if r["ev"] == "wiped"), default=-1)
    # the newest reported commit on a copy that still exists
    last: int | None = None
    for i, r in enumerate(before):
        if r["ev"] != "committed" or (r["tier"] == "local" and i < wiped_at):
            continue
        saving = [
            j
            for j, s in enumerate(before[:i])
            if s["ev"] == "saving" and s["pid"] == r["pid"] and s["step"] == r["step"]
        ]
        if saving:
            last = max(last or -1, saving[-1])
    if loaded["rollback"]:
        return None  # a rollback loads an older step on purpose; its content is checked below
    if loaded["step"] is None:
        return None if last is None else f"nothing loaded, but record {last} was committed"
    candidates = [
        j
        for j, s in enumerate(before)
        if s["ev"] == "saving" and s["step"] == loaded["step"] and s["sha"] == loaded["sha"]
    ]
    if not candidates:
        return f"loaded step {loaded['step']} is no state the job saved at that step"
    if last is not None and max(candidates) < last:
        return (
            f"loaded step {loaded['step']} (saved at record {max(candidates)}) is older than "
            f"the newest reported commit (saved at record {last})"
        )
    return None


def check_rollback_content(recs: list[dict[str, Any]]) -> str | None:
    loaded = recs[-1]
    if not loaded["rollback"] or loaded["step"] is None:
        return None
    if any(
        s["ev"] == "saving" and s["step"] == loaded["step"] and s["sha"] == loaded["sha"]
        for s in recs[:-1]
    ):
        return None
    return f"rolled back to step {loaded['step']}: no state the job saved at that step"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default=None, help="work folder (default: a fresh temporary one)")
    ap.add_argument("--child", nargs=5, metavar=("ROOT", "ENDPOINT", "BUCKET", "LOG", "MODE"))
    args = ap.parse_args(argv)
    if args.child:
        root, endpoint, bucket, log, mode = args.child
        return child(Path(root), endpoint, bucket, Path(log), mode == "rollback", args.seed)

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    from tierckpt.testing.faultproxy import Fault, FaultProxy
    from tierckpt.testing.s3servers import start_moto

    rng = random.Random(args.seed)
    root = Path(args.dir or tempfile.mkdtemp(prefix="tierckpt-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    log = root / "log.jsonl"
    log.unlink(missing_ok=True)
    shutil.rmtree(root / "nvme", ignore_errors=True)
    srv = start_moto()
    bucket = f"chaos-{uuid.uuid4().hex[:12]}"  # moto's buckets outlive a server in a process
    boto3.client("s3", endpoint_url=srv.endpoint_url).create_bucket(Bucket=bucket)
    faults = [
        [Fault("error500", probability=0.3)],
        [Fault("reset_response", probability=0.2)],
        [Fault("stall", seconds=4)],
        [Fault("slowdown", probability=0.5)],
    ]
    problems: list[str] = []
    stats = {"killed": 0, "terminated": 0, "wiped": 0, "rollbacks": 0, "loads": 0}
    with FaultProxy(srv.endpoint_url, timeout=30) as proxy:
        for rnd in range(args.rounds + 1):
            final = rnd == args.rounds
            proxy.set_faults([])
            if not final and rnd and rng.random() < 0.15:
                shutil.rmtree(root / "nvme", ignore_errors=True)
                _log(log, ev="wiped")
                stats["wiped"] += 1
            mode = "rollback" if (not final and rnd and rng.random() < 0.2) else "resume"
            stats["rollbacks"] += mode == "rollback"
            cmd = [sys.executable, __file__, "--seed", str(rng.randrange(1 << 30)), "--child"]
            cmd += [str(root), proxy.endpoint_url, bucket, str(log), mode]
            err = open(root / f"child-{rnd}.err", "w")  # noqa: SIM115 (closed below)
            p = subprocess.Popen(cmd, stderr=err)
            deadline = time.monotonic() + 120
            while not any(r["ev"] == "loaded" and r["pid"] == p.pid for r in _records(log)):
                if p.poll() is not None or time.monotonic() > deadline:
                    problems.append(f"round {rnd}: the job ended or hung before loading")
                    break
                time.sleep(0.05)
            if problems:
                break
            recs = [
                r for r in _records(log) if not (r["ev"] == "loaded" and r["pid"] != p.pid)
            ] or []
            upto = next(i for i, r in enumerate(recs) if r["ev"] == "loaded" and r["pid"] == p.pid)
            stats["loads"] += 1
            why = check_load(recs[: upto + 1]) or check_rollback_content(recs[: upto + 1])
            if why:
                problems.append(f"round {rnd} ({mode}): {why}")
                p.kill()
                break
            if final:
                p.kill()
                p.wait()
                break
            run_s = rng.uniform(1.0, 6.0)
            t_fault = rng.uniform(0.0, run_s)
            t0 = time.monotonic()
            faulted = False
            while time.monotonic() - t0 < run_s:
                if p.poll() is not None:
                    problems.append(f"round {rnd}: the job died on its own (rc {p.returncode})")
                    break
                if not faulted and time.monotonic() - t0 > t_fault and rng.random() < 0.7:
                    proxy.set_faults(rng.choice(faults))
                    faulted = True
                time.sleep(0.05)
            if problems:
                break
            if rng.random() < 0.25:
                p.send_signal(signal.SIGTERM)
                stats["terminated"] += 1
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    problems.append(f"round {rnd}: SIGTERM did not end the job in 30 s")
                    p.kill()
            else:
                p.kill()
                stats["killed"] += 1
            p.wait()
            err.close()
            text = (root / f"child-{rnd}.err").read_text()
            if "Traceback" in text:  # a kill leaves none: something raised in the job
                problems.append(f"round {rnd}: the job raised:\n{text[-3000:]}")
                break
            print(f"round {rnd}: {mode}, ran {run_s:.1f} s", flush=True)
    srv.stop()
    print(json.dumps(stats))
    if problems:
        print("BROKEN:", *problems, sep="\n")
        print(f"log: {log}")
        return 1
    print(f"all {stats['loads']} loads held (log: {log})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
