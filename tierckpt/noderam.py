"""Node RAM: checkpoints in shared memory (``/dev/shm`` or another tmpfs) that outlive the
process that wrote them.

The in-process :class:`~tierckpt.MemoryTier` dies with its process. Most failures of a large
job kill processes, not machines (a GPU error, an NCCL timeout, an out-of-memory kill): torchrun
restarts every worker on the same nodes, and a tier in the node's shared memory is still there,
readable at memory speed. :class:`NodeRamTier` is a :class:`~tierckpt.LocalTier` whose folder
is on a tmpfs, with node-RAM defaults:

* the folder ``<path>/<namespace>`` (default path ``/dev/shm/tierckpt-<uid>``, namespace the
  torchrun run id ``TORCHELASTIC_RUN_ID``, else ``"default"``), so the restarted workers of a
  run find their predecessors' checkpoints, and two runs on a node never share one;
* ``keep_last=2``, raw chunks (no codec), no direct I/O (tmpfs refuses it);
* a byte **budget** (``max_bytes``, default half the tmpfs): a write that would take the
  tier's folders (its checkpoints, and the replicas of partners' shards that
  :class:`~tierckpt.PeerTier` keeps there) past it fails that save on this tier with
  ``BackendError`` (``ENOSPC``), before it takes the memory; the other tiers go on.

Commit is the local tier's (temporary name, rename, manifest last, create-only), each rank's
shard checked by its chunk checksums on read. In a multi-rank job the tier is *node-local*
(``Backend.is_node_local``): ranks on other nodes cannot read it, so the commit goes through
the process group's store like the RAM tier's (see :mod:`tierckpt.distributed`).

Memory: tmpfs pages are the node's RAM (shared memory, counted in the page cache and in a
container's memory limit), in addition to the host arena (``host_buffer_bytes``, the staging
buffer saves are copied through) and to the training process's own memory. The tier holds at
most ``max_bytes``; to keep ``keep_last`` checkpoints it needs ``keep_last + 1`` times the
node's share of a checkpoint (the newest one is written before the oldest is deleted), plus
the replicas it keeps for partners, plus, on a rank about to pull its shard from a partner,
the spare segment the pull receives into (:mod:`tierckpt.peer._spare`).

Restore without a copy (``map=True``, the default): a load maps the shard copy-on-write and
returns tensors over the mapping (:mod:`tierckpt.noderam_map`). While a loaded state is alive
it holds its segment's tmpfs pages, also after retention deleted the file; the budget counts
those bytes (in the process that maps them) until the state is dropped.

Dead runs
    The folders of a run whose processes are gone take the node's RAM until someone removes
    them: :func:`clean_dead_runs` removes every run folder under the tier's path (never its own)
    whose writer leases (:mod:`tierckpt.lease`) all belong to processes that no longer run and
    whose files were not touched for ``stale_after_s`` (default 600 s, so that torchrun has
    time to restart a failed run before another run on the node reclaims its memory). It runs
    when a ``NodeRamTier`` is opened and from ``tierckpt gc --dead-runs PATH``. A live run's
    files, and the folder of the run being opened, are never touched. A run is live while a
    process has its folder open, not only while one holds a writer lease: a restarted worker
    takes its lease at its first save, and until then (a load, then training for as long as the
    save interval) the mark it leaves on opening the tier (``leases/open-<pid>-<n>.json``, with
    a lock file the kernel lets go when the process ends: :mod:`tierckpt.liveness`) tells.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

from tierckpt import config
from tierckpt._types import BytesLike
from tierckpt.backends._templock import remove_dead_temps
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import BackendError, FormatError
from tierckpt.lease import LEASE_DIR, LeaseRecord, LiveLock, owner_status, parse_lease_name
from tierckpt.locations import folder_location
from tierckpt.noderam_map import unlinked_mapped_bytes
from tierckpt.policy import CodecSpec, TierSpec

__all__ = [
    "REPLICA_SUFFIX",
    "DeadRun",
    "NodeRamBackend",
    "NodeRamTier",
    "clean_dead_runs",
    "default_node_ram_path",
    "default_namespace",
    "node_ram_usage",
]

log = logging.getLogger("tierckpt")

#: the folder beside a run's node-RAM folder that holds replicas of partners' shards
REPLICA_SUFFIX = ".replicas"
DEFAULT_STALE_AFTER_S = 600.0
_NAMESPACE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def default_node_ram_path() -> str:
    """``/dev/shm/tierckpt-<uid>``: one folder per user, on the node's shared memory."""
    return f"/dev/shm/tierckpt-{os.getuid()}"


def default_namespace() -> str:
    """The run's folder name: torchrun's run id (the same for the restarted workers of a
    run), else ``"default"``."""
    run_id = config.torchelastic_run_id()
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)[:128]
    return clean if clean and clean != "none" else "default"


def _folder_bytes(path: str) -> int:
    """Bytes of memory the files under ``path`` take (allocated blocks, temporaries too)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(dirpath, f))
            except OSError:
                continue  # deleted meanwhile
            total += st.st_blocks * 512
    return total


def node_ram_usage(root: str) -> int:
    """Bytes a run's node-RAM folder ``root`` and its replica folder take."""
    return _folder_bytes(root) + _folder_bytes(root + REPLICA_SUFFIX)


class _BudgetWriter(ObjectWriter):
    """A local writer that refuses a write which would take the tier past its budget."""

    def __init__(self, backend: NodeRamBackend, inner: ObjectWriter) -> None:
        super().__init__(inner.name)
        self._backend = backend
        self._inner = inner

    def write(self, offset: int, data: BytesLike) -> None:
        n = memoryview(data).nbytes
        self._backend.check_budget(n, self.name)
        self._inner.write(offset, data)
        self.size = self._inner.size

    def commit(self) -> None:
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _OpenMark:
    """This process's mark on a run folder it opened: a record naming the process and a lock
    file it holds (``leases/open-<pid>-<hex>.json`` and ``.live``), so that
    :func:`clean_dead_runs` in another process sees the run live before its first save (a
    restarted worker has loaded, but holds no writer lease yet). Removed at :meth:`release`;
    the kernel lets the lock go when the process dies."""

    PREFIX = "open-"

    def __init__(self, root: str) -> None:
        stem = os.path.join(root, LEASE_DIR, f"{self.PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        self._record = stem + ".json"
        self._lock = LiveLock(stem + ".live")
        try:
            held = self._lock.take()
            data = LeaseRecord.mine("open", ttl=1.0, live=held).encode()
            tmp = self._record + ".tmp"
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, self._record)
        except OSError as exc:  # a courtesy to other runs' cleaners: never fail the job for it
            log.debug("node RAM %s: no open mark: %s", root, exc)

    def release(self) -> None:
        try:
            os.unlink(self._record)
        except OSError:
            pass
        self._lock.release()


def _open_marks(leases_dir: str, now: float) -> list[tuple[str, bool | None]]:
    """The :class:`_OpenMark` records in ``leases_dir``: (path, whether its process runs;
    None: unreadable, so nobody can tell)."""
    try:
        names = os.listdir(leases_dir)
    except OSError:
        return []
    out: list[tuple[str, bool | None]] = []
    for f in names:
        if not (f.startswith(_OpenMark.PREFIX) and f.endswith(".json")):
            continue
        path = os.path.join(leases_dir, f)
        try:
            with open(path, "rb") as fh:
                rec = LeaseRecord.decode(fh.read(), where=path)
        except FileNotFoundError:
            continue  # released meanwhile
        except (OSError, FormatError):
            out.append((path, None))
            continue
        out.append((path, owner_status(rec, now)[0]))
    return out


def _opened_by_live_process(leases_dir: str, now: float) -> bool:
    """Whether a process that opened the run folder may still run (its :class:`_OpenMark`)."""
    return any(alive is not False for _path, alive in _open_marks(leases_dir, now))


def _remove_dead_marks(leases_dir: str) -> None:
    for path, alive in _open_marks(leases_dir, time.time()):
        if alive is False:
            for f in (path, path.removesuffix(".json") + ".live"):
                try:
                    os.unlink(f)
                except OSError:
                    pass


class NodeRamBackend(LocalBackend):
    """A :class:`LocalBackend` on a tmpfs with a byte budget; node-local.

    ``budget_root``: the run folder whose usage (with its replica folder) counts against
    ``max_bytes`` (the replica backends of :mod:`tierckpt.peer` share their run's budget).
    ``map_reads``: a load maps raw shards copy-on-write instead of reading them
    (:mod:`tierckpt.noderam_map`).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_bytes: int,
        budget_root: str | None = None,
        map_reads: bool = False,
    ) -> None:
        super().__init__(root, direct_io=False)
        self.url = f"noderam:{self.root}"
        self.max_bytes = max_bytes
        self.budget_root = os.path.abspath(budget_root) if budget_root else self.root
        self.map_reads = map_reads
        self._open_mark: _OpenMark | None = None

    def mark_open(self) -> None:
        """Leave this process's mark in the run folder until :meth:`close` (:class:`_OpenMark`),
        so that no other run's cleaner takes the folder for a dead run's meanwhile; the marks
        of processes that died are removed."""
        if self._open_mark is None:
            _remove_dead_marks(os.path.join(self.root, LEASE_DIR))
            self._open_mark = _OpenMark(self.root)

    def close(self) -> None:
        mark, self._open_mark = self._open_mark, None
        if mark is not None:
            mark.release()
        super().close()

    @property
    def is_node_local(self) -> bool:
        return True

    def usage(self) -> int:
        """The run's node-RAM bytes: its files, and the segments this process still maps
        (a load's tensors) whose files retention deleted, whose pages tmpfs frees only when
        the mapping goes."""
        roots = [self.budget_root, self.budget_root + REPLICA_SUFFIX]
        return node_ram_usage(self.budget_root) + unlinked_mapped_bytes(roots)

    def mapped_path(self, name: str) -> str:
        """The file of object ``name``, for a load that maps it (``map_reads``)."""
        return self._path(name)

    def check_budget(self, more: int, name: str) -> None:
        """Raise ``BackendError`` (ENOSPC) if ``more`` bytes would take the run past budget."""
        used = self.usage()
        if used + more > self.max_bytes and self._remove_dead_temps():
            used = self.usage()  # a killed writer's partial files took the room
        if used + more > self.max_bytes:
            raise BackendError(
                errno.ENOSPC,
                f"{self.url}/{name}: node RAM budget exceeded: {used} bytes in use + {more} "
                f"more > max_bytes={self.max_bytes}. The tier needs keep_last + 1 checkpoints "
                "of this node's ranks (plus partners' replicas): raise max_bytes or lower "
                "keep_last",
            )

    def open_writer(self, name: str) -> ObjectWriter:
        return _BudgetWriter(self, super().open_writer(name))

    def _remove_dead_temps(self) -> int:
        """Remove the run's temporary files that no live writer holds (a writer killed
        midway: retention removes them only at its next sweep, after a save failed for want
        of the room they take); returns how many went."""
        removed = 0
        for root in (self.budget_root, self.budget_root + REPLICA_SUFFIX):
            for dirpath, _dirs, files in os.walk(root):
                targets = {f[:-4].rsplit(".", 1)[0] for f in files if f.endswith(".tmp")}
                for target in targets:
                    removed += remove_dead_temps(dirpath, target)[0]
        return removed


@dataclass(frozen=True, slots=True, init=False)
class NodeRamTier(TierSpec):
    """Checkpoints in the node's shared memory: they survive a crashed or restarted process
    (not a lost node: add :class:`~tierckpt.PeerTier` for that). See :mod:`tierckpt.noderam`.

    ``path``: the tmpfs folder holding runs (default ``/dev/shm/tierckpt-<uid>``);
    ``namespace``: this run's folder in it (default: torchrun's run id); ``max_bytes``: the
    budget (default half of the tmpfs); ``stale_after_s``: how long a dead run's folder is left
    before opening this tier removes it (``None``: never on open). ``map`` (default True): a
    load returns tensors over a copy-on-write mapping of the shard in node RAM instead of a
    copy of it (raw chunks; see :mod:`tierckpt.noderam_map`): a restore costs the mapping and
    the checksums; writes to the tensors go to private pages, never to the checkpoint.

    Retention as on the other tiers (``keep_last``, ``keep_every_n_steps``, ``keep_best`` by
    ``best_metric``/``best_mode``, pins), decided from the manifests in node RAM, so a
    restarted worker keeps the same ones. What a rule keeps stays inside ``max_bytes``:
    retention never deletes a kept checkpoint to make room, so once kept checkpoints fill the
    budget, saves fail on this tier (``BackendError``, ENOSPC) while the slower tiers go on.
    """

    path: str = ""
    namespace: str = "default"
    max_bytes: int = 0
    stale_after_s: float | None = DEFAULT_STALE_AFTER_S
    map: bool = True

    def __init__(
        self,
        *,
        keep_last: int | None = 2,
        every: int = 1,
        path: str | os.PathLike[str] | None = None,
        namespace: str | None = None,
        max_bytes: int | None = None,
        stale_after_s: float | None = DEFAULT_STALE_AFTER_S,
        codec: CodecSpec = "raw",
        name: str = "noderam",
        keep_every_n_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: Literal["min", "max"] = "min",
        map: bool = True,
    ) -> None:
        base = os.path.abspath(os.fspath(path)) if path is not None else default_node_ram_path()
        ns = default_namespace() if namespace is None else namespace
        if not isinstance(ns, str) or not _NAMESPACE.match(ns):
            raise ValueError(f"NodeRamTier namespace must match [A-Za-z0-9_-]{{1,128}}, got {ns!r}")
        if max_bytes is None:
            max_bytes = _half_of_filesystem(base)
        if type(max_bytes) is not int or max_bytes < 1:
            raise ValueError(f"NodeRamTier max_bytes must be an int >= 1, got {max_bytes!r}")
        if stale_after_s is not None and not stale_after_s >= 0:
            raise ValueError(f"NodeRamTier stale_after_s must be >= 0 or None: {stale_after_s!r}")
        object.__setattr__(self, "path", base)
        object.__setattr__(self, "namespace", ns)
        object.__setattr__(self, "max_bytes", max_bytes)
        object.__setattr__(self, "stale_after_s", stale_after_s)
        object.__setattr__(self, "map", bool(map))
        object.__setattr__(self, "source", None)
        object.__setattr__(self, "max_behind", 2)
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "keep_last", keep_last)
        object.__setattr__(self, "every", every)
        object.__setattr__(self, "codec", codec)
        object.__setattr__(self, "keep_every_n_steps", keep_every_n_steps)
        object.__setattr__(self, "keep_best", keep_best)
        object.__setattr__(self, "best_metric", best_metric)
        object.__setattr__(self, "best_mode", best_mode)
        TierSpec.__post_init__(self)

    @property
    def root(self) -> str:
        """This run's folder."""
        return os.path.join(self.path, self.namespace)

    def location(self) -> tuple[str, Hashable] | None:
        """This run's folder in node RAM, comparable with a local tier's folder."""
        return folder_location(self.root)

    def make_backend(self) -> Backend:
        if self.stale_after_s is not None:
            try:
                clean_dead_runs(self.path, stale_after_s=self.stale_after_s, keep=self.namespace)
            except OSError as exc:  # cleaning is a courtesy: never fail the job for it
                log.warning("node RAM %s: could not clean dead runs: %s", self.path, exc)
        backend = NodeRamBackend(self.root, max_bytes=self.max_bytes, map_reads=self.map)
        backend.mark_open()
        return backend


def _half_of_filesystem(path: str) -> int:
    probe = path
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return max(1, st.f_blocks * st.f_frsize // 2)


# -- dead runs ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeadRun:
    """A run folder :func:`clean_dead_runs` removed (or would remove) and why."""

    namespace: str
    bytes: int
    why: str


def _run_liveness(root: str, now: float, stale_after_s: float) -> str | None:
    """Why the run folder ``root`` is dead, or None while it may be live (or restarted)."""
    newest = 0.0
    for dirpath, _dirs, files in os.walk(root):
        for f in [".", *files]:
            try:
                newest = max(newest, os.lstat(os.path.join(dirpath, f)).st_mtime)
            except OSError:
                continue
    leases_dir = os.path.join(root, LEASE_DIR)
    owners: list[str] = []
    if os.path.isdir(leases_dir):
        if _opened_by_live_process(leases_dir, now):
            return None  # a restarted worker that has not saved yet, or a reader
        for f in sorted(os.listdir(leases_dir)):
            if parse_lease_name(f"{LEASE_DIR}/{f}") is None:
                continue
            try:
                with open(os.path.join(leases_dir, f), "rb") as fh:
                    rec = LeaseRecord.decode(fh.read(), where=os.path.join(leases_dir, f))
            except (OSError, FormatError):
                return None  # unreadable: nobody can tell, so it stays
            alive, why = owner_status(rec, now)
            if alive:
                return None
            owners.append(f"{f}: {why}")
    idle = now - newest
    if idle < stale_after_s:
        return None
    writers = "; ".join(owners[:3]) if owners else "no writer lease"
    return f"every writer is gone ({writers}) and nothing changed for {idle:.0f} s"


def clean_dead_runs(
    path: str | os.PathLike[str],
    *,
    stale_after_s: float = DEFAULT_STALE_AFTER_S,
    keep: str | None = None,
    dry_run: bool = False,
) -> list[DeadRun]:
    """Remove the node-RAM folders of dead runs under ``path`` (see the module docstring).

    ``keep``: a namespace never removed (the run being opened). A run is dead when every
    writer lease in its folder belongs to a process that no longer runs (judged as
    :func:`tierckpt.lease.owner_status` does) and no file in it changed for ``stale_after_s``
    seconds. Returns what was removed (``dry_run``: what would be).
    """
    base = os.path.abspath(os.fspath(path))
    if not os.path.isdir(base):
        return []
    now = time.time()
    out: list[DeadRun] = []
    seen: set[str] = set()
    for entry in sorted(os.listdir(base)):
        if entry.endswith(REPLICA_SUFFIX):
            ns = entry[: -len(REPLICA_SUFFIX)]
            if os.path.isdir(os.path.join(base, ns)) or ns == keep:
                continue  # goes (or stays) with its run's folder
        else:
            ns = entry
        if ns == keep or ns in seen or not _NAMESPACE.match(ns):
            continue
        seen.add(ns)
        root = os.path.join(base, ns)
        why = _run_liveness(root, now, stale_after_s) if os.path.isdir(root) else None
        if why is None and os.path.isdir(root):
            continue
        if why is None:  # a replica folder whose run folder is gone
            if not os.path.isdir(root + REPLICA_SUFFIX):
                continue
            why = _run_liveness(root + REPLICA_SUFFIX, now, stale_after_s)
            if why is None:
                continue
        size = node_ram_usage(root)
        out.append(DeadRun(ns, size, why))
        if dry_run:
            continue
        log.warning("node RAM %s: removing dead run %r (%d bytes): %s", base, ns, size, why)
        for folder in (root, root + REPLICA_SUFFIX):
            shutil.rmtree(folder, ignore_errors=True)
    return out
