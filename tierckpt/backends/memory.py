"""Host-RAM backend: objects live in a dict shared by every backend of the same namespace.

Fast and not durable: a committed object survives a new ``Checkpointer`` in the same
process (same ``namespace``) but not the death of the process.
"""

from __future__ import annotations

import threading

from tierckpt._types import BytesLike
from tierckpt.backends.base import Backend, ObjectWriter, validate_name
from tierckpt.errors import CheckpointNotFound, FormatError

__all__ = ["MemoryBackend"]

_spaces_lock = threading.Lock()
_spaces: dict[str, dict[str, bytes | bytearray]] = {}


class _MemoryWriter(ObjectWriter):
    def __init__(self, backend: MemoryBackend, name: str) -> None:
        super().__init__(name)
        self._backend = backend
        self._buf: bytearray | None = bytearray()

    def write(self, offset: int, data: BytesLike) -> None:
        if self._buf is None:
            raise FormatError(f"memory:{self.name}: write after commit/abort")
        view = memoryview(data).cast("B")
        end = offset + len(view)
        if offset > len(self._buf):
            self._buf.extend(b"\0" * (offset - len(self._buf)))
        if end > len(self._buf):
            self._buf.extend(b"\0" * (end - len(self._buf)))
        self._buf[offset:end] = view
        self.size = max(self.size, end)

    def commit(self) -> None:
        if self._buf is None:
            raise FormatError(f"memory:{self.name}: commit after commit/abort")
        self._backend._store(self.name, self._buf)
        self._buf = None

    def abort(self) -> None:
        self._buf = None


class MemoryBackend(Backend):
    def __init__(self, namespace: str = "default") -> None:
        self.namespace = namespace
        self.url = f"memory://{namespace}"
        with _spaces_lock:
            self._objects = _spaces.setdefault(namespace, {})
        self._lock = threading.Lock()

    @property
    def supports_random_write(self) -> bool:
        return True

    @property
    def supports_conditional_put(self) -> bool:
        return True

    def _store(self, name: str, data: bytes | bytearray) -> None:
        with self._lock:
            self._objects[name] = data

    def open_writer(self, name: str) -> ObjectWriter:
        return _MemoryWriter(self, validate_name(name))

    def put_atomic(self, name: str, data: BytesLike, *, overwrite: bool = False) -> None:
        validate_name(name)
        with self._lock:
            if not overwrite and name in self._objects:
                raise FileExistsError(f"{self.url}/{name} already exists")
            self._objects[name] = bytes(data)

    def _get(self, name: str) -> bytes | bytearray:
        validate_name(name)
        with self._lock:
            obj = self._objects.get(name)
        if obj is None:
            raise CheckpointNotFound(f"{self.url}/{name} does not exist")
        return obj

    def read(self, name: str, offset: int, length: int) -> BytesLike:
        obj = self._get(name)
        if offset < 0 or length < 0 or offset + length > len(obj):
            raise FormatError(
                f"{self.url}/{name}: read of {length} bytes at {offset} past its end ({len(obj)})"
            )
        return memoryview(obj)[offset : offset + length]

    def size(self, name: str) -> int:
        return len(self._get(name))

    def list(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(n for n in self._objects if n.startswith(prefix))

    def delete(self, name: str) -> None:
        validate_name(name)
        with self._lock:
            self._objects.pop(name, None)

    @staticmethod
    def clear_namespace(namespace: str) -> None:
        """Drop every object of ``namespace`` (tests, or to free RAM)."""
        with _spaces_lock:
            space = _spaces.get(namespace)
            if space is not None:
                space.clear()
