"""The child process of the crash-consistency tests: train, checkpoint, get killed.

It restores the newest committed checkpoint (if any), records what it loaded, then trains a
small model and checkpoints every step to a local tier and an S3 tier. It logs, fsync'd:

``intent STEP HASH``   just before ``save()`` — the hash of exactly the state being saved
``commit STEP``        after ``h.wait()`` returned (committed on every tier)
``failed STEP ERROR``  after ``h.wait()`` raised

The crash hooks live here, never in the library: ``TIERCKPT_CRASH_AT=POINT:N`` wraps a library
function and, on its N-th hit, either sends this process SIGKILL
(``TIERCKPT_CRASH_MODE=kill``, the default) or writes ``<result>.paused`` and sleeps so the
parent kills it (``pause``). Points:

capture            after the N-th chunk copied into the host arena (mid-capture)
local_write        after the N-th pwrite into a local shard file (mid-write)
local_commit       before a finished local shard's fsync + rename
local_manifest     before the local manifest put (data durable, no manifest)
local_link         inside the local manifest put: temp file written, not linked
local_linked       inside the local manifest put: linked, temp not yet removed
s3_part            before the N-th S3 UploadPart (mid-upload, an open multipart upload)
s3_complete        before CompleteMultipartUpload
s3_manifest        before the S3 manifest put (data complete, no manifest)
after_commit       right after the S3 manifest put (committed, not yet logged)
gc_manifest        after retention deleted a manifest, before the data
gc_data            after retention deleted a data object

Run: ``python crash_child.py --local DIR --endpoint URL --bucket B --log LOG --result RES``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from rel_util import state_hash

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.backends import local as local_mod
from tierckpt.backends import s3 as s3_mod

POINTS = (
    "capture",
    "local_write",
    "local_commit",
    "local_manifest",
    "local_link",
    "local_linked",
    "s3_part",
    "s3_complete",
    "s3_manifest",
    "after_commit",
    "gc_manifest",
    "gc_data",
)


def _event(path: str, **fields: Any) -> None:
    _append(path, json.dumps({**fields, "at": time.time()}))


def _append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


class CrashHook:
    def __init__(self, point: str, nth: int, mode: str, paused_file: str) -> None:
        if point not in POINTS:
            raise SystemExit(f"unknown crash point {point!r}")
        self.point = point
        self.nth = nth
        self.mode = mode
        self.paused_file = paused_file
        self._count = itertools.count(1)
        #: set once the restore is done: a kill inside load() (its copy of a checkpoint onto
        #: the local tier passes the same points) would leave the parent no restore to check
        self.armed = False

    def hit(self, point: str) -> None:
        if not self.armed or point != self.point or next(self._count) != self.nth:
            return
        if self.mode == "pause":
            _append(self.paused_file, point)
            time.sleep(120)  # the parent kills us now
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)


def install(hook: CrashHook) -> None:
    """Wrap library functions so the hook fires at its named point (this process only)."""
    import tierckpt.pipeline._capture as pipeline_mod  # where the capture loop calls it

    real_copy = pipeline_mod.copy_chunk

    def copy_chunk(*a: Any, **k: Any) -> Any:
        out = real_copy(*a, **k)
        hook.hit("capture")
        return out

    pipeline_mod.copy_chunk = copy_chunk  # type: ignore[assignment]

    writer = local_mod._LocalWriter
    real_write, real_commit = writer.write, writer.commit

    def write(self: Any, offset: int, data: Any) -> None:
        real_write(self, offset, data)
        hook.hit("local_write")

    def commit(self: Any) -> None:
        hook.hit("local_commit")
        real_commit(self)

    writer.write = write  # type: ignore[method-assign]
    writer.commit = commit  # type: ignore[method-assign]

    lb = local_mod.LocalBackend
    real_lput, real_ldel = lb.put_atomic, lb.delete

    def lput(self: Any, name: str, data: Any, *, overwrite: bool = False) -> None:
        if name.startswith("manifests/"):
            hook.hit("local_manifest")
        real_lput(self, name, data, overwrite=overwrite)

    def ldel(self: Any, name: str) -> None:
        real_ldel(self, name)
        hook.hit("gc_manifest" if name.startswith("manifests/") else "gc_data")

    lb.put_atomic = lput  # type: ignore[method-assign]
    lb.delete = ldel  # type: ignore[method-assign]

    real_link = os.link

    def link(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        hook.hit("local_link")
        real_link(src, dst, *a, **k)
        hook.hit("local_linked")

    os.link = link  # type: ignore[assignment]

    sb = s3_mod.S3Backend
    real_call, real_sput, real_sdel = sb._call, sb.put_atomic, sb.delete

    def call(self: Any, op: str, key: str, **kw: Any) -> Any:
        if op == "upload_part":
            hook.hit("s3_part")
        elif op == "complete_multipart_upload":
            hook.hit("s3_complete")
        return real_call(self, op, key, **kw)

    def sput(self: Any, name: str, data: Any, *, overwrite: bool = False) -> None:
        if name.startswith("manifests/"):
            hook.hit("s3_manifest")
        real_sput(self, name, data, overwrite=overwrite)
        if name.startswith("manifests/"):
            hook.hit("after_commit")

    def sdel(self: Any, name: str) -> None:
        real_sdel(self, name)
        hook.hit("gc_manifest" if name.startswith("manifests/") else "gc_data")

    sb._call = call  # type: ignore[method-assign]
    sb.put_atomic = sput  # type: ignore[method-assign]
    sb.delete = sdel  # type: ignore[method-assign]

    # the same points on the obstore driver (TIERCKPT_S3_DRIVER=obstore): a part is handed to
    # obstore when a write takes the object past a part boundary; the completion is commit()
    from tierckpt.backends.objstore import _backend as obs_mod
    from tierckpt.backends.objstore import _writer as obs_writer_mod

    ow = obs_writer_mod._Writer
    real_owrite, real_ocommit = ow.write, ow.commit

    def owrite(self: Any, offset: int, data: Any) -> None:
        before = self.size
        real_owrite(self, offset, data)
        if self.size // self._b.part_size > before // self._b.part_size:
            hook.hit("s3_part")

    def ocommit(self: Any) -> None:
        hook.hit("s3_complete")
        real_ocommit(self)

    ow.write = owrite  # type: ignore[method-assign]
    ow.commit = ocommit  # type: ignore[method-assign]
    ob = obs_mod.ObjectStoreBackend
    real_oput, real_odel = ob.put_atomic, ob.delete

    def oput(self: Any, name: str, data: Any, *, overwrite: bool = False) -> None:
        if name.startswith("manifests/"):
            hook.hit("s3_manifest")
        real_oput(self, name, data, overwrite=overwrite)
        if name.startswith("manifests/"):
            hook.hit("after_commit")

    def odel(self: Any, name: str) -> None:
        real_odel(self, name)
        hook.hit("gc_manifest" if name.startswith("manifests/") else "gc_data")

    ob.put_atomic = oput  # type: ignore[method-assign]
    ob.delete = odel  # type: ignore[method-assign]


# -- the training job ---------------------------------------------------------------------


def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 640), torch.nn.ReLU(), torch.nn.Linear(640, 512)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 512, generator=g), torch.randn(16, 512, generator=g)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def tiers(args: argparse.Namespace, *, s3_only: bool = False) -> list[Any]:
    s3 = S3Tier(
        f"s3://{args.bucket}/run",
        endpoint_url=args.endpoint,
        keep_last=2,
        codec="zstd",
        part_size=5 << 20,
        max_attempts=3,
        connect_timeout=5,
        read_timeout=30,
    )
    return [s3] if s3_only else [LocalTier(args.local, keep_last=2), s3]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--local", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--verify-only", action="store_true")
    p.add_argument("--s3-only", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # bit-exact training across restarts
    spec = os.environ.get("TIERCKPT_CRASH_AT")
    if spec:
        point, _, nth = spec.partition(":")
        mode = os.environ.get("TIERCKPT_CRASH_MODE", "kill")
        hook: CrashHook | None = CrashHook(point, int(nth or 1), mode, args.result + ".paused")
        install(hook)
    else:
        hook = None

    model, opt = make_model()
    ck = Checkpointer(
        tiers(args, s3_only=args.s3_only),
        chunk_bytes=1 << 20,
        host_buffer_bytes=8 << 20,
        repopulate=not args.s3_only,
    )
    start = 0
    if ck.steps():
        try:
            t0 = time.perf_counter()
            loaded = ck.load()
        except Exception as exc:  # the parent fails the trial on this
            _event(args.result, event="load_error", error=repr(exc))
            return 3
        start = int(loaded["step"])
        _event(
            args.result,
            event="loaded",
            step=start,
            hash=state_hash(loaded),
            seconds=time.perf_counter() - t0,
            tier_steps=ck.tier_steps(),
        )
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
    else:
        _event(args.result, event="empty")
    if args.verify_only:
        ck.close()
        return 0
    _event(args.result, event="ready")
    if hook is not None:
        hook.armed = True
    ck.guard(opt)  # optimizer.step() waits for the capture of the pending save
    handle = None
    for step in range(start + 1, start + 1 + args.saves):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # overlaps the pending save
        if handle is not None:
            _wait_and_log(args.log, handle)
        opt.step()
        state = snapshot(model, opt, step)
        _append(args.log, f"intent {step} {state_hash(state)}")
        handle = ck.save(state, step)
    if handle is not None:
        _wait_and_log(args.log, handle)
    ck.close()
    _event(args.result, event="done")
    return 0


def _wait_and_log(log: str, handle: Any) -> None:
    try:
        handle.wait(timeout=120)
    except Exception as exc:
        _append(log, f"failed {handle.step} {exc!r}".replace("\n", " "))
        return
    _append(log, f"commit {handle.step}")


def zygote() -> None:
    """Fork children from this warm process (torch already imported): a trial then costs a
    fork instead of an interpreter start. Protocol on stdin/stdout, one JSON line each way:
    ``{"argv": [...], "env": {...}, "stderr": PATH}`` -> ``{"pid": N}``; later
    ``{"kill": N}`` (SIGKILL, unless it already ended) and, when it ends,
    ``{"pid": N, "exitcode": C}`` (-9: killed). Only this process reaps its children, so a
    kill can never reach a reused pid."""
    import threading

    torch.set_num_threads(1)
    lock = threading.Lock()
    running: set[int] = set()

    def reap(pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        with lock:
            running.discard(pid)
            print(
                json.dumps({"pid": pid, "exitcode": os.waitstatus_to_exitcode(status)}), flush=True
            )

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "kill" in cmd:
            with lock:
                if cmd["kill"] in running:
                    os.kill(cmd["kill"], signal.SIGKILL)
            continue
        pid = os.fork()
        if pid == 0:  # the child: a fresh process that never ran a checkpointer
            code = 70
            try:
                os.environ.update(cmd["env"])
                err = os.open(cmd["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(err, 2)
                null = os.open(os.devnull, os.O_RDWR)
                os.dup2(null, 0)
                os.dup2(null, 1)
                code = main(cmd["argv"])
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        with lock:
            running.add(pid)
            print(json.dumps({"pid": pid}), flush=True)
        threading.Thread(target=reap, args=(pid,), daemon=True).start()


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        sys.exit(main())
