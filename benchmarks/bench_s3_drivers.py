"""The two S3 drivers of an S3 tier against the raw clients, on SeaweedFS (issue 15).

One state of ``--size`` bytes of fp32 tensors is saved and restored through a Checkpointer with
one S3 tier per driver (``driver="obstore"``, the default, and ``driver="boto3"``), each with
the tier's defaults (parts sized per shard, the node's connection share), and the same number
of bytes is uploaded and read back by the raw clients, each configured as below (the settings
are in each row's name):

- boto3's TransferManager (``upload_fileobj`` / ``download_fileobj``): 8 MiB parts, 8 threads;
- obstore ``put`` with the tier's own upload settings (8 MiB parts, 8 in flight: what an S3
  tier chooses for a shard of this size and host budget, :mod:`tierckpt.backends.sizing`), and
  with obstore's defaults (5 MiB parts, 12 in flight); ``get_ranges`` of 8 MiB ranges, 8 at a
  time, into memory;
- s3torchconnector, where importable: its writer with 8 MiB parts (the CRT's own concurrency);
  one streamed GET.

A save of the tier is timed from ``save()`` to its commit (the capture into the arena, the
upload, the index and the manifest: ``TierResult.seconds``); its retention pass, which trails
the commit, is waited for before the next case starts (its CPU counted with the save's, its
requests kept out of the next case's time); a raw upload from the call to its return (the
bytes already in memory). Each case's wall time, this process's CPU time (the
client's) and SeaweedFS's CPU time over the case (the server's: on a machine with few cores
each client CPU second slows the server too). Rounds are interleaved (each round runs every
case once, in an order shuffled afresh each round, seeded by the round: an upload right after
s3torchconnector's is about 0.4 s slower on this server, raw obstore's too, an effect that decays
over seconds, so a fixed or merely alternating order puts it on the same case in half the rounds),
one warm-up round, then the median of ``--runs``. A case
that fails (s3torchconnector timing out under load, say) is reported as failed, with its error,
and the others go on.

``--unsigned``: also raw obstore and the obstore tier sending ``UNSIGNED-PAYLOAD`` (what the
tier does over TLS, where the body is not hashed for the signature; over this plain-HTTP server
it signs them, as every raw client here does).

``--capture-twin``: also raw obstore ``put`` (8 MiB x 8) with a capture's client work done
beside it on a thread: the state's tensors copied into a reused buffer, then the xxh3 of each
64 MiB piece (tierckpt's chunk checksum). A tier save that is level with this row but slower
than the bare put loses its time to its capture's CPU, not to its requests.

``--count-requests``: afterwards each save case runs once more through a counting proxy
(:class:`tierckpt.testing.faultproxy.FaultProxy`, after a warm-up save so that a tier's first
save's one-off requests are not counted) and the requests it sent are listed by kind, with its
timeline (:func:`timeline`): when the first part was sent and the last answered, and every
other request of the timed span with when it was sent and answered (milliseconds from the
call), so that what waits for what is seen: which requests overlap the parts and which run in
sequence after them (the proxy's relaying slows every case alike; compare within a run).

    python benchmarks/bench_s3_drivers.py --size 256MiB --runs 5 --json out.json

Where SeaweedFS's CPU goes, per request kind and per save with and without the retention pass:
``bench_s3_server_cpu.py`` (the tier's own requests cost it some 0.03 s per 256 MiB save; the
tier's gap is the capture's client CPU).

SeaweedFS runs as its own process with its volumes on disk (``--tmpdir``, default the system's
temporary folder, not ``/dev/shm``).
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.format import checksum
from tierckpt.testing.faultproxy import FaultProxy, RequestRecord
from tierckpt.testing.s3servers import REGION, S3Server, start_seaweedfs

MiB = 2**20
PART = 8 * MiB
THREADS = 8
#: the tier's chunk (the checksummed piece of the capture twin)
CHUNK = 64 * MiB
#: obstore.put's own defaults (obstore 0.12)
OBSTORE_PART, OBSTORE_THREADS = 5 * MiB, 12
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def children_cpu() -> float:
    """CPU seconds used so far by this process's children (the S3 server), from /proc
    (0 where there is none)."""
    me, total = os.getpid(), 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:  # ppid
            total += int(fields[11]) + int(fields[12])  # utime + stime
    return total / _TICK


def request_kind(method: str, target: str) -> str:
    """A request's S3 operation, roughly: ``PUT part``, ``POST complete``, ``GET list``..."""
    query = target.partition("?")[2]
    if "partNumber=" in query:
        return f"{method} part"
    if query.startswith("uploads") or "&uploads" in query:
        return f"{method} {'list-uploads' if method == 'GET' else 'create-upload'}"
    if "uploadId=" in query:
        return f"{method} {'complete' if method == 'POST' else 'upload'}"
    if "list-type=" in query:
        return f"{method} list"
    if "delete" in query:
        return f"{method} delete-objects"
    return f"{method} object"


def parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def make_state(size: int) -> dict[str, torch.Tensor]:
    """About ``size`` bytes as fp32 tensors of mixed sizes (a model's shapes, roughly)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    sizes = [16 * MiB, 4 * MiB, 1 * MiB, 256 * 1024]
    total, i = 0, 0
    while total < size:
        n = min(sizes[i % len(sizes)], size - total) // 4
        out[f"t{i}"] = torch.randn(n, generator=gen)
        total += n * 4
        i += 1
    return out


def cases(
    server: S3Server,
    bucket: str,
    state: dict[str, torch.Tensor],
    endpoint: str | None = None,
    unsigned: bool = False,
    capture_twin: bool = False,
) -> dict[str, Any]:
    """``{"save": {name: fn}, "restore": {name: fn}}``: each fn returns its seconds.
    ``endpoint``: where the clients connect (default the server's; a counting proxy).
    ``capture_twin``: also the raw put with a capture's copy and checksum beside it.
    ``unsigned``: also obstore and the obstore tier sending unsigned payloads (what the tier
    does over TLS; the server here speaks plain HTTP, where the tier signs them)."""
    endpoint = endpoint or server.endpoint_url
    import obstore
    from boto3.s3.transfer import TransferConfig
    from obstore.store import S3Store

    # the tiers and s3torchconnector find the server's keys where every AWS client looks
    os.environ.update(
        AWS_ACCESS_KEY_ID=server.access_key,
        AWS_SECRET_ACCESS_KEY=server.secret_key,
        AWS_DEFAULT_REGION=REGION,
    )
    data = b"".join(t.numpy().tobytes() for t in state.values())
    size = len(data)
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=server.access_key,
        aws_secret_access_key=server.secret_key,
        region_name=REGION,
        config=Config(max_pool_connections=THREADS + 4, tcp_keepalive=True),
    )
    transfer = TransferConfig(
        multipart_threshold=PART, multipart_chunksize=PART, max_concurrency=THREADS
    )
    store = S3Store(
        bucket,
        config={
            "endpoint": endpoint,
            "region": REGION,
            "access_key_id": server.access_key,
            "secret_access_key": server.secret_key,
        },
        client_options={"allow_http": True},
    )
    unsigned_store = S3Store(
        bucket,
        config={
            **{k: v for k, v in store.config.items() if k != "bucket"},
            "unsigned_payload": True,
        },
        client_options={"allow_http": True},
    )
    sink = bytearray(size)
    save: dict[str, Callable[[], float]] = {}
    restore: dict[str, Callable[[], float]] = {}

    def wall(fn: Callable[[], object]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    save["raw boto3 (TransferManager 8 MiB x 8)"] = wall(
        lambda: client.upload_fileobj(io.BytesIO(data), bucket, "raw/boto3", Config=transfer)
    )
    save["raw obstore (put 8 MiB x 8)"] = wall(
        lambda: obstore.put(store, "raw/obstore", data, chunk_size=PART, max_concurrency=THREADS)
    )
    if unsigned:
        save["raw obstore (put 8 MiB x 8, unsigned)"] = wall(
            lambda: obstore.put(
                unsigned_store, "raw/unsigned", data, chunk_size=PART, max_concurrency=THREADS
            )
        )
    if capture_twin:
        arena = torch.empty(size, dtype=torch.uint8)

        def capture_work() -> None:
            at = 0
            for t in state.values():
                n = t.numel() * t.element_size()
                arena[at : at + n].copy_(t.reshape(-1).view(torch.uint8))
                at += n
            for i in range(0, size, CHUNK):
                checksum(memoryview(arena[i : i + CHUNK].numpy()))  # type: ignore[arg-type]

        def twin() -> None:
            beside = threading.Thread(target=capture_work)
            beside.start()
            try:
                obstore.put(store, "raw/twin", data, chunk_size=PART, max_concurrency=THREADS)
            finally:
                beside.join()

        save["twin: obstore 8 MiB x 8 + copy, xxh3"] = wall(twin)
    save["raw obstore (put 5 MiB x 12)"] = wall(
        lambda: obstore.put(
            store,
            "raw/obstore-defaults",
            data,
            chunk_size=OBSTORE_PART,
            max_concurrency=OBSTORE_THREADS,
        )
    )

    def ranged_get() -> None:
        starts = list(range(0, size, PART))
        for i in range(0, len(starts), THREADS):
            batch = starts[i : i + THREADS]
            lengths = [min(PART, size - s) for s in batch]
            got = obstore.get_ranges(store, "raw/obstore", starts=batch, lengths=lengths)
            for s, part in zip(batch, got, strict=True):
                sink[s : s + len(part)] = memoryview(part)

    restore["raw boto3 (TransferManager)"] = wall(
        lambda: client.download_fileobj(bucket, "raw/boto3", io.BytesIO(), Config=transfer)
    )
    restore["raw obstore (get_ranges)"] = wall(ranged_get)
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client

        s3t = S3Client(
            REGION,
            endpoint=endpoint,
            s3client_config=S3ClientConfig(force_path_style=True, part_size=PART),
        )

        def s3t_put() -> None:
            writer = s3t.put_object(bucket, "raw/s3t")
            writer.write(data)
            writer.close()

        def s3t_get() -> None:
            reader = s3t.get_object(bucket, "raw/s3t")
            n = reader.readinto(memoryview(sink))
            assert n == size, n

        save["raw s3torchconnector (8 MiB parts)"] = wall(s3t_put)
        restore["raw s3torchconnector"] = wall(s3t_get)
    except ImportError:
        pass

    steps = iter(range(1, 1 << 30))
    cks: dict[str, Checkpointer] = {}
    tiers = {
        name: (driver, extra)
        for name, driver, extra in (
            ("tierckpt driver=obstore", "obstore", {}),
            ("tierckpt driver=boto3", "boto3", {}),
            ("tierckpt driver=obstore, unsigned", "obstore", {"unsigned_payload": True}),
        )
        if unsigned or not extra
    }
    for name, (driver, extra) in tiers.items():
        tier = S3Tier(
            f"s3://{bucket}/ckpt-{driver}{'-unsigned' if extra else ''}",
            driver=driver,
            endpoint_url=endpoint,
            keep_last=1,
            codec="raw",
            **({"config": extra} if extra else {}),
        )
        ck = Checkpointer([tier], host_buffer_bytes=size + (256 << 20))
        cks[name] = ck

        def ck_save(ck: Checkpointer = ck) -> float:
            seconds = float(ck.save(state, step=next(steps)).result()["s3"].seconds)
            # the retention pass trails the commit (not part of the save's time): let it end
            # here, inside this case's CPU counts, not inside the next case's window
            ck.wait(retention=True)
            return seconds

        save[name] = ck_save
        restore[name] = wall(lambda ck=ck: ck.load())
    return {"save": save, "restore": restore, "close": [*cks.values()], "size": size}


Samples = dict[str, dict[str, list[float]]]


def run_rounds(
    c: dict[str, Any], kinds: list[str], warmup: int, runs: int
) -> tuple[dict[str, Samples], dict[str, dict[str, str]]]:
    """Every case of ``kinds`` once a round, interleaved: ``({"wall"|"cpu"|"server": {kind:
    {name: samples}}}, {kind: {name: error}})``. A case that raises is not run again and
    reported with its error (the other cases finish)."""
    samples: dict[str, Samples] = {m: {k: {} for k in kinds} for m in ("wall", "cpu", "server")}
    failed: dict[str, dict[str, str]] = {k: {} for k in kinds}
    for i in range(warmup + runs):
        for kind in kinds:
            items = [(n, fn) for n, fn in c[kind].items() if n not in failed[kind]]
            # a fresh order each round (the same in every run): a case whose aftermath slows
            # the next upload (s3torchconnector's: ~0.4 s, decaying over seconds) does not
            # always land on the same case, as it did when the order only alternated
            for name, fn in random.Random(i).sample(items, len(items)):
                c0, s0 = time.process_time(), children_cpu()  # client's and server's CPU
                try:
                    t = fn()
                except Exception as exc:
                    failed[kind][name] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"  {kind} {name}: FAILED in round {i}: {failed[kind][name]}")
                    continue
                spent, served = time.process_time() - c0, children_cpu() - s0
                if i >= warmup:
                    for m, v in (("wall", t), ("cpu", spent), ("server", served)):
                        samples[m][kind].setdefault(name, []).append(v)
    return samples, failed


def count_requests(
    server: S3Server,
    bucket: str,
    state: dict[str, torch.Tensor],
    kinds: list[str],
    only: str,
    unsigned: bool,
) -> dict[str, dict[str, dict[str, Any]]]:
    """``{kind: {name: {request kind: count, ..., "timeline": timeline(...)}}}`` of one run of
    each case through a counting proxy, after one warm-up run (a tier's first save probes the
    store, takes its lease...)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with FaultProxy(server.endpoint_url) as proxy:
        c = cases(server, bucket, state, endpoint=proxy.endpoint_url, unsigned=unsigned)
        try:
            for kind in kinds:
                out[kind] = {}
                for name, fn in c[kind].items():
                    if only and not any(w in name for w in only.split(",")):
                        continue
                    try:
                        fn()
                        proxy.requests.clear()
                        t0 = time.perf_counter()
                        span = fn()
                    except Exception as exc:
                        print(f"  counting {kind} {name}: FAILED: {type(exc).__name__}: {exc}")
                        continue
                    counts = collections.Counter(
                        request_kind(r.method, r.target) for r in proxy.requests
                    )
                    out[kind][name] = {
                        "total": sum(counts.values()),
                        **sorted_counts(counts),
                        "timeline": timeline(list(proxy.requests), t0, span),
                    }
        finally:
            for ck in c["close"]:
                ck.close()
    return out


def timeline(records: list[RequestRecord], t0: float, span: float) -> dict[str, Any]:
    """Where the requests of one timed call fall (``t0``: its start, ``perf_counter()``;
    ``span``: its timed seconds): the parts' first send and last answer, and the other
    requests sent within the span as ``[kind, sent, answered]`` (ms from ``t0``; answered None
    where no answer came), in the order sent; ``after_parts``: those sent once the last part
    had been answered (the span's serial tail)."""

    def ms(t: float | None) -> float | None:
        return None if t is None else round((t - t0) * 1e3, 1)

    inside = sorted((r for r in records if r.sent - t0 <= span), key=lambda r: r.sent)
    parts, others = [], []
    for r in inside:
        kind = request_kind(r.method, r.target)
        (parts if kind.endswith(" part") else others).append((kind, r))
    answers = [r.answered for _, r in parts if r.answered is not None]
    last_part = max(answers) if answers else None
    return {
        "span_ms": round(span * 1e3, 1),
        "parts": len(parts),
        "first_part_sent_ms": ms(parts[0][1].sent) if parts else None,
        "last_part_answered_ms": ms(last_part),
        "others": [[kind, ms(r.sent), ms(r.answered)] for kind, r in others],
        "after_parts": [
            [kind, ms(r.sent), ms(r.answered)]
            for kind, r in others
            if last_part is not None and r.sent >= last_part
        ],
    }


def sorted_counts(counts: collections.Counter[str]) -> dict[str, int]:
    return dict(sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", type=parse_size, default=256 * MiB)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tmpdir", default=None, help="SeaweedFS's volumes (default: system temp)")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--kinds", default="save,restore", help="what to run: save, restore or both (default)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: run only the cases whose name has one (default all)",
    )
    ap.add_argument(
        "--count-requests",
        action="store_true",
        help="then count each case's requests once, through a proxy",
    )
    ap.add_argument(
        "--capture-twin",
        action="store_true",
        help="also the raw obstore put with a capture's copy and xxh3 beside it",
    )
    ap.add_argument(
        "--unsigned",
        action="store_true",
        help="also obstore and the obstore tier with unsigned payloads (the tier's way over TLS)",
    )
    args = ap.parse_args(argv)
    kinds = [k for k in ("save", "restore") if k in args.kinds.split(",")]
    requests: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as tmp:
        server = start_seaweedfs(Path(tmp) / "weed")
        try:
            bucket = "bench"
            server.admin.create_bucket(Bucket=bucket)
            state = make_state(args.size)
            c = cases(server, bucket, state, unsigned=args.unsigned, capture_twin=args.capture_twin)
            if args.only:
                words = args.only.split(",")
                for kind in kinds:
                    c[kind] = {n: f for n, f in c[kind].items() if any(w in n for w in words)}
            try:
                samples, failed = run_rounds(c, kinds, args.warmup, args.runs)
            finally:
                for ck in c["close"]:
                    ck.close()
            if args.count_requests:
                requests = count_requests(server, bucket, state, kinds, args.only, args.unsigned)
        finally:
            server.stop()
    size = c["size"]
    results: dict[str, Any] = {"size": size, "runs": args.runs, "python": sys.version.split()[0]}
    for kind in kinds:
        by = samples["wall"][kind]
        med = {name: statistics.median(ts) for name, ts in by.items()}
        raws = [t for name, t in med.items() if name.startswith("raw")]
        best_raw = min(raws) if raws else float("nan")
        results[kind] = {
            name: {
                "median_s": med[name],
                "gb_per_s": size / 1e9 / med[name],
                "speed_vs_best_raw": best_raw / med[name],
                "client_cpu_s": statistics.median(samples["cpu"][kind][name]),
                "server_cpu_s": statistics.median(samples["server"][kind][name]),
                "seconds": ts,
                **({"requests": requests[kind][name]} if name in requests.get(kind, {}) else {}),
            }
            for name, ts in by.items()
        }
        results[kind].update({name: {"failed": err} for name, err in failed[kind].items()})
        print(f"\n{kind} of {size / MiB:.0f} MiB, medians of {args.runs} (SeaweedFS, 127.0.0.1)")
        head = f"{'median s':>9} {'GB/s':>6} {'x best raw':>10} {'CPU s':>6} {'server s':>8}"
        print(f"  {'client':40} {head}")
        for name, row in results[kind].items():
            if "failed" in row:
                print(f"  {name:40} FAILED: {row['failed']}")
                continue
            print(
                f"  {name:40} {row['median_s']:9.3f} {row['gb_per_s']:6.2f} "
                f"{row['speed_vs_best_raw']:10.2f} {row['client_cpu_s']:6.2f} "
                f"{row['server_cpu_s']:8.2f}"
            )
        for name, counted in requests.get(kind, {}).items():
            counted = dict(counted)
            tl = counted.pop("timeline")
            print(f"  requests of one {kind}, {name}: {counted}")
            if not tl["parts"]:
                continue  # a restore: its GETs are listed above
            others = ", ".join(
                f"{k} +{s:.0f}..{'-' if a is None else f'+{a:.0f}'}" for k, s, a in tl["others"]
            )
            print(
                f"    timeline (ms from the call; timed span {tl['span_ms']:.0f}): "
                f"{tl['parts']} parts, first sent +{tl['first_part_sent_ms']}, last answered "
                f"+{tl['last_part_answered_ms']}; others: {others or 'none'}; sent after the "
                f"last part's answer: {len(tl['after_parts'])}"
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
