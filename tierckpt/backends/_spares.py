"""Retired shard files kept for the next save to overwrite (local tiers).

A checkpoint that retention retires frees its shard file; the next save writes a new file of
about the same size. Writing into fresh blocks and freeing the old ones costs more than
overwriting blocks that are already allocated: measured on this project's VM disk (ext4
mounted with ``discard``, a thin-provisioned virtual disk), an 85 MiB file took 449 ms as a new
file + fsync + unlink of the retired one and 262 ms overwritten in place, and a training loop
running beside the writes slowed by 1.24x vs 1.17x (docs/benchmarks.md, thirteenth session).
Freeing blocks sends discards to the device; allocating them makes a thin disk allocate.

So a local tier's backend (``LocalBackend(recycle=True)``, what :class:`~tierckpt.LocalTier`
uses) *parks* a large file it is asked to delete: it renames it into ``.spare/`` under the
tier's root, and the next shard file it writes takes a parked file by renaming it to its
temporary name and overwriting it (zeroing what the new file does not write, truncating
what it does not reach).

Why this loses nothing committed:

- a file is parked only when retention deletes it, after the checkpoint's manifest is gone,
  so it is no longer part of any committed checkpoint;
- before a parked file can be overwritten, the folders whose entries this backend removed
  since the last park (the manifest's among them) are fsynced, and so are the file's old
  folder and ``.spare/``: a crash cannot bring back a manifest whose data was overwritten;
- a parked file's name ends in ``.tmp`` and lies outside every checkpoint folder, so no
  listing sees it; a taken one is the new file's temporary, committed as any other;
- a save that finds no space frees every parked file and retries its write once;
- ``close()`` deletes this backend's parked files; a process that died holding some leaves
  them to the next backend on that root, which deletes those of dead processes. Deleting a
  file another process has parked only makes that process write a fresh file (taking one
  is a rename, which then fails).

At most :data:`MAX_SPARES` files are parked per backend; a retired file smaller than
:data:`RECYCLE_MIN` is deleted as before. A reader still reading a retired checkpoint (its
manifest read before retention deleted it) loses the file by name as before; one caught
mid-read while the file is overwritten gets a checksum error, never wrong data.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading

__all__ = ["MAX_SPARES", "RECYCLE_MIN", "SPARE_DIR", "SparePool"]

#: the folder under a local tier's root that holds parked files
SPARE_DIR = ".spare"
#: files smaller than this are deleted, not parked
RECYCLE_MIN = 8 << 20
#: most files one backend keeps parked (a save takes one; retention parks about one per save)
MAX_SPARES = 2
_SUFFIX = ".tmp"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: alive
    return True


class SparePool:
    """The parked files of one local backend (thread-safe)."""

    def __init__(self, root: str, enabled: bool) -> None:
        self.dir = os.path.join(root, SPARE_DIR)
        self.enabled = enabled
        #: files smaller than this are deleted, not parked (tests lower it)
        self.min_size = RECYCLE_MIN
        self._lock = threading.Lock()
        self._spares: list[str] = []
        #: folders with entries removed since the last park (fsynced before a park is usable)
        self._unsynced: set[str] = set()
        self._remove_dead()

    def _remove_dead(self) -> None:
        """Delete the parked files of processes that are gone."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        for name in names:
            pid = name.split("-", 1)[0]
            if name.endswith(_SUFFIX) and pid.isdigit() and not _alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)  # only if empty

    def removed(self, path: str) -> None:
        """Note that the entry ``path`` was removed (its folder is fsynced at the next park)."""
        if self.enabled:
            with self._lock:
                self._unsynced.add(os.path.dirname(path))

    def park(self, path: str) -> bool:
        """Park the file at ``path`` instead of deleting it; False: delete it as before (too
        small, pool full, not possible here)."""
        if not self.enabled:
            return False
        try:
            if os.stat(path).st_size < self.min_size:
                return False
        except OSError:
            return False
        with self._lock:
            if len(self._spares) >= MAX_SPARES:
                return False
            dirs, self._unsynced = self._unsynced | {os.path.dirname(path), self.dir}, set()
        spare = os.path.join(self.dir, f"{os.getpid()}-{secrets.token_hex(6)}{_SUFFIX}")
        try:
            os.makedirs(self.dir, exist_ok=True)
            os.rename(path, spare)
        except OSError:
            with self._lock:
                self._unsynced |= dirs
            return False
        try:
            for d in sorted(dirs):
                with contextlib.suppress(FileNotFoundError):
                    _fsync_dir(d)
        except OSError:
            # the removals may not be durable: never overwrite this file (it is gone by
            # name already, which is what the caller asked for)
            with contextlib.suppress(OSError):
                os.unlink(spare)
            return True
        with self._lock:
            self._spares.append(spare)
        return True

    def take(self, dest: str) -> bool:
        """Rename a parked file to ``dest`` (a new temporary name); False: none to take."""
        while True:
            with self._lock:
                if not self._spares:
                    return False
                spare = self._spares.pop()
            try:
                os.rename(spare, dest)
                return True
            except FileNotFoundError:
                continue  # deleted under us (a sweep, another backend's start): the next one
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(spare)

    def drop_all(self) -> int:
        """Delete every file this backend parked; returns how many there were."""
        with self._lock:
            spares, self._spares = self._spares, []
        for spare in spares:
            with contextlib.suppress(OSError):
                os.unlink(spare)
        if self.enabled:
            with contextlib.suppress(OSError):
                os.rmdir(self.dir)  # only if empty (another backend's may be there)
        return len(spares)

    def __len__(self) -> int:
        with self._lock:
            return len(self._spares)
