"""Node RAM runs: how much memory a run's folder takes, which runs still live, and removing
the folders of dead ones (:class:`~tierckpt.NodeRamTier` opens with :func:`clean_dead_runs`).

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

import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass

from tierckpt.errors import FormatError
from tierckpt.lease import LEASE_DIR, LeaseRecord, LiveLock, owner_status, parse_lease_name

__all__ = [
    "DEFAULT_STALE_AFTER_S",
    "NAMESPACE_RE",
    "REPLICA_SUFFIX",
    "DeadRun",
    "OpenMark",
    "clean_dead_runs",
    "node_ram_usage",
    "remove_dead_marks",
]

log = logging.getLogger("tierckpt")

#: the folder beside a run's node-RAM folder that holds replicas of partners' shards
REPLICA_SUFFIX = ".replicas"
DEFAULT_STALE_AFTER_S = 600.0
NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


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


class OpenMark:
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
    """The :class:`OpenMark` records in ``leases_dir``: (path, whether its process runs;
    None: unreadable, so nobody can tell)."""
    try:
        names = os.listdir(leases_dir)
    except OSError:
        return []
    out: list[tuple[str, bool | None]] = []
    for f in names:
        if not (f.startswith(OpenMark.PREFIX) and f.endswith(".json")):
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
    """Whether a process that opened the run folder may still run (its :class:`OpenMark`)."""
    return any(alive is not False for _path, alive in _open_marks(leases_dir, now))


def remove_dead_marks(leases_dir: str) -> None:
    for path, alive in _open_marks(leases_dir, time.time()):
        if alive is False:
            for f in (path, path.removesuffix(".json") + ".live"):
                try:
                    os.unlink(f)
                except OSError:
                    pass


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
        if ns == keep or ns in seen or not NAMESPACE_RE.match(ns):
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
