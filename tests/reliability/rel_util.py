"""Helpers for the reliability suite: state hashes, re-sealing crafted checkpoints, leftovers,
resource probes and the outcome records the report is built from.

Everything here goes through the library's own public pieces (backends, ``format``) so a
crafted checkpoint differs from a valid one only where a test edits it: the checksums of the
index, footer and manifest are recomputed after the edit, so the parsers, not just the
checksums, see the hostile values.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, S3Tier
from tierckpt.backends.base import Backend
from tierckpt.format import (
    FOOTER_SIZE,
    Footer,
    checksum,
    manifest_name,
    shard_name,
    with_counts,
)
from tierckpt.testing.faultproxy import Fault, FaultProxy

__all__ = [
    "BLACKHOLE",
    "WAIT_S",
    "RssSampler",
    "Recorder",
    "committed",
    "fd_count",
    "fd_kinds",
    "library_threads",
    "fs_snapshot",
    "held_s3",
    "local_leftovers",
    "ranks_through_an_outage",
    "read_shard_parts",
    "replace_object",
    "reseal",
    "s3_leftovers",
    "seal_manifest",
    "state_hash",
]


# -- state hashes ---------------------------------------------------------------------------


def state_hash(state: Any) -> str:
    """A hash of a state tree: structure, types, tensor dtype/shape and bytes (not strides)."""
    h = hashlib.blake2b(digest_size=16)

    def walk(x: Any) -> None:
        h.update(type(x).__name__.encode())
        if isinstance(x, torch.Tensor):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            if x.numel():
                h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            h.update(str(len(x)).encode())
            for k, v in x.items():
                walk(k)
                walk(v)
        elif isinstance(x, (list, tuple)):
            h.update(str(len(x)).encode())
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())
        h.update(b";")

    walk(state)
    return h.hexdigest()


# -- crafting checkpoints -----------------------------------------------------------------


def seal_manifest(body: dict[str, Any]) -> bytes:
    """Manifest bytes with a valid checksum over ``body`` (its ``checksum`` key is replaced)."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    body["checksum"] = checksum(canon.encode("utf-8"))
    return json.dumps(body, sort_keys=True, indent=1).encode("utf-8")


def replace_object(backend: Backend, name: str, data: bytes) -> None:
    """Make ``data`` the object ``name`` on any backend (a shard through a writer)."""
    backend.delete(name)
    if name.startswith("manifests/"):
        backend.put_atomic(name, data, overwrite=True)
        return
    w = backend.open_writer(name)
    w.write(0, data)
    w.commit()


def read_shard_parts(backend: Backend, step: int, rank: int = 0) -> tuple[bytes, Footer]:
    name = shard_name(step, rank)
    data = bytes(backend.get(name))
    return data, Footer.decode(data[-FOOTER_SIZE:], file_size=len(data), where=name)


def reseal(
    backend: Backend,
    step: int,
    *,
    index: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    index_bytes: bytes | None = None,
    data: Callable[[bytearray, dict[str, Any]], bytes | bytearray | None] | None = None,
    footer: Callable[[Footer], Footer] | None = None,
    manifest: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    manifest_bytes: bytes | None = None,
) -> None:
    """Edit step ``step``'s shard and manifest on ``backend`` and re-seal every checksum.

    ``index`` edits the parsed index (in place, or returns a new dict), ``index_bytes``
    replaces it wholesale, ``data`` edits the chunk region (it gets the parsed index too),
    ``footer`` edits the footer (its own checksum is recomputed by ``Footer.encode``),
    ``manifest`` edits the manifest body after the shard reference was updated, and
    ``manifest_bytes`` replaces the manifest with raw bytes (no sealing).
    """
    blob, ft = read_shard_parts(backend, step)
    region = bytearray(blob[: ft.index_offset])
    idx_raw = blob[ft.index_offset : ft.index_offset + ft.index_length]
    parsed = json.loads(idx_raw)
    if data is not None:
        out = data(region, parsed)
        region = bytearray(out) if out is not None else region
    if index is not None:
        out_idx = index(parsed)
        parsed = out_idx if isinstance(out_idx, dict) else parsed
    if index_bytes is not None:
        new_idx = index_bytes
    elif index is not None:
        # the counts in the header are re-sealed too, as a writer would compute them
        new_idx = json.dumps(with_counts(parsed), separators=(",", ":")).encode()
    else:
        new_idx = idx_raw
    size = len(region) + len(new_idx) + FOOTER_SIZE
    new_ft = Footer(len(region), len(new_idx), checksum(new_idx), size)
    if footer is not None:
        new_ft = footer(new_ft)
    replace_object(backend, shard_name(step, 0), bytes(region) + new_idx + new_ft.encode())
    mname = manifest_name(step)
    if manifest_bytes is not None:
        replace_object(backend, mname, manifest_bytes)
        return
    body = json.loads(backend.get(mname))
    body["shards"][0]["size"] = size
    body["shards"][0]["index_checksum"] = new_ft.index_checksum
    if manifest is not None:
        out_m = manifest(body)
        body = out_m if isinstance(out_m, dict) else body
    replace_object(backend, mname, seal_manifest(body))


# -- leftovers ------------------------------------------------------------------------------


def local_leftovers(root: Path) -> dict[str, list[str]]:
    """Leftovers under a local tier's root: temporary files, data files of steps without a
    manifest, and empty step folders (left by aborted writers; harmless, removed by
    ``cleanup_incomplete``)."""
    root = Path(root)
    tmp = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))
    committed = {p.name[5:17] for p in (root / "manifests").glob("step-*.json")}
    # step folders of format v1 (steps/<step>) and v2 (<hh>/steps/<step>)
    folders = [
        p
        for p in [*root.glob("steps/*"), *root.glob("*/steps/*")]
        if p.is_dir() and p.name not in committed
    ]
    orphans = sorted(
        str(f.relative_to(root))
        for p in folders
        for f in p.rglob("*")
        if f.is_file() and not f.name.endswith(".tmp")
    )
    empty = sorted(str(p.relative_to(root)) for p in folders if not any(p.iterdir()))
    return {"tmp_files": tmp, "uncommitted_data": orphans, "empty_folders": empty}


def s3_leftovers(client: Any, bucket: str, prefix: str) -> dict[str, list[str]]:
    """Open multipart uploads and data objects of steps without a manifest."""
    uploads = [
        u["Key"]
        for page in client.get_paginator("list_multipart_uploads").paginate(
            Bucket=bucket, Prefix=prefix
        )
        for u in page.get("Uploads", [])
    ]
    keys = [
        o["Key"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    committed = {k.rsplit("step-", 1)[1][:12] for k in keys if "/manifests/step-" in k}
    orphans = sorted(
        k for k in keys if "/steps/" in k and k.split("/steps/", 1)[1][:12] not in committed
    )
    return {"open_uploads": sorted(uploads), "uncommitted_data": orphans}


# -- resource probes ------------------------------------------------------------------------


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_kinds() -> tuple[int, int]:
    """(open files, folders and pipes; sockets and event fds) of this process. An in-process
    moto server opens sockets and epoll fds per request, so only the first number is exact."""
    files = other = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(("socket:", "anon_inode:")):
            other += 1
        else:
            files += 1
    return files, other


def library_threads() -> int:
    """Threads started by tierckpt (all are named tierckpt-*); an in-process moto server's
    request threads are not counted."""
    return sum(t.name.startswith("tierckpt") for t in threading.enumerate())


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds; ``growth`` is peak - start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.start = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self.start = self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def fs_snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (st.st_size if n in files else -1, st.st_mtime_ns)
    return out


# -- S3 outages -----------------------------------------------------------------------------

#: every request held by the fault proxy, never answered (a store that hangs)
BLACKHOLE = [Fault("stall", seconds=600)]
#: the outage tests' wait for a tier's answer and for a lease (TIERCKPT_LEASE_WAIT_S; the
#: ``waited_bucket`` fixture sets it)
WAIT_S = 1.0


def held_s3(bucket: str, endpoint: str, **kw: Any) -> S3Tier:
    """``s3://<bucket>/run`` (raw chunks) whose one held request costs 2 attempts x 10 s
    before it gives up; ``kw``: other tier options."""
    opts: dict[str, Any] = {
        "codec": "raw",
        "connect_timeout": 1,
        "read_timeout": 10,
        "max_attempts": 2,
        **kw,
    }
    return S3Tier(f"s3://{bucket}/run", endpoint_url=endpoint, **opts)


def committed(tier: Any) -> list[tuple[int, int]]:
    """The checkpoints committed on ``tier``, as (step, timeline)."""
    with Checkpointer([tier]) as ck:
        return [(c.step, c.timeline) for c in ck.checkpoints()]


def ranks_through_an_outage(
    fn: str, root: Path, upstream: str, bucket: str, env: dict[str, str] | None = None
) -> list[Any]:
    """Run the ``dist_workers`` function ``fn`` on 2 ranks (gloo) against S3 at ``upstream``
    through a fault proxy; once rank 0 says the healthy part is done (``root/ready``), hold
    every request (:data:`BLACKHOLE`) and tell the ranks (``root/outage-on``). Every rank's
    result; a rank's failure is raised."""
    import dist_workers

    res: list[Any] = []
    failed: list[BaseException] = []

    def run_ranks(endpoint: str) -> None:
        try:
            res.extend(
                dist_workers.run(
                    fn,
                    2,
                    root=str(root),
                    endpoint=endpoint,
                    bucket=bucket,
                    env={"TIERCKPT_LEASE_WAIT_S": str(WAIT_S), **(env or {})},
                    timeout=300,
                )
            )
        except BaseException as exc:
            failed.append(exc)

    with FaultProxy(upstream, timeout=30) as proxy:
        runner = threading.Thread(target=run_ranks, args=(proxy.endpoint_url,))
        runner.start()
        end = time.monotonic() + 240
        while not (root / "ready").exists():
            assert runner.is_alive() and time.monotonic() < end, "the healthy part never ended"
            time.sleep(0.05)
        proxy.set_faults(BLACKHOLE)
        (root / "outage-on").touch()
        runner.join(300)
        assert not runner.is_alive()
    if failed:
        raise failed[0]
    assert len(res) == 2, res
    return res


# -- outcome records for docs/reliability.md ----------------------------------------------

RECORD_ENV = "TIERCKPT_RELIABILITY_RECORD"


class Recorder:
    """Appends one JSON line per checked case to ``$TIERCKPT_RELIABILITY_RECORD`` (if set).

    ``category``: crash / disk_full / corruption / s3_faults / hostile / fuzz / soak.
    ``outcome``: what happened, in words ("restored step 12 (newest committed)", "FormatError").
    ``ok``: whether it is the required outcome (nothing lost, clear error).
    """

    def __init__(self, test: str) -> None:
        self.test = test
        self.path = os.environ.get(RECORD_ENV)

    def __call__(
        self, category: str, case: str, outcome: str, ok: bool = True, **extra: Any
    ) -> None:
        if not self.path:
            return
        rec = {
            "test": self.test,
            "category": category,
            "case": case,
            "outcome": outcome,
            "ok": ok,
            **extra,
        }
        line = json.dumps(rec, default=str) + "\n"
        with open(self.path, "a") as f:
            f.write(line)


@contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
