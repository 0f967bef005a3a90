"""Host-RAM backend: objects live in a dict shared by every backend of the same namespace.

Fast and not durable: a committed object survives a new ``Checkpointer`` in the same
process (same ``namespace``) but not the death of the process.

An object is kept as the segments it was written in (no copy to join them), and the buffers
of deleted objects are recycled for new writes: fresh memory is slow to touch the first time
(~0.4 GB/s here against ~16 GB/s warm), and with retention the RAM tier deletes one
checkpoint for every one it adds.

The recycling pool holds what the next save can use and no more: a write takes the smallest
pooled buffer that fits it with at most a quarter to spare (the last chunk of a shard has a
new size whenever the state's size changes), the pool never holds more than the largest of
the last few objects written (one checkpoint: the tier's memory stays about ``keep_last + 1``
copies of the state), the oldest buffers going first, and it is dropped once the last
backend of the namespace is closed (the objects stay: a new ``Checkpointer`` loads them).
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from tierckpt import _native
from tierckpt._types import BytesLike
from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.errors import CheckpointNotFound, FormatError

__all__ = ["MemoryBackend"]

#: recycled buffers kept per namespace, in bytes, at most (the bound is lower: ``_Space.cap``)
POOL_BYTES = 4 << 30
#: buffers from this size on are recycled (a smaller one is cheap to allocate)
POOL_MIN_BYTES = 1 << 20
#: a write of n bytes takes a pooled buffer of at most n + n // POOL_SLACK bytes
POOL_SLACK = 4
#: the pool holds at most the largest of this many objects last written (one per save)
POOL_RECENT = 4
#: writes from this size on are copied with the GIL released (a slice assignment holds it for
#: the whole copy, and the training thread needs it between its ops: with one 85 MiB save per
#: step, a MemoryTier cost the training loop 1.18x with the slice copy, 1.08x with this one)
NOGIL_BYTES = 1 << 20


def _copy(buf: bytearray, view: memoryview) -> None:
    """``buf[:len(view)] = view`` (``buf`` may be longer), with the GIL released for a large
    copy."""
    n = len(view)
    if n < NOGIL_BYTES:
        buf[:n] = view
        return
    dst = int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)
    src = int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
    # the native streaming copy once it is built, else ctypes' memmove (it releases the GIL)
    (_native.copier() or ctypes.memmove)(dst, src, n)


@dataclass
class _Object:
    offsets: list[int] = field(default_factory=list)
    blobs: list[bytearray] = field(default_factory=list)
    #: bytes of each blob that hold data (a recycled blob may be longer)
    lengths: list[int] = field(default_factory=list)
    size: int = 0


@dataclass
class _Space:
    objects: dict[str, _Object] = field(default_factory=dict)
    #: recycled buffers: length -> {serial: buffer}, and the lengths present, sorted
    pool: dict[int, dict[int, bytearray]] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)
    #: serial -> length of every pooled buffer, oldest first (the first to go)
    order: dict[int, int] = field(default_factory=dict)
    serial: int = 0
    pooled: int = 0
    #: bytes of buffers of the last objects written (``POOL_RECENT``): what a save uses
    recent: deque[int] = field(default_factory=lambda: deque(maxlen=POOL_RECENT))
    #: backends of this namespace not yet closed
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def cap(self) -> int:
        """The most the pool holds: the largest object of the last ``POOL_RECENT`` written
        (what the next save can reuse), never more than ``POOL_BYTES``."""
        return min(POOL_BYTES, max(self.recent, default=0))

    def take(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes: the smallest pooled one that fits with at most
        ``n // POOL_SLACK`` to spare, else a fresh one."""
        if n >= POOL_MIN_BYTES:
            with self.lock:
                i = bisect.bisect_left(self.lengths, n)
                if i < len(self.lengths) and self.lengths[i] <= n + n // POOL_SLACK:
                    size = self.lengths[i]
                    bufs = self.pool[size]
                    key, buf = bufs.popitem()  # the newest of that size: warmest in cache
                    self._forget(size, key)
                    return buf
        return bytearray(n)

    def _forget(self, size: int, key: int) -> None:
        """Under the lock: buffer ``key`` of ``size`` bytes left the pool."""
        del self.order[key]
        self.pooled -= size
        if not self.pool[size]:
            del self.pool[size]
            del self.lengths[bisect.bisect_left(self.lengths, size)]

    def _trim(self, cap: int) -> None:
        """Under the lock: drop the oldest pooled buffers until at most ``cap`` bytes stay."""
        while self.pooled > cap:
            key, size = next(iter(self.order.items()))
            del self.pool[size][key]
            self._forget(size, key)

    def written(self, obj: _Object) -> None:
        """``obj`` was committed by a writer: it sets the pool's bound for the next saves."""
        with self.lock:
            self.recent.append(sum(len(b) for b in obj.blobs if len(b) >= POOL_MIN_BYTES))
            self._trim(self.cap)

    def give(self, obj: _Object) -> None:
        with self.lock:
            cap = self.cap
            for b in obj.blobs:
                if len(b) < POOL_MIN_BYTES or len(b) > cap:
                    continue
                self._trim(cap - len(b))  # the oldest make room for the newest
                self.serial += 1
                if len(b) not in self.pool:
                    self.pool[len(b)] = {}
                    bisect.insort(self.lengths, len(b))
                self.pool[len(b)][self.serial] = b
                self.order[self.serial] = len(b)
                self.pooled += len(b)

    def drop_pool(self) -> None:
        with self.lock:
            self._trim(0)

    def attach(self) -> None:
        with self.lock:
            self.users += 1

    def detach(self) -> None:
        """A backend of this namespace closed (or was collected): the last one drops the
        pool, which only a next save would use."""
        with self.lock:
            self.users -= 1
            if self.users <= 0:
                self._trim(0)


_spaces_lock = threading.Lock()
_spaces: dict[str, _Space] = {}


class _MemoryWriter(ObjectWriter):
    def __init__(self, space: _Space, url: str, name: str) -> None:
        super().__init__(name)
        self._space = space
        self._url = url
        self._obj: _Object | None = _Object()

    def write(self, offset: int, data: BytesLike) -> None:
        obj = self._obj
        if obj is None:
            raise FormatError(f"{self._url}/{self.name}: write after commit/abort")
        view = memoryview(data).cast("B")
        if offset < obj.size:
            raise FormatError(f"{self._url}/{self.name}: overlapping write at {offset}")
        buf = self._space.take(len(view))
        _copy(buf, view)
        obj.offsets.append(offset)
        obj.blobs.append(buf)
        obj.lengths.append(len(view))
        obj.size = offset + len(view)
        self.size = obj.size

    def commit(self) -> None:
        obj, self._obj = self._obj, None
        if obj is None:
            raise FormatError(f"{self._url}/{self.name}: commit after commit/abort")
        with self._space.lock:
            old = self._space.objects.get(self.name)
            self._space.objects[self.name] = obj
        self._space.written(obj)
        if old is not None:
            self._space.give(old)

    def abort(self) -> None:
        obj, self._obj = self._obj, None
        if obj is not None:
            self._space.give(obj)


class MemoryBackend(Backend):
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.url = f"memory://{namespace}"
        with _spaces_lock:
            self._space = _spaces.setdefault(namespace, _Space())
            self._space.attach()
        # closed, or collected unclosed: the last backend of the namespace drops its pool
        self._detach = weakref.finalize(self, self._space.detach)

    @property
    def supports_random_write(self) -> bool:
        return True  # forward holes (alignment padding) read back as zeros

    @property
    def supports_conditional_put(self) -> bool:
        return True

    def open_writer(self, name: str) -> ObjectWriter:
        return _MemoryWriter(self._space, self.url, validate_name(name))

    def put_atomic(self, name: str, data: BytesLike, *, overwrite: bool = False) -> None:
        validate_name(name)
        blob = bytearray(data)
        obj = _Object([0], [blob], [len(blob)], len(blob))
        with self._space.lock:
            if not overwrite and name in self._space.objects:
                raise FileExistsError(f"{self.url}/{name} already exists")
            self._space.objects[name] = obj

    def _get(self, name: str) -> _Object:
        validate_name(name)
        with self._space.lock:
            obj = self._space.objects.get(name)
        if obj is None:
            raise CheckpointNotFound(f"{self.url}/{name} does not exist")
        return obj

    def read(self, name: str, offset: int, length: int) -> BytesLike:
        obj = self._get(name)
        if offset < 0 or length < 0 or offset + length > obj.size:
            raise FormatError(
                f"{self.url}/{name}: read of {length} bytes at {offset} past its end ({obj.size})"
            )
        i = max(bisect.bisect_right(obj.offsets, offset) - 1, 0)
        if (
            obj.offsets
            and obj.offsets[i] <= offset
            and (offset + length <= obj.offsets[i] + obj.lengths[i])
        ):
            start = offset - obj.offsets[i]
            # a copy: the buffer may be recycled for a new write once the object is deleted
            return bytes(memoryview(obj.blobs[i])[start : start + length])
        out = bytearray(length)  # spans segments or holes: assemble
        for off, blob, n in zip(obj.offsets[i:], obj.blobs[i:], obj.lengths[i:], strict=True):
            if off >= offset + length:
                break
            a, b = max(off, offset), min(off + n, offset + length)
            if a < b:
                out[a - offset : b - offset] = memoryview(blob)[a - off : b - off]
        return out

    def size(self, name: str) -> int:
        return self._get(name).size

    def list(self, prefix: str = "") -> list[str]:
        with self._space.lock:
            return sorted(n for n in self._space.objects if n.startswith(prefix))

    def delete(self, name: str) -> None:
        validate_name(name)
        with self._space.lock:
            obj = self._space.objects.pop(name, None)
        if obj is not None:
            self._space.give(obj)

    def close(self) -> None:
        """The objects stay (a new backend of the namespace reads them); the recycled
        buffers go with the namespace's last open backend."""
        self._detach()

    @staticmethod
    def clear_namespace(namespace: str) -> None:
        """Drop every object of ``namespace`` and its recycled buffers."""
        with _spaces_lock:
            space = _spaces.pop(namespace, None)
        if space is not None:
            with space.lock:
                space.objects.clear()
            space.drop_pool()
