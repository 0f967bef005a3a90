"""Node RAM: checkpoints in shared memory (``/dev/shm`` or another tmpfs) that outlive the
process that wrote them.

The in-process :class:`~tierckpt.MemoryTier` dies with its process. Most failures of a large
job kill processes, not machines (a GPU error, an NCCL timeout, an out-of-memory kill): torchrun
restarts every worker on the same nodes, and a tier in the node's shared memory is still there,
readable at memory speed. :class:`NodeRamTier` is a :class:`~tierckpt.LocalTier` whose folder
is on a tmpfs, with node-RAM defaults:

* the folder ``<path>/<namespace>`` (default path ``/dev/shm/tierckpt-<uid>``, namespace the
  torchrun run id ``TORCHELASTIC_RUN_ID``; without one, ``default-<hash>`` of the run's other
  tiers' locations, its local folders and object-store prefixes; with none of those either,
  ``"default"``, with a warning), so the restarted workers of a run find their predecessors'
  checkpoints, and two runs on a node never share one;
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
    See :mod:`tierckpt.noderam_runs`: opening a ``NodeRamTier`` removes the folders of runs
    whose processes are gone, never a live run's.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import logging
import os
import re
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from tierckpt import config
from tierckpt._types import BytesLike
from tierckpt.backends._templock import remove_dead_temps
from tierckpt.backends.base import Backend, ObjectWriter
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import BackendError
from tierckpt.lease import LEASE_DIR
from tierckpt.locations import folder_location
from tierckpt.noderam_map import unlinked_mapped_bytes
from tierckpt.noderam_runs import (
    DEFAULT_STALE_AFTER_S,
    NAMESPACE_RE,
    REPLICA_SUFFIX,
    DeadRun,
    OpenMark,
    clean_dead_runs,
    node_ram_usage,
    remove_dead_marks,
)
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


def default_node_ram_path() -> str:
    """``/dev/shm/tierckpt-<uid>``: one folder per user, on the node's shared memory."""
    return f"/dev/shm/tierckpt-{os.getuid()}"


def default_namespace() -> str:
    """The run's folder name: torchrun's run id (the same for the restarted workers of a
    run), else ``"default"``."""
    run_id = config.torchelastic_run_id()
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", run_id)[:128]
    return clean if clean and clean != "none" else "default"


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
        self._open_mark: OpenMark | None = None

    def mark_open(self) -> None:
        """Leave this process's mark in the run folder until :meth:`close` (:class:`OpenMark`),
        so that no other run's cleaner takes the folder for a dead run's meanwhile; the marks
        of processes that died are removed."""
        if self._open_mark is None:
            remove_dead_marks(os.path.join(self.root, LEASE_DIR))
            self._open_mark = OpenMark(self.root)

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
    #: no namespace given and no torchrun run id: the job's other tiers name it (:meth:`for_run`)
    auto_namespace: bool = False
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
        if not isinstance(ns, str) or not NAMESPACE_RE.match(ns):
            raise ValueError(f"NodeRamTier namespace must match [A-Za-z0-9_-]{{1,128}}, got {ns!r}")
        if max_bytes is None:
            max_bytes = _half_of_filesystem(base)
        if type(max_bytes) is not int or max_bytes < 1:
            raise ValueError(f"NodeRamTier max_bytes must be an int >= 1, got {max_bytes!r}")
        if stale_after_s is not None and not stale_after_s >= 0:
            raise ValueError(f"NodeRamTier stale_after_s must be >= 0 or None: {stale_after_s!r}")
        object.__setattr__(self, "path", base)
        object.__setattr__(self, "namespace", ns)
        object.__setattr__(self, "auto_namespace", namespace is None and ns == "default")
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

    def for_run(self, tiers: Sequence[TierSpec]) -> TierSpec:
        """With no namespace given and no torchrun run id, the namespace ``default-<hash>`` of
        the other tiers' locations (local folders, object-store prefixes): a job restarted
        with the same tiers finds its checkpoints, and a job with other tiers does not load
        them (every such job shared ``"default"`` and loaded the newest job's state)."""
        if not self.auto_namespace:
            return self
        wheres = sorted(
            loc[0]
            for t in tiers
            if not isinstance(t, NodeRamTier)
            and (loc := t.location()) is not None
            and not (isinstance(loc[1], tuple) and loc[1][:1] == ("memory",))
        )
        if not wheres:
            log.warning(
                "NodeRamTier: no namespace= and no torchrun run id (TORCHELASTIC_RUN_ID), and "
                "no other tier to name the run by: it uses node RAM namespace 'default', "
                "which every such job of this user on this node shares (a job started here "
                "loads the last one's checkpoint). Pass NodeRamTier(namespace=...)"
            )
            return self
        digest = hashlib.sha256("\n".join(wheres).encode()).hexdigest()[:12]
        named = copy.copy(self)
        object.__setattr__(named, "namespace", f"default-{digest}")
        log.info("node RAM namespace %s (named by this run's tiers: %s)", named.namespace, wheres)
        object.__setattr__(named, "auto_namespace", False)
        return named

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
