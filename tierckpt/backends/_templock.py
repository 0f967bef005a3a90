"""Whether a temporary file (``<name>.<hex>.tmp``) still has a writer: every writer of one
holds an exclusive ``flock`` on it from its creation until it is renamed into place or
removed, so a temporary nobody holds a lock on is dead (its writer was killed: the kernel
drops the lock with the process), whoever wrote it — this process, another rank, a peer pull.

The writer locks right after its create-only open and then checks that the path still names
the file it opened: a sweep that found the file in between, unlocked, and removed it makes the
writer start again under a new name, never write into a removed file.

Only where ``flock`` is known to be the kernel's own lock on a local file system (tmpfs, ext4,
xfs, btrfs, ...). On a network file system a lock may be kept on the client alone (NFS's
``local_lock``, CIFS, FUSE), so a writer on another machine would not be seen: there nothing
is proven dead and nothing is removed (:func:`locks_prove_liveness` is False).
"""

from __future__ import annotations

import fcntl
import os
import sys

from tierckpt._libc import fs_magic

__all__ = ["hold_new_temp", "locks_prove_liveness", "remove_dead_temps"]

#: statfs magics of local file systems whose flock is the kernel's own, seen by every process
_LOCAL_FS = frozenset(
    {
        0x01021994,  # tmpfs (/dev/shm: node RAM)
        0x858458F6,  # ramfs
        0xEF53,  # ext2/3/4
        0x58465342,  # xfs
        0x9123683E,  # btrfs
        0x794C7630,  # overlayfs (containers)
        0x2FC12FC1,  # zfs
        0xF2F52010,  # f2fs
    }
)


def locks_prove_liveness(path: str) -> bool:
    """Whether a temporary file's lock under ``path`` says whether its writer lives."""
    return sys.platform.startswith("linux") and fs_magic(path) in _LOCAL_FS


def hold_new_temp(fd: int, path: str) -> bool:
    """Lock the temporary file just created as ``path`` on ``fd`` (held until ``fd`` is
    closed); False if a sweep removed it before the lock was taken (the caller closes ``fd``
    and creates another)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep removes it (microseconds)
    except OSError:
        # no flock here (Lustre mounted without -o flock: ENOSYS; NFS without its lock
        # service: ENOLCK): write unlocked. A sweep removes only what it could lock
        # itself, which fails the same way there, so this file is never taken for dead.
        return True
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def remove_dead_temps(folder: str, target: str) -> tuple[int, int]:
    """Remove the temporaries of ``target`` (``<target>.<hex>.tmp`` in ``folder``) that no
    writer holds; returns (removed, held by a live writer). Where a lock proves nothing
    (:func:`locks_prove_liveness`), nothing is removed and nothing counted."""
    removed, left, _unknown = judge_temps(folder, target, remove=True)
    return removed, left


def judge_temps(folder: str, target: str, *, remove: bool) -> tuple[int, int, int]:
    """The temporaries of ``target`` in ``folder``: (no writer holds them: removed where
    ``remove``, else only counted; held by a live writer; cannot tell, where a lock proves
    nothing). Without ``remove`` nothing is changed: a shared lock is tried and dropped at
    once (a writer holds an exclusive one from its creation), so ``gc --dry-run`` asks the
    sweep's own question."""
    dead = left = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, 0, 0
    temps = [n for n in names if n.endswith(".tmp") and n[:-4].rsplit(".", 1)[0] == target]
    if not temps:
        return 0, 0, 0
    if not locks_prove_liveness(folder):
        return 0, 0, len(temps)  # cannot tell: left for a sweep when nothing writes there
    for name in temps:
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue  # renamed into place or removed meanwhile
        try:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if remove else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            except BlockingIOError:
                left += 1  # its writer holds it: alive
                continue
            if not remove:
                dead += 1
                continue
            st, mine = os.stat(path), os.fstat(fd)
            if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                os.unlink(path)  # while locked: a writer that opened it cannot be past its check
                dead += 1
        except OSError:
            left += 1
        finally:
            os.close(fd)
    return dead, left, 0
