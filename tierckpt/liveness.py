"""Whether a writer still runs: its process on this machine, or its lock file on this kernel.

A writer lease (:mod:`tierckpt.lease`) names its holder's host name, boot id, PID namespace
and process. Seen from the same PID namespace, the PID answers: ``/proc/<pid>`` with the same
start time (:func:`process_start`). From anywhere else it says nothing, and the lease could
only be judged by its age. That is wrong for a container restarted on its node: it runs in a
new PID namespace, so the crashed container's lease looked like another machine's, and the
restarted job's first saves failed with ``WriterConflict`` until the ttl had passed.

So a writer with a local folder among its tiers also holds an ``flock`` on a lock file there
(:class:`LiveLock`: ``leases/rank-<r>.live``, removed at ``close()``) for as long as it holds
leases, and names that file (path, device, inode) in every lease it writes. The kernel drops
the lock when the process ends, however it ends, and it answers every PID namespace alike. A
checker on the same kernel (same boot id) that opens the same file (same device and inode)
asks the kernel with :func:`probe`: locked means a process there still runs, unlocked means
the writer is gone. Anything else (another machine, another file at that path, a file system without
``flock``) cannot tell, and the lease's age decides as before.

A process forked from the holder (a data loader's workers) closes its copy of the lock's file
descriptor at once, so that it does not keep a dead writer's lock alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import math
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tierckpt import config
from tierckpt.errors import FormatError

__all__ = [
    "HostIdentity",
    "LeaseRecord",
    "LiveLock",
    "LockId",
    "owner_status",
    "owner_verdict",
    "probe",
    "process_start",
]

log = logging.getLogger("tierckpt")

LEASE_FORMAT = "tierckpt-lease"
LEASE_VERSION = 1
MAX_LEASE_BYTES = 64 << 10
MAX_TTL = config.LEASE_MAX_S

#: how long :meth:`LiveLock.take` retries while another checker's probe holds the file
_TAKE_TRIES = 5
_TAKE_PAUSE_S = 0.01


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """What tells one machine (and PID namespace) from another: two containers on one kernel
    share the boot id but not the PID namespace, so a PID means the same process only when
    all three agree."""

    host: str
    boot_id: str
    pid_ns: str

    @staticmethod
    @functools.cache
    def current() -> HostIdentity:
        try:
            pid_ns = os.readlink("/proc/self/ns/pid")
        except OSError:
            pid_ns = ""
        return HostIdentity(socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pid_ns)


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/<pid>/stat`` field 22),
    or None when no such process runs (a zombie counts as gone)."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ")"
    fields = stat[stat.rfind(")") + 2 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class LockId:
    """A lock file as a lease names it: its absolute path and the file's device and inode
    (a path alone could name another file in another container's mounts)."""

    path: str
    dev: int
    ino: int


#: every lock file object of this process: what it holds tells :func:`probe` its own locks
_locks: weakref.WeakSet[LiveLock] = weakref.WeakSet()


def _held() -> list[LockId]:
    """The locks this process holds."""
    return [lock for live in list(_locks) if (lock := live.held) is not None]


class LiveLock:
    """This writer's lock file: taken (non-blocking) before it writes a lease, held while it
    holds any, let go at :meth:`release`. Thread-safe."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        self._fd: int | None = None
        self._id: LockId | None = None
        self._guard = threading.Lock()
        _locks.add(self)

    @property
    def held(self) -> LockId | None:
        return self._id

    def take(self) -> LockId | None:
        """The lock's id once this process holds it, or None when it cannot be taken now
        (another process holds it, the folder cannot be written, or no ``flock`` there).
        Never raises: without the lock a writer's lease is judged by its age alone."""
        with self._guard:
            if self._id is not None:
                return self._id
            for attempt in range(_TAKE_TRIES):
                got = self._try_take()
                if got is not False:
                    return got if isinstance(got, LockId) else None
                if attempt + 1 < _TAKE_TRIES:  # a checker's probe holds it for an instant
                    time.sleep(_TAKE_PAUSE_S)
            return None

    def _try_take(self) -> LockId | bool:
        """The id (taken), False (locked by another process) or True (cannot be used)."""
        if any(lock.path == self.path for lock in _held()):
            # another writer of this process holds it: not even opened, since where flock is
            # emulated with POSIX locks (NFS) closing any descriptor of the file in a process
            # drops every lock the process holds on it
            return True
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            log.debug("lock file %s cannot be opened: %s", self.path, exc)
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except OSError as exc:  # a file system without flock
            os.close(fd)
            log.debug("lock file %s cannot be locked: %s", self.path, exc)
            return True
        try:
            st, now = os.fstat(fd), os.stat(self.path)
        except OSError:  # removed by its holder's release meanwhile: try again
            os.close(fd)
            return False
        if (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino):
            os.close(fd)  # the file was replaced under this path meanwhile: try again
            return False
        self._fd, self._id = fd, LockId(self.path, st.st_dev, st.st_ino)
        return self._id

    def release(self) -> None:
        """Remove the lock file, then let the lock go (closing the file drops it). Removed
        while still locked: a writer that opened it before locks a file no longer at the
        path, sees so in :meth:`take` and tries again."""
        with self._guard:
            if self._fd is None or self._id is None:
                return
            fd, mine, self._fd, self._id = self._fd, self._id, None, None
            try:
                now = os.stat(self.path)
                if (now.st_dev, now.st_ino) == (mine.dev, mine.ino):
                    os.unlink(self.path)
            except OSError:
                pass  # gone already, or a read-only folder: the lock is let go all the same
            os.close(fd)

    def _forget_in_child(self) -> None:
        # closing the child's copy leaves the parent's lock held; the parent's threads that
        # may have held the guard at the fork do not exist here
        self._guard = threading.Lock()
        fd, self._fd, self._id = self._fd, None, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def _after_fork_in_child() -> None:
    for lock in list(_locks):
        lock._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def probe(lock: LockId) -> bool | None:
    """Whether a process on this kernel holds ``lock``: True (it does), False (none does),
    None (cannot tell: no such file here, another file at that path, or no ``flock``). A lock
    this process holds itself is held by no other process, so it answers False."""
    if any((mine.dev, mine.ino) == (lock.dev, lock.ino) for mine in _held()):
        return False
    try:
        fd = os.open(lock.path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (lock.dev, lock.ino):
            return None
        try:  # shared: two checkers probing at once do not take each other for the writer
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return None
        return False
    finally:
        os.close(fd)  # drops the shared lock


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """The content of ``leases/rank-<r>.json`` (see ``docs/format.md``)."""

    owner: str
    host: str
    boot_id: str
    pid_ns: str
    pid: int
    pid_start: int | None
    started: float
    renewed: float
    ttl: float
    #: the holder's lock file (tierckpt.liveness), "" when it holds none
    live_path: str = ""
    live_dev: int = 0
    live_ino: int = 0

    @staticmethod
    def mine(
        owner: str, ttl: float, started: float | None = None, live: LockId | None = None
    ) -> LeaseRecord:
        me, now, pid = HostIdentity.current(), time.time(), os.getpid()
        start = now if started is None else started
        lock = live or LockId("", 0, 0)
        return LeaseRecord(
            owner,
            me.host,
            me.boot_id,
            me.pid_ns,
            pid,
            process_start(pid),
            start,
            now,
            ttl,
            lock.path,
            lock.dev,
            lock.ino,
        )

    @property
    def live(self) -> LockId | None:
        return LockId(self.live_path, self.live_dev, self.live_ino) if self.live_path else None

    def encode(self) -> bytes:
        body: dict[str, Any] = {"format": LEASE_FORMAT, "version": LEASE_VERSION}
        body.update(dataclasses.asdict(self))
        return json.dumps(body, sort_keys=True, indent=1).encode("utf-8")

    @staticmethod
    def decode(data: bytes, *, where: str) -> LeaseRecord:
        if len(data) > MAX_LEASE_BYTES:
            raise FormatError(f"{where}: lease object of {len(data)} bytes is not a lease")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise FormatError(f"{where}: not a tierckpt lease (invalid JSON: {exc})") from None
        if not isinstance(body, dict) or body.get("format") != LEASE_FORMAT:
            raise FormatError(f"{where}: not a tierckpt lease (format is not {LEASE_FORMAT!r})")
        if body.get("version") != LEASE_VERSION:
            raise FormatError(
                f"{where}: lease version {body.get('version')!r} is not {LEASE_VERSION}; it was "
                "written by another tierckpt version — upgrade tierckpt"
            )

        def get(key: str, typ: type | tuple[type, ...]) -> Any:
            v = body.get(key)
            if not isinstance(v, typ) or isinstance(v, bool):
                raise FormatError(f"{where}: lease field {key!r} is missing or of the wrong type")
            return v

        start = body.get("pid_start")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise FormatError(f"{where}: lease field 'pid_start' is of the wrong type")
        ttl = float(get("ttl", (int, float)))
        if not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL):
            raise FormatError(f"{where}: lease ttl {ttl!r} outside (0, {MAX_TTL:.0f}]")
        live = ("", 0, 0)
        if body.get("live_path"):  # absent from leases written before the lock files
            live = (get("live_path", str), get("live_dev", int), get("live_ino", int))
        return LeaseRecord(
            get("owner", str),
            get("host", str),
            get("boot_id", str),
            get("pid_ns", str),
            get("pid", int),
            start,
            float(get("started", (int, float))),
            float(get("renewed", (int, float))),
            ttl,
            *live,
        )

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"host {self.host or '?'}, pid {self.pid}, started {started}, last renewed "
            f"{max(0.0, now - self.renewed):.0f} s ago (ttl {self.ttl:.0f} s)"
        )


def owner_status(rec: LeaseRecord, now: float | None = None) -> tuple[bool, str]:
    """(alive, why) for the owner of ``rec``, judged from this process (module docstring)."""
    alive, why, _by_age = owner_verdict(rec, now)
    return alive, why


def _pids_comparable(rec: LeaseRecord, me: HostIdentity) -> bool:
    """Whether ``rec``'s pid names a process of this host, kernel and PID namespace."""
    return bool(
        rec.host == me.host and rec.boot_id and (rec.boot_id, rec.pid_ns) == (me.boot_id, me.pid_ns)
    )


def in_this_process(rec: LeaseRecord) -> bool:
    """Whether ``rec``'s writer is (was) an object of this very process."""
    return _pids_comparable(rec, HostIdentity.current()) and rec.pid == os.getpid()


#: the leases this process's closed writers could not delete, by (owner, location):
#: "releasing" while the release is in flight (it may still delete the lease), "released"
#: once it failed (the lease stays until its ttl: the store did not answer)
_closed: dict[tuple[str, str], str] = {}
_closed_lock = threading.Lock()


@contextlib.contextmanager
def releasing(owner: str, where: str) -> Iterator[None]:
    """Around a writer's release of its lease at ``where`` (backend url / lease name): a later
    writer of this process judges it by :data:`_closed`, not as a live writer of this process
    (a close() while the store hung left the lease; the next Checkpointer was refused)."""
    key = (owner, where)
    with _closed_lock:
        _closed[key] = "releasing"
    try:
        yield
    except BaseException:
        with _closed_lock:
            _closed[key] = "released"
        raise
    with _closed_lock:
        _closed.pop(key, None)


def reopened(owner: str, where: str) -> None:
    """``owner`` holds its lease at ``where`` again (taken after a release that failed)."""
    with _closed_lock:
        _closed.pop((owner, where), None)


def _closed_verdict(rec: LeaseRecord, where: str) -> tuple[bool, str, bool] | None:
    with _closed_lock:
        state = _closed.get((rec.owner, where))
    if state == "released":
        why = "it is a writer of this process closed while the store did not answer"
        return False, why + " (its lease could not be deleted then)", False
    if state == "releasing":
        why = (
            "it is a writer of this process being closed: its lease is still being given back "
            "(the store is slow to answer); the next save asks again"
        )
        return True, why, True
    return None


def owner_verdict(
    rec: LeaseRecord, now: float | None = None, where: str = ""
) -> tuple[bool, str, bool]:
    """:func:`owner_status` and whether the lease's age decided it (its holder's clock
    against this machine's: no process or lock file here could answer). ``where``: the
    lease's location (backend url / name), to know this process's closed writers' leases."""
    now = time.time() if now is None else now
    me = HostIdentity.current()
    if _pids_comparable(rec, me):
        start = process_start(rec.pid)
        if start is None:
            return False, f"its process {rec.pid} no longer runs on this host", False
        if rec.pid_start is not None and start != rec.pid_start:
            why = f"its process {rec.pid} ended (the pid now belongs to another process)"
            return False, why, False
        if rec.pid == os.getpid():
            closed = _closed_verdict(rec, where)
            return closed or (True, "it is another writer in this process", False)
        return True, "its process runs on this host", False
    if rec.boot_id and rec.boot_id == me.boot_id and rec.live is not None:
        held = probe(rec.live)  # another PID namespace on this kernel: a restarted container
        if held is False:
            why = f"no process on this machine holds its lock file {rec.live_path} now"
            return False, why, False
        if held:
            return True, f"a process on this machine holds its lock file {rec.live_path}", False
    age = now - rec.renewed
    if age < rec.ttl:
        where = ""
        if rec.boot_id and rec.boot_id == me.boot_id:  # no lock file to ask
            where = (
                " it runs or ran on this machine under another PID namespace or host name "
                "(another container, or this one before a restart) and names no lock file this "
                "process can check;"
            )
        why = (
            f"it was renewed {max(age, 0.0):.0f} s ago, within its ttl of {rec.ttl:.0f} s;{where} "
            f"dead or not, it counts as live for {rec.ttl - max(age, 0.0):.0f} s more unless "
            "renewed"
        )
        return True, why, True
    return False, f"it was not renewed for {age:.0f} s (ttl {rec.ttl:.0f} s)", True
