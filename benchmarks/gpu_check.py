"""GPU check: tierckpt's blocking time on a large GPU-resident state, in one short run.

On a machine with an NVIDIA GPU (sized for an H200; about 5 minutes, hard budget 8):

    python benchmarks/gpu_check.py --json gpu_check.json        # or $OUT/gpu_check.json

1. Builds a >= 20 GB training-like state on the GPU: bf16 weights and fp32 moments of mixed
   sizes, including ``--small-tensors`` small ones.
2. Measures device-to-host bandwidth into pinned memory (and pageable, for reference).
3. Saves with tierckpt (pinned arena; RAM tier by default, so the disk does not set the pace):
   *immediate* (``save()`` then ``wait_captured()`` at once) and *lazy* (``save()``, then
   ``--compute-s`` of bf16 matmuls on the GPU standing in for forward/backward, then
   ``wait_captured()``; blocked = time in ``save()`` + time in ``wait_captured()``). Once
   with an arena that holds the whole state and once with the library's default arena.
4. Perceived throughput = state bytes / blocked time, against ``torch.save`` (+ fsync) of a
   smaller part of the state as the baseline.

Prints a table and writes JSON. Every phase is guarded: one that fails or runs past the
budget is recorded as such and the rest still runs. ``--allow-cpu`` runs the same flow on a
small CPU state, to check the script on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

GB = 10**9
GiB = 1 << 30
MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="tierckpt GPU check (blocking time, throughput)")
    p.add_argument("--size-gb", type=float, default=20.0, help="state size, GB (default 20)")
    p.add_argument(
        "--small-tensors",
        type=int,
        default=1200,
        help="number of small tensors (< 32 KiB) in the state (default 1200)",
    )
    p.add_argument("--runs", type=int, default=3, help="measured saves per case (default 3)")
    p.add_argument(
        "--compute-s",
        type=float,
        default=1.0,
        help="simulated forward/backward on the GPU in the lazy case (default 1 s)",
    )
    p.add_argument(
        "--arenas",
        default="fit,default",
        help="arenas to try: 'fit' (holds the state), 'default', or GiB numbers",
    )
    p.add_argument(
        "--tier",
        choices=("memory", "local"),
        default="memory",
        help="tier to save to (default memory: the disk does not set the pace)",
    )
    p.add_argument(
        "--baseline-gb",
        type=float,
        default=2.0,
        help="size of the torch.save baseline's state, GB (default 2)",
    )
    p.add_argument("--dir", default=None, help="folder for files (default: a temp folder)")
    p.add_argument(
        "--json",
        default=None,
        help="output JSON (default $OUT/gpu_check.json, else ./gpu_check.json)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=450.0,
        help="skip phases that would start after this many seconds (default 450)",
    )
    p.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run the flow on a small CPU state (a smoke test)",
    )
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.runs < 1 or a.size_gb <= 0 or a.baseline_gb <= 0 or a.small_tensors < 0:
        p.error("runs, sizes and --small-tensors must be positive")
    return a


# -- state ------------------------------------------------------------------------------------


def build_state(
    size_bytes: int, n_small: int, device: torch.device, seed: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """bf16 weights + fp32 moments (6 bytes per parameter), filled on the device."""
    from tierckpt.bench import param_sizes

    sizes = param_sizes(size_bytes / GiB, seed, n_small=max(1, n_small // 2))
    gen = torch.Generator(device=device).manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for i, n in enumerate(sizes):
        name = f"layers.{i // 8}.p{i % 8}"
        model[name] = torch.empty(n, dtype=torch.bfloat16, device=device).normal_(generator=gen)
        moments[name] = {
            "exp_avg": torch.empty(n, dtype=torch.float32, device=device).normal_(generator=gen)
        }
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tensors = list(model.values()) + [m["exp_avg"] for m in moments.values()]
    info = {
        "bytes": sum(t.nbytes for t in tensors),
        "tensors": len(tensors),
        "small_tensors": sum(1 for t in tensors if t.nbytes < 32 << 10),
        "largest_bytes": max(t.nbytes for t in tensors),
    }
    state = {"model": model, "optim": {"state": moments, "param_groups": [{"lr": 1e-4}]}, "step": 0}
    return state, info


def subset(state: dict[str, Any], nbytes: int) -> dict[str, Any]:
    """The first parameters of ``state`` (weights and moments) up to about ``nbytes``."""
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, Any] = {}
    total = 0
    for name, w in state["model"].items():
        if total >= nbytes:
            break
        m = state["optim"]["state"][name]
        model[name] = w
        moments[name] = m
        total += w.nbytes + m["exp_avg"].nbytes
    return {"model": model, "optim": {"state": moments}, "step": 0}


def _bytes_of(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(_bytes_of(v) for v in obj.values())
    return 0


# -- measurements -----------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_stats() -> dict[str, int]:
    """Pinned host memory held by torch's caching host allocator (CUDA builds), in bytes.

    That allocator rounds every request up to a power of two, so the arena does not use it
    (it page-locks exactly its own bytes with cudaHostRegister): recorded so the run shows
    that no pinned memory beyond the arena was taken.
    """
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return {}
    try:
        stats = fn()
    except Exception:
        return {}
    return {
        k: int(v)
        for k, v in stats.items()
        if "bytes" in k and (k.endswith(".current") or k.endswith(".peak"))
    }


def release_pinned() -> None:
    """Give cached pinned blocks back to the driver between phases (CUDA builds only)."""
    import gc

    gc.collect()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def d2h_bandwidth(device: torch.device, nbytes: int = 1 * GiB, reps: int = 8) -> dict[str, Any]:
    """Device-to-host copy bandwidth of one large tensor: pinned, and pageable for reference."""
    if device.type != "cuda":
        return {"skipped": "no CUDA device"}
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    out: dict[str, Any] = {"bytes": nbytes}
    for kind in ("pinned", "pageable"):
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
        dst.fill_(0)  # touch every page before timing
        times = []
        for _ in range(reps if kind == "pinned" else 3):
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=(kind == "pinned"))
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[f"{kind}_gbps"] = nbytes / statistics.median(times) / GB
        del dst
    del src
    torch.cuda.empty_cache()
    release_pinned()
    return out


def make_compute(device: torch.device, seconds: float) -> tuple[Callable[[], float], float]:
    """A stand-in for forward/backward: bf16 matmuls for about ``seconds`` on the device.

    Returns (run, seconds one run took alone); ``run()`` launches the work, waits for it like
    a training step does, and returns its wall time.
    """
    if device.type != "cuda":

        def run_cpu() -> float:
            t0 = time.perf_counter()
            time.sleep(seconds)
            return time.perf_counter() - t0

        return run_cpu, seconds
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    _sync(device)
    per = (time.perf_counter() - t0) / 20
    n = max(1, round(seconds / per))

    def run() -> float:
        t = time.perf_counter()
        for _ in range(n):
            a @ b
        # only the training stream: a device-wide synchronize would also wait for capture's
        # side-stream copies and book a capture that overruns compute as compute
        torch.cuda.current_stream(device).synchronize()
        return time.perf_counter() - t

    alone = statistics.median(run() for _ in range(2))
    return run, alone


def tierckpt_phase(
    state: dict[str, Any],
    info: dict[str, Any],
    arena: str,
    args: argparse.Namespace,
    device: torch.device,
    compute: Callable[[], float],
    workdir: str,
) -> dict[str, Any]:
    """Warm-up, then ``runs`` immediate and ``runs`` lazy saves with one Checkpointer."""
    from tierckpt import Checkpointer, LocalTier, MemoryTier
    from tierckpt.arena import default_host_buffer_bytes
    from tierckpt.backends.memory import MemoryBackend

    if arena == "fit":
        arena_bytes = (info["bytes"] // (64 * MiB) + 2) * 64 * MiB
    elif arena == "default":
        arena_bytes = default_host_buffer_bytes()
    else:
        arena_bytes = int(float(arena) * GiB) // 4096 * 4096
    namespace = f"gpu-check-{arena}-{os.getpid()}"
    tier = (
        MemoryTier(namespace=namespace, keep_last=1)
        if args.tier == "memory"
        else LocalTier(os.path.join(workdir, f"tier-{arena}"), keep_last=1)
    )
    ck = Checkpointer([tier], host_buffer_bytes=arena_bytes)
    rows: list[dict[str, float]] = []
    step = 0
    try:
        t0 = time.perf_counter()
        ck.save(state, step).wait()
        warm = time.perf_counter() - t0
        step += 1
        pinned_after_warmup = pinned_stats()
        for _ in range(args.runs):
            _sync(device)
            t0 = time.perf_counter()
            h = ck.save(state, step)
            t1 = time.perf_counter()
            ck.wait_captured()
            t2 = time.perf_counter()
            h.wait()
            t3 = time.perf_counter()
            rows.append(
                {"case": 0.0, "save_s": t1 - t0, "blocked_s": t2 - t0, "committed_s": t3 - t0}
            )
            step += 1
            _sync(device)
            t0 = time.perf_counter()
            h = ck.save(state, step)
            t1 = time.perf_counter()
            compute_s = compute()  # kernels queued after save(): capture overlaps them
            t2 = time.perf_counter()
            ck.wait_captured()
            t3 = time.perf_counter()
            captured_at = (h.captured_at or t3) - t0
            h.wait()
            t4 = time.perf_counter()
            rows.append(
                {
                    "case": 1.0,
                    "save_s": t1 - t0,
                    "compute_s": compute_s,
                    "wait_s": t3 - t2,
                    "blocked_s": (t1 - t0) + (t3 - t2),
                    "captured_at_s": captured_at,
                    "committed_s": t4 - t0,
                }
            )
            step += 1
        p = ck._pipeline
        pinned = bool(p is not None and p.arena is not None and p.arena.pinned)
        arena_alloc = p.arena.alloc_seconds if p is not None and p.arena is not None else None
    finally:
        ck.close()
        if args.tier == "memory":
            MemoryBackend.clear_namespace(namespace)
        del ck
        release_pinned()

    def med(case: float, key: str) -> float | None:
        xs = [r[key] for r in rows if r["case"] == case and key in r]
        return statistics.median(xs) if xs else None

    nbytes = info["bytes"]
    imm, lazy = med(0.0, "blocked_s"), med(1.0, "blocked_s")
    return {
        "arena": arena,
        "arena_bytes": arena_bytes,
        "arena_pinned": pinned,
        "arena_alloc_s": arena_alloc,
        "warmup_s": warm,
        "tier": args.tier,
        "pinned_after_warmup": pinned_after_warmup,
        "immediate_blocked_s": imm,
        "immediate_save_s": med(0.0, "save_s"),
        "immediate_committed_s": med(0.0, "committed_s"),
        "lazy_blocked_s": lazy,
        "lazy_save_s": med(1.0, "save_s"),
        "lazy_wait_s": med(1.0, "wait_s"),
        "lazy_compute_s": med(1.0, "compute_s"),
        "lazy_captured_at_s": med(1.0, "captured_at_s"),
        "immediate_gbps": nbytes / imm / GB if imm else None,
        "perceived_lazy_gbps": nbytes / lazy / GB if lazy else None,
        "runs": rows,
    }


def torch_save_phase(
    state: dict[str, Any], args: argparse.Namespace, device: torch.device, workdir: str
) -> dict[str, Any]:
    """torch.save (+ fsync) of a smaller part of the state, from the device."""
    part = subset(state, int(args.baseline_gb * GB))
    nbytes = _bytes_of(part)
    path = os.path.join(workdir, "baseline.pt")
    times = []
    for _ in range(2):
        _sync(device)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(part, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    blocked = min(times)
    return {"bytes": nbytes, "blocked_s": blocked, "all_s": times, "gbps": nbytes / blocked / GB}


# -- report -----------------------------------------------------------------------------------


def _fmt(x: float | None, unit: str = "s") -> str:
    if x is None:
        return "-"
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"
    return f"{x:.1f} {unit}"


def report(result: dict[str, Any]) -> str:
    st = result.get("state") or {}
    lines = [
        f"GPU check on {result['device']}: state {st.get('bytes', 0) / GB:.1f} GB in "
        f"{st.get('tensors', 0):,} tensors ({st.get('small_tensors', 0):,} small)",
        "",
    ]
    bw = result.get("d2h") or {}
    if "pinned_gbps" in bw:
        lines.append(
            f"device-to-host: pinned {bw['pinned_gbps']:.1f} GB/s, pageable "
            f"{bw['pageable_gbps']:.1f} GB/s ({bw['bytes'] / GiB:.0f} GiB copies)"
        )
        lines.append("")
    lines.append(
        "| saver | arena | immediate blocked | lazy blocked (save + wait) | lazy compute "
        "| perceived GB/s (lazy) | vs torch.save | committed |"
    )
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|")
    base = result.get("torch_save") or {}
    base_gbps = base.get("gbps")
    for r in result.get("tierckpt", []):
        if "error" in r:
            lines.append(f"| tierckpt | {r.get('arena')} | failed: {r['error']} | | | | | |")
            continue
        ratio = (
            r["perceived_lazy_gbps"] / base_gbps if base_gbps and r["perceived_lazy_gbps"] else None
        )
        lines.append(
            f"| tierckpt | {r['arena']} {r['arena_bytes'] / GiB:.1f} GiB"
            f"{' pinned' if r['arena_pinned'] else ''} | {_fmt(r['immediate_blocked_s'])} | "
            f"{_fmt(r['lazy_blocked_s'])} ({_fmt(r['lazy_save_s'])} + {_fmt(r['lazy_wait_s'])}) | "
            f"{_fmt(r['lazy_compute_s'])} (alone {_fmt(result.get('compute_alone_s'))}) | "
            f"{_fmt(r['perceived_lazy_gbps'], 'GB/s')} | "
            f"{'-' if ratio is None else f'{ratio:.0f}x'} | {_fmt(r['immediate_committed_s'])} |"
        )
    if "blocked_s" in base:
        lines.append(
            f"| torch.save + fsync ({base['bytes'] / GB:.1f} GB) | - | "
            f"{_fmt(base['blocked_s'])} | {_fmt(base['blocked_s'])} | - | "
            f"{_fmt(base['gbps'], 'GB/s')} | 1x | {_fmt(base['blocked_s'])} |"
        )
    for r in result.get("tierckpt", []):
        pinned = r.get("pinned_after_warmup") or {}
        if pinned:
            desc = ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in sorted(pinned.items()))
            lines.append(f"\narena {r['arena']} ({r['arena_bytes'] / GiB:.1f} GiB): pinned {desc}")
    for phase, err in result.get("errors", {}).items():
        lines.append(f"\n{phase}: {err}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        size = int(args.size_gb * GB)
    elif args.allow_cpu:
        device = torch.device("cpu")
        size = int(min(args.size_gb, 0.25) * GB)
        args.baseline_gb = min(args.baseline_gb, 0.05)
    else:
        print("gpu_check: no CUDA device (pass --allow-cpu for a CPU smoke test)", file=sys.stderr)
        return 2
    out_json = args.json or os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/gpu_check.py", *(argv or sys.argv[1:])]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "errors": {},
        "tierckpt": [],
    }
    workdir = tempfile.mkdtemp(prefix="tierckpt-gpu-check-", dir=args.dir)

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        if time.perf_counter() - started > args.budget_s:
            result["errors"][name] = f"skipped: past the {args.budget_s:.0f} s budget"
            return None
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            return None
        print(
            f"[{time.perf_counter() - started:6.1f} s] {name}: {time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        return value

    try:
        built = phase(
            "build state", lambda: build_state(size, args.small_tensors, device, args.seed)
        )
        if built is None:
            raise RuntimeError(result["errors"].get("build state", "no state"))
        state, info = built
        result["state"] = info
        result["d2h"] = phase("d2h bandwidth", lambda: d2h_bandwidth(device))
        comp = phase("calibrate compute", lambda: make_compute(device, args.compute_s))

        def no_compute() -> float:
            return 0.0

        compute, result["compute_alone_s"] = comp if comp else (no_compute, None)
        for arena in [a.strip() for a in args.arenas.split(",") if a.strip()]:

            def run_arena(arena: str = arena) -> dict[str, Any]:
                return tierckpt_phase(state, info, arena, args, device, compute, workdir)

            r = phase(f"tierckpt arena={arena}", run_arena)
            result["tierckpt"].append(
                r
                if r is not None
                else {"arena": arena, "error": result["errors"].get(f"tierckpt arena={arena}")}
            )
        result["torch_save"] = phase(
            "torch.save baseline", lambda: torch_save_phase(state, args, device, workdir)
        )
    except Exception as exc:
        result["errors"]["fatal"] = f"{type(exc).__name__}: {exc}"
    finally:
        result["elapsed_s"] = time.perf_counter() - started
        os.makedirs(os.path.dirname(os.path.abspath(out_json)), exist_ok=True)
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    print(report(result))
    print(f"wrote {out_json}", file=sys.stderr)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
