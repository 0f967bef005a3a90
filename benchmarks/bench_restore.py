"""Restore side by side: tierckpt (boto3 and obstore S3 drivers; codec raw and auto) against
plain readers of the same bytes, from SeaweedFS on 127.0.0.1 (volumes on disk) and from a
local folder.

    python benchmarks/bench_restore.py                  # ~1 GiB, warm-up round + median of 5
    python benchmarks/bench_restore.py --quick          # ~64 MiB, in-process, median of 3
    python benchmarks/bench_restore.py --json out.json --runs 7
    python benchmarks/bench_restore.py --gib 0.25 --only obstore-get,tierckpt-obstore-raw \
        --before /path/to/old/checkout          # also each tierckpt row with the old code

Setup (once): the synthetic training state of :func:`tierckpt.bench.state.make_state` is saved
by tierckpt to a local tier (raw) and two S3 prefixes (raw, auto), by DCP to a folder, and its
tensors' bytes, concatenated, to one local file and one S3 object (the baselines' input).

Every measurement is a fresh process (imports done and clients made before the clock starts:
the tierckpt contenders' ``Checkpointer`` too, as obstore's store and boto3's client; the time
to make it is reported apart as ``setup_s``; ``--quick`` and
``--in-process`` measure in this process instead, after one warm-up round); contenders are
interleaved round by round, so drift on a shared machine hits all of them alike. Before each
measurement the benchmark's own files (the local copies and SeaweedFS's volumes) are dropped
from the page cache with ``posix_fadvise(DONTNEED)``, so reads come from the disk (only these
files: the machine's other users keep their cache). Reported: median seconds, GB/s of the
state's bytes, the restoring process's CPU seconds, its peak RSS growth, and the ratio to the
row's baseline
(local: raw sequential read of the same bytes; S3: obstore's ranged concurrent GET into memory).

Contenders (a contender whose package is missing is listed as skipped, with the reason)
    local: disk-read (sequential ``readinto`` of the blob), tierckpt-local, dcp-fs
    (``FileSystemReader``)
    s3: tierckpt-{boto3,obstore}-{raw,auto}, tierckpt-obstore-planes (compressed chunks
    whatever the rates), obstore-get (ranged GETs of ``--part`` bytes,
    ``--concurrency`` in flight, into one buffer allocated by torch and not written, so that
    its pages are first touched by the copies, as tierckpt's storages are; obstore-get-zeroed: the
    same into a ``bytearray``, zero-filled before the first GET, as tables before
    2026-12-01 measured it), boto3-transfer (TransferManager
    ``download_fileobj``, same part size and concurrency), s3torchconnector (its
    ``S3Checkpoint`` reader), dcp-s3 (s3torchconnector's ``S3StorageReader``)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MiB = 2**20
BUCKET = "bench-restore"
LOCAL = ["disk-read", "tierckpt-local", "dcp-fs"]
S3 = [
    "obstore-get",
    "obstore-get-zeroed",
    "boto3-transfer",
    "tierckpt-boto3-raw",
    "tierckpt-obstore-raw",
    "tierckpt-boto3-auto",
    "tierckpt-obstore-auto",
    "tierckpt-obstore-planes",
    "s3torchconnector",
    "dcp-s3",
]


# -- the worker: one measurement in a fresh process ------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _template(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    if isinstance(state, dict):
        return {k: _template(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_template(v) for v in state]
    return state


def _shapes_state(spec: dict[str, Any]) -> Any:
    """An empty state shaped like the saved one (DCP loads into preallocated tensors)."""
    import torch

    def build(node: Any) -> Any:
        if isinstance(node, dict) and node.get("__tensor__"):
            return torch.empty(node["shape"], dtype=getattr(torch, node["dtype"]))
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v) for v in node]
        return node

    return build(spec["layout"])


def _count_requests() -> dict[str, int]:
    """Count obstore's requests from here on (its synchronous and async calls, one per
    range of a multi-range GET), by kind: what each contender sends, for the table."""
    counts: dict[str, int] = {}
    try:
        import obstore
    except ImportError:
        return counts
    kinds = {"get": "GET", "get_async": "GET", "get_range": "GET", "get_range_async": "GET"}
    kinds.update(get_ranges="GET", get_ranges_async="GET", list="LIST", head="HEAD")

    def wrap(fn_name: str, kind: str) -> None:
        real = getattr(obstore, fn_name, None)
        if real is None:
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            n = len(kwargs.get("starts", ())) if fn_name.startswith("get_ranges") else 1
            counts[kind] = counts.get(kind, 0) + n
            return real(*args, **kwargs)

        setattr(obstore, fn_name, counted)

    for fn_name, kind in kinds.items():
        wrap(fn_name, kind)
    try:  # tierckpt's own ranged GETs of s3:// data (absent from an older checkout)
        from tierckpt.backends.objstore._direct import DirectReads
    except ImportError:
        return counts
    answer = DirectReads._answer

    def counted_answer(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["direct GET"] = counts.get("direct GET", 0) + 1
        return answer(self, *args, **kwargs)

    DirectReads._answer = counted_answer  # type: ignore[method-assign]
    return counts


def worker(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run contender ``name`` once; imports happen before the clock starts. A name ending
    in ``@before`` is the same contender (run with another checkout on ``PYTHONPATH``)."""
    name = name.partition("@")[0]
    import torch

    requests = _count_requests()  # before any module binds obstore's functions

    import tierckpt
    from tierckpt import Checkpointer, LocalTier, S3Tier

    endpoint, nbytes = spec["endpoint"], spec["nbytes"]
    part, conc = spec["part"], spec["concurrency"]
    run: Any
    ck: Any = None
    setup_s = 0.0
    if name == "disk-read":

        def run() -> Any:
            buf = bytearray(nbytes)
            view = memoryview(buf)
            with open(spec["blob_file"], "rb", buffering=0) as f:
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got : got + 8 * MiB])
                    if not n:
                        break
                    got += n
            return buf

    elif name.startswith("tierckpt-"):
        # the Checkpointer (its tiers' clients) is made before the clock, as every other
        # contender makes its client or store first: the clock times the load; making it is
        # timed apart (setup_s; for S3 it builds the client and its credential chain)
        if name == "tierckpt-local":
            tiers = [LocalTier(spec["local_dir"])]
        else:
            _, driver, codec = name.split("-")
            url = f"s3://{BUCKET}/{codec}"
            tiers = [S3Tier(url, endpoint_url=endpoint, driver=driver, name=f"s3{codec}")]
        t_setup = time.perf_counter()
        ck = Checkpointer(tiers)
        setup_s = time.perf_counter() - t_setup

        def run() -> Any:
            return ck.load()

    elif name == "dcp-fs":
        import torch.distributed.checkpoint as dcp

        def run() -> Any:
            target = _shapes_state(spec)
            dcp.load(target, storage_reader=dcp.FileSystemReader(spec["dcp_dir"]))
            return target

    elif name in ("obstore-get", "obstore-get-zeroed"):
        import asyncio

        import obstore
        from obstore.store import S3Store

        store = S3Store(
            BUCKET, endpoint=endpoint, region="us-east-1", client_options={"allow_http": True}
        )
        zeroed = name == "obstore-get-zeroed"

        def run() -> Any:
            # the baseline's memory as tierckpt's storages (torch's allocator): allocated,
            # not written, so each page is first touched by the copy that fills it while the
            # other GETs are in flight. (-zeroed: a bytearray, which zero-fills all of it
            # before the first GET: 0.2-0.4 s per 256 MiB on a busy host. Not numpy.empty:
            # numpy asks for huge pages, whose faults here compact memory and measured slower
            # than either)
            buf = bytearray(nbytes) if zeroed else torch.empty(nbytes, dtype=torch.uint8)
            view = memoryview(buf.numpy()) if isinstance(buf, torch.Tensor) else memoryview(buf)

            async def main() -> None:
                sem = asyncio.Semaphore(conc)

                async def one(start: int) -> None:
                    async with sem:
                        data = await obstore.get_range_async(
                            store, "blob", start=start, length=min(part, nbytes - start)
                        )
                    view[start : start + len(data)] = memoryview(data)

                await asyncio.gather(*(one(s) for s in range(0, nbytes, part)))

            asyncio.run(main())
            return buf

    elif name == "boto3-transfer":
        import io

        import boto3
        from boto3.s3.transfer import TransferConfig

        client = boto3.session.Session().client("s3", endpoint_url=endpoint)
        cfg = TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_concurrency=conc
        )

        def run() -> Any:
            out = io.BytesIO()
            client.download_fileobj(BUCKET, "blob", out, Config=cfg)
            return out

    elif name == "s3torchconnector":
        from s3torchconnector import S3Checkpoint, S3ClientConfig

        ckpt = S3Checkpoint(
            region="us-east-1",
            endpoint=endpoint,
            s3client_config=S3ClientConfig(force_path_style=True, part_size=part),
        )

        def run() -> Any:
            with ckpt.reader(f"s3://{BUCKET}/blob") as r:
                return r.read()

    elif name == "dcp-s3":
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3StorageReader

        def run() -> Any:
            target = _shapes_state(spec)
            config = S3ClientConfig(force_path_style=True, part_size=part)
            reader = S3StorageReader("us-east-1", f"s3://{BUCKET}/dcp", s3client_config=config)
            # S3StorageReader takes no endpoint: give its file system a client that has one
            reader.fs._client = S3Client("us-east-1", endpoint=endpoint, s3client_config=config)
            dcp.load(target, storage_reader=reader)
            return target

    else:
        raise SystemExit(f"unknown contender {name!r}")
    del tierckpt
    import gc

    gc.collect()
    _reset_peak_rss()
    requests.clear()  # the timed load's requests only
    before = _status_kib("VmRSS")
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    sent = dict(requests)
    peak = _status_kib("VmHWM")
    del result
    gc.collect()
    cpu = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    if ck is not None:
        ck.close()
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "setup_s": setup_s,
        "peak_rss_growth_mib": max(0, peak - before) / 1024,
        "requests": sent,
    }


# -- the driver ---------------------------------------------------------------------------------
def _available(name: str) -> str:
    """'' when contender ``name`` can run here, else why not."""
    import importlib.util

    need = {"obstore-get": "obstore", "s3torchconnector": "s3torchconnector"}
    need["obstore-get-zeroed"] = "obstore"
    need.update({"dcp-s3": "s3torchconnector", "tierckpt-obstore-raw": "obstore"})
    need["tierckpt-obstore-auto"] = "obstore"
    need["tierckpt-obstore-planes"] = "obstore"
    mod = need.get(name)
    if mod and importlib.util.find_spec(mod) is None:
        return f"{mod} is not installed"
    return ""


def _drop_cache(paths: list[Path]) -> None:
    """Evict these files (only these) from the page cache."""
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for p in files:
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def _layout(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return {"__tensor__": True, "shape": list(state.shape), "dtype": str(state.dtype)[6:]}
    if isinstance(state, dict):
        return {k: _layout(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_layout(v) for v in state]
    return state


def _tensors(state: Any) -> list[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list):
        return [t for v in state for t in _tensors(v)]
    return []


def prepare(tmp: Path, gib: float, endpoint: str, admin: Any) -> dict[str, Any]:
    """Save the state every way the contenders read it; returns the workers' spec."""
    import torch

    from tierckpt import Checkpointer, LocalTier, S3Tier
    from tierckpt.bench.state import make_state

    state, info = make_state(gib, seed=0)
    admin.create_bucket(Bucket=BUCKET)
    local_dir = tmp / "local"
    tiers = [
        LocalTier(local_dir, codec="raw", keep_last=None),
        S3Tier(f"s3://{BUCKET}/raw", endpoint_url=endpoint, codec="raw", name="s3raw"),
        S3Tier(f"s3://{BUCKET}/planes", endpoint_url=endpoint, codec="planes", name="s3planes"),
    ]
    with Checkpointer(tiers) as ck:
        res = ck.save(state, step=1).result()
    stored = {name: r.stored_bytes for name, r in res.items()}
    # the auto tier as a training job uses it: a save (the policy measures the codec on the
    # data and the link's write rate), a load (it learns the restore's rate), a second save
    # (chunks stored as the measured rates say); the contenders load that second step
    auto = S3Tier(f"s3://{BUCKET}/auto", endpoint_url=endpoint, codec="auto", name="s3auto")
    with Checkpointer([auto]) as ck:
        ck.save(state, step=1).result()
        ck.load()
        res = ck.save(state, step=2).result()
        policy = ck._tiers[0].codec
        described = policy.describe() if hasattr(policy, "describe") else {}
    stored["s3auto"] = res["s3auto"].stored_bytes
    blob = tmp / "blob.bin"
    with open(blob, "wb") as f:
        for t in _tensors(state):
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    admin.upload_file(str(blob), BUCKET, "blob")
    import torch.distributed.checkpoint as dcp

    dcp_dir = tmp / "dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir)))
    if not _available("dcp-s3"):
        for p in sorted(dcp_dir.rglob("*")):
            if p.is_file():
                admin.upload_file(str(p), BUCKET, f"dcp/{p.relative_to(dcp_dir)}")
    return {
        "endpoint": endpoint,
        "nbytes": blob.stat().st_size,
        "state_bytes": info.nbytes,
        "tensors": info.tensors,
        "stored": stored,
        "blob_file": str(blob),
        "local_dir": str(local_dir),
        "dcp_dir": str(dcp_dir),
        "layout": _layout(state),
        "part": 8 * MiB,
        "concurrency": 8,
        "auto_policy": described,
        "decoder": _decoder_rate(state),
    }


def _decoder_rate(state: Any) -> dict[str, float]:
    """The planes codec's decode rate on one thread, on a sample of the state's floats."""
    import torch

    from tierckpt.codecs.auto import measure_codec
    from tierckpt.codecs.planes import PlanesCodec

    fp32 = [t for t in _tensors(state) if t.dtype == torch.float32 and t.numel() >= 1 << 20]
    sample = fp32[0].contiguous().view(torch.uint8)[: 16 * MiB].numpy()
    prof = measure_codec(PlanesCodec(itemsize=4, threads=1), sample, repeats=3)
    return {"decode_bps": prof.decode_bps, "encode_bps": prof.encode_bps, "ratio": prof.ratio}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="~64 MiB, in this process, warm-up + 3 runs"
    )
    ap.add_argument(
        "--in-process", action="store_true", help="measure in this process (quick's default)"
    )
    ap.add_argument("--gib", type=float, default=None, help="state size (default 1, quick 1/16)")
    ap.add_argument("--runs", type=int, default=None, help="measured rounds (default 5, quick 3)")
    ap.add_argument("--only", default="", help="comma-separated contenders")
    ap.add_argument("--json", default="bench-out/restore.json", help="where to write results")
    ap.add_argument(
        "--before",
        default="",
        help="another checkout of tierckpt (a folder holding its tierckpt/): each tierckpt "
        "contender also runs with that code, as NAME@before, interleaved with the rest",
    )
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        print(json.dumps(worker(args.worker, spec)))
        return 0
    gib = args.gib if args.gib is not None else (1 / 16 if args.quick else 1.0)
    runs = args.runs if args.runs is not None else (3 if args.quick else 5)
    warmup = True
    args.in_process = args.in_process or args.quick
    names = [n for n in LOCAL + S3 if not args.only or n in args.only.split(",")]
    skipped = {n: why for n in names if (why := _available(n))}
    names = [n for n in names if n not in skipped]
    if args.before:
        if args.in_process:
            raise SystemExit("--before needs fresh processes (not --quick / --in-process)")
        names += [f"{n}@before" for n in names if n.startswith("tierckpt-")]

    from tierckpt.testing.s3servers import ACCESS_KEY, REGION, SECRET_KEY, start_seaweedfs

    os.environ.update(
        AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION=REGION
    )
    with tempfile.TemporaryDirectory(prefix="bench-restore-", dir=os.environ.get("TMPDIR")) as t:
        tmp = Path(t)
        # auto's load-side state in a fresh folder (the workers inherit it): a state kept
        # from an earlier run of this benchmark (same URLs) would decide what the auto tier
        # stores and whether its loads probe
        os.environ["TIERCKPT_AUTO_STATE_DIR"] = str(tmp / "auto-state")
        server = start_seaweedfs(tmp / "seaweedfs")  # volumes on this disk, not /dev/shm
        try:
            t0 = time.perf_counter()
            spec = prepare(tmp, gib, server.endpoint_url, server.admin)
            print(
                f"prepared {spec['state_bytes'] / MiB:.0f} MiB in {spec['tensors']} tensors "
                f"({time.perf_counter() - t0:.1f} s)",
                file=sys.stderr,
            )
            spec_path = tmp / "spec.json"
            spec_path.write_text(json.dumps(spec))
            times: dict[str, list[float]] = {n: [] for n in names}
            rss: dict[str, list[float]] = {n: [] for n in names}
            cpu: dict[str, list[float]] = {n: [] for n in names}
            setup: dict[str, list[float]] = {n: [] for n in names}
            sent: dict[str, dict[str, int]] = {}
            failed: dict[str, str] = {}
            cached = [tmp / "local", tmp / "blob.bin", tmp / "dcp", tmp / "seaweedfs"]
            for rnd in range(runs + warmup):
                for name in names:
                    if name in failed:
                        continue
                    _drop_cache(cached)
                    if args.in_process:
                        try:
                            got = worker(name, spec)
                        except Exception as exc:
                            failed[name] = f"{type(exc).__name__}: {exc}"[:200]
                            continue
                        if warmup and rnd == 0:
                            continue
                        times[name].append(got["seconds"])
                        rss[name].append(got["peak_rss_growth_mib"])
                        cpu[name].append(got["cpu_s"])
                        setup[name].append(got["setup_s"])
                        sent[name] = got.get("requests", {})
                        continue
                    env = dict(os.environ)
                    if name.endswith("@before"):
                        env["PYTHONPATH"] = os.path.abspath(args.before)
                    proc = subprocess.run(
                        [sys.executable, __file__, "--worker", name, "--spec", str(spec_path)],
                        capture_output=True,
                        text=True,
                        timeout=600,
                        env=env,
                    )
                    if proc.returncode != 0:
                        failed[name] = (proc.stderr.strip().splitlines() or ["?"])[-1][:200]
                        continue
                    got = json.loads(proc.stdout.strip().splitlines()[-1])
                    if warmup and rnd == 0:
                        continue
                    times[name].append(got["seconds"])
                    rss[name].append(got["peak_rss_growth_mib"])
                    cpu[name].append(got["cpu_s"])
                    setup[name].append(got["setup_s"])
                    sent[name] = got.get("requests", {})
        finally:
            server.stop()
    results = {
        "loadavg": os.getloadavg(),
        "auto_policy": spec["auto_policy"],
        "decoder": spec["decoder"],
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "state_bytes": spec["state_bytes"],
        "tensors": spec["tensors"],
        "stored_bytes": spec["stored"],
        "runs": runs,
        "warmup": warmup,
        "before": os.path.abspath(args.before) if args.before else None,
        "contenders": {
            n: {
                "median_s": statistics.median(times[n]),
                "runs_s": times[n],
                "peak_rss_growth_mib": max(rss[n]),
                "cpu_s": statistics.median(cpu[n]),
                "cpu_runs_s": cpu[n],  # per round, in order (pairs with runs_s)
                "setup_s": statistics.median(setup[n]),
                "requests": sent.get(n, {}),
            }
            for n in names
            if times[n]
        },
        "skipped": skipped,
        "failed": failed,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


def table(results: dict[str, Any]) -> str:
    """The results as a markdown table, each row against its group's baseline."""
    c = results["contenders"]
    nbytes = results["state_bytes"]
    lines = [
        f"Restore of {nbytes / MiB:.0f} MiB ({results['tensors']} tensors), "
        f"median of {results['runs']}, {results['date']}, {results['machine']}",
        "",
        "| source | contender | median s | GB/s | client CPU s | peak RSS growth MiB "
        "| requests | vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group, names, base in (("local", LOCAL, "disk-read"), ("s3", S3, "obstore-get")):
        ref = c.get(base, {}).get("median_s")
        for n in [m for k in names for m in (k, f"{k}@before")]:
            if n not in c:
                continue
            s = c[n]["median_s"]
            ratio = f"{ref / s:.2f}x" if ref else "-"
            req = " ".join(f"{v} {k}" for k, v in sorted(c[n].get("requests", {}).items()))
            lines.append(
                f"| {group} | {n} | {s:.3f} | {nbytes / s / 1e9:.2f} | "
                f"{c[n].get('cpu_s', 0.0):.2f} | {c[n]['peak_rss_growth_mib']:.0f} | "
                f"{req or '-'} | {ratio} |"
            )
    for n, why in {**results["skipped"], **results["failed"]}.items():
        lines.append(f"| - | {n} | skipped: {why} | | | | | |")
    lines.append("")
    lines.append("vs baseline: the baseline's time / this time (above 1: faster than the baseline)")
    lines.append(
        "client CPU s: user + system seconds of the restoring process (its threads) while timed"
    )
    lines.append(
        "requests: the timed load's requests (last round): obstore's, and tierckpt's direct "
        "ranged GETs ('direct GET'); '-': neither"
    )
    made = {n: v["setup_s"] for n, v in c.items() if v.get("setup_s")}
    if made:
        lines.append(
            "not timed (made before the clock, as every contender's client): the Checkpointer, "
            + ", ".join(f"{n} {v:.3f} s" for n, v in made.items())
        )
    lines.append(f"load average at the end: {results['loadavg'][0]:.1f}")
    link = c.get("obstore-get", {}).get("median_s")
    dec = results.get("decoder", {}).get("decode_bps")
    if link and dec:
        link_bps = nbytes / link
        cpus = os.cpu_count() or 1
        verdict = "faster" if link_bps > dec * cpus else "slower"
        lines.append(
            f"link {link_bps / 1e9:.2f} GB/s (obstore ranged GET) vs the planes decoder "
            f"{dec / 1e9:.2f} GB/s per thread x {cpus} CPUs = {dec * cpus / 1e9:.2f} GB/s: the "
            f"link is {verdict} than the decoders"
            + (
                ", so a compressed restore cannot beat a raw one here"
                if verdict == "faster"
                else ""
            )
        )
    pol = results.get("auto_policy") or {}
    if pol:
        rates = ", ".join(
            f"{k} {v / 1e9:.2f} GB/s"
            for k, v in pol.items()
            if k.endswith("bps") and isinstance(v, (int, float))
        )
        lines.append(
            f"auto policy after save, load, save: compress {pol.get('compress')} ({rates})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
