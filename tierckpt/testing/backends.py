"""``BackendTests``: the suite every storage backend must pass.

Subclass it in a test module (the subclass name must start with ``Test``) and supply a
``backend`` fixture that yields a fresh, empty backend::

    class TestMyBackend(BackendTests):
        @pytest.fixture
        def backend(self, tmp_path):
            yield MyBackend(tmp_path)

The tests only use the contract in :mod:`tierckpt.backends.base` and ask capabilities
(``supports_random_write``), never types.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import ClassVar

import pytest

from tierckpt.backends.base import Backend
from tierckpt.errors import CheckpointNotFound, FormatError, TierCkptError

__all__ = ["HOSTILE_NAMES", "BackendTests", "payload", "write_object"]

MiB = 2**20
HOSTILE_NAMES = ["../x", "/abs", "a//b", "a/./b", "", "a/../b", "..", "a/", "a b", "a\\b"]


def payload(size: int, seed: int = 0) -> bytes:
    """``size`` reproducible pseudo-random bytes (incompressible, unlike zeros)."""
    return random.Random(seed).randbytes(size)


def write_object(backend: Backend, name: str, data: bytes, pieces: list[int] | None = None) -> None:
    """Stream ``data`` into ``name`` in sequential writes of the given sizes, then commit."""
    writer = backend.open_writer(name)
    view = memoryview(data)
    pos = 0
    try:
        for n in pieces or []:
            writer.write(pos, view[pos : pos + n])
            pos += n
        if pos < len(data) or not pieces:
            writer.write(pos, view[pos:])
        writer.commit()
    except BaseException:
        writer.abort()
        raise


class BackendTests:
    """The shared backend suite; see the module docstring."""

    #: larger than any part size in use (S3 parts are 5-8 MiB), so writers stream many parts
    large_size: ClassVar[int] = 13 * MiB + 12345
    #: whether an abandoned writer leaves something that ``cleanup_incomplete`` must find
    leaves_incomplete: ClassVar[bool] = False

    # -- writing ---------------------------------------------------------------------
    def test_round_trip_in_sequential_writes(self, backend: Backend) -> None:
        data = payload(self.large_size, seed=1)
        # smaller than a part, straddling part boundaries, larger than a part, one byte
        pieces = [1, 100, 5 * MiB + 3, 1, 7 * MiB]
        write_object(backend, "d/big", data, pieces)
        assert backend.size("d/big") == len(data)
        assert backend.get("d/big") == data
        out = bytearray(len(data))
        backend.read_into("d/big", 0, memoryview(out))
        assert out == data

    @pytest.mark.parametrize("size", [0, 1, 4096])
    def test_round_trip_small(self, backend: Backend, size: int) -> None:
        data = payload(size, seed=size)
        write_object(backend, "small", data)
        assert backend.size("small") == size
        assert backend.get("small") == data
        assert backend.exists("small")

    def test_write_accepts_any_buffer(self, backend: Backend) -> None:
        data = payload(10_000, seed=3)
        writer = backend.open_writer("buffers")
        writer.write(0, data[:10])
        writer.write(10, bytearray(data[10:5000]))
        writer.write(5000, memoryview(data)[5000:])
        writer.commit()
        assert backend.get("buffers") == data

    def test_nothing_visible_before_commit(self, backend: Backend) -> None:
        data = payload(self.large_size, seed=4)
        writer = backend.open_writer("pending/obj")
        try:
            writer.write(0, data[: len(data) // 2])
            writer.write(len(data) // 2, data[len(data) // 2 :])
            assert not backend.exists("pending/obj")
            assert backend.list() == []
            with pytest.raises(CheckpointNotFound):
                backend.size("pending/obj")
            writer.commit()
        finally:
            writer.abort()  # a no-op after commit
        assert backend.list() == ["pending/obj"]
        assert backend.get("pending/obj") == data

    def test_commit_replaces_existing_object(self, backend: Backend) -> None:
        write_object(backend, "obj", b"old contents")
        writer = backend.open_writer("obj")
        writer.write(0, b"new")
        assert backend.get("obj") == b"old contents"
        writer.commit()
        assert backend.get("obj") == b"new"

    def test_abort_leaves_nothing(self, backend: Backend) -> None:
        writer = backend.open_writer("aborted")
        writer.write(0, payload(self.large_size, seed=5))
        writer.abort()
        writer.abort()  # idempotent
        assert not backend.exists("aborted")
        assert backend.list() == []
        assert backend.cleanup_incomplete() == 0  # no temp file, no open multipart upload

    def test_abort_before_any_write(self, backend: Backend) -> None:
        writer = backend.open_writer("never")
        writer.abort()
        assert backend.list() == []

    def test_write_after_commit_or_abort_raises(self, backend: Backend) -> None:
        writer = backend.open_writer("closed")
        writer.write(0, b"abc")
        writer.commit()
        with pytest.raises(TierCkptError):
            writer.write(3, b"d")
        other = backend.open_writer("closed2")
        other.abort()
        with pytest.raises(TierCkptError):
            other.write(0, b"x")
        with pytest.raises(TierCkptError):
            other.commit()
        assert backend.list() == ["closed"]

    def test_non_sequential_write_refused(self, backend: Backend) -> None:
        if backend.supports_random_write:
            pytest.skip("backend accepts random writes")
        writer = backend.open_writer("seq")
        try:
            writer.write(0, b"abc")
            with pytest.raises(TierCkptError):
                writer.write(10, b"hole")
            with pytest.raises(TierCkptError):
                writer.write(0, b"again")
        finally:
            writer.abort()

    def test_concurrent_writers(self, backend: Backend) -> None:
        size = 6 * MiB + 7
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                write_object(backend, f"t{i}/obj", payload(size, seed=100 + i), [MiB] * 3)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert backend.list() == [f"t{i}/obj" for i in range(4)]
        for i in range(4):
            assert backend.get(f"t{i}/obj") == payload(size, seed=100 + i)

    def test_cleanup_incomplete_removes_leftovers(self, backend: Backend) -> None:
        write_object(backend, "kept", b"committed")
        writer = backend.open_writer("crashed/obj")
        writer.write(0, payload(self.large_size, seed=6))  # then the process "dies"
        removed = backend.cleanup_incomplete()
        if self.leaves_incomplete:
            assert removed >= 1
        assert backend.cleanup_incomplete() == 0
        assert backend.list() == ["kept"]
        writer.abort()  # the dead writer's abort still must not raise

    # -- atomic puts -----------------------------------------------------------------
    def test_put_atomic_create_only(self, backend: Backend) -> None:
        backend.put_atomic("m/manifest.json", b"first")
        with pytest.raises(FileExistsError):
            backend.put_atomic("m/manifest.json", b"second")
        assert backend.get("m/manifest.json") == b"first"

    def test_put_atomic_overwrite(self, backend: Backend) -> None:
        backend.put_atomic("rec", b"first")
        backend.put_atomic("rec", memoryview(b"second"), overwrite=True)
        assert backend.get("rec") == b"second"
        backend.put_atomic("fresh", bytearray(b"x"), overwrite=True)
        assert backend.get("fresh") == b"x"

    def test_put_atomic_empty(self, backend: Backend) -> None:
        backend.put_atomic("empty", b"")
        assert backend.size("empty") == 0
        assert backend.get("empty") == b""

    # -- reading ---------------------------------------------------------------------
    def test_ranged_reads(self, backend: Backend) -> None:
        n = self.large_size
        data = payload(n, seed=7)
        write_object(backend, "r", data, [3 * MiB] * 4)
        ranges = [
            (0, 1),
            (1, 1),
            (3, 17),
            (5 * MiB - 1, 2),  # across a part boundary
            (5 * MiB + 1, 5 * MiB + 3),  # spans parts, larger than a part
            (8 * MiB - 5, 10),
            (n - 1, 1),
            (7, n - 7),  # nearly everything: split into parallel reads
            (0, n),
        ]
        for offset, length in ranges:
            got = backend.read("r", offset, length)
            assert bytes(got) == data[offset : offset + length], (offset, length)
            out = bytearray(length)
            backend.read_into("r", offset, memoryview(out))
            assert out == data[offset : offset + length], (offset, length)

    def test_read_into_fills_a_view_in_place(self, backend: Backend) -> None:
        data = payload(3 * MiB, seed=8)
        write_object(backend, "v", data)
        big = bytearray(b"\xee" * (4 * MiB))
        backend.read_into("v", 11, memoryview(big)[100 : 100 + 2 * MiB])
        assert big[:100] == b"\xee" * 100
        assert big[100 : 100 + 2 * MiB] == data[11 : 11 + 2 * MiB]
        assert big[100 + 2 * MiB :] == b"\xee" * (2 * MiB - 100)

    def test_read_past_end_raises_format_error(self, backend: Backend) -> None:
        write_object(backend, "short", b"0123456789")
        with pytest.raises(FormatError):
            backend.read("short", 5, 6)
        with pytest.raises(FormatError):
            backend.read("short", 10, 1)
        with pytest.raises(FormatError):
            backend.read("short", 100, 4)
        with pytest.raises(FormatError):
            backend.read_into("short", 8, memoryview(bytearray(3)))
        write_object(backend, "zero", b"")
        with pytest.raises(FormatError):
            backend.read("zero", 0, 1)

    def test_missing_object(self, backend: Backend) -> None:
        for call in (
            lambda: backend.read("missing", 0, 1),
            lambda: backend.read_into("missing", 0, memoryview(bytearray(4))),
            lambda: backend.size("missing"),
            lambda: backend.modified("missing"),
            lambda: backend.get("d/missing"),
        ):
            with pytest.raises(CheckpointNotFound):
                call()
            with pytest.raises(FileNotFoundError):
                call()
        assert not backend.exists("missing")

    def test_modified_is_the_stores_clock(self, backend: Backend) -> None:
        """Modification times, where the store keeps them, are of its writes and move
        forward: a lease is judged by two of them (tierckpt.lease.store_age)."""
        import time

        backend.put_atomic("leases/a", b"x")
        first = backend.modified("leases/a")
        if first is None:  # a store without times: the age of leases alone decides
            return
        assert abs(first - time.time()) < 120  # this machine's clock is the store's, roughly
        time.sleep(1.1)  # Last-Modified counts whole seconds
        backend.put_atomic("leases/a", b"y", overwrite=True)
        second = backend.modified("leases/a")
        assert second is not None and second > first

    # -- listing and deleting --------------------------------------------------------
    def test_list_with_prefixes(self, backend: Backend) -> None:
        names = ["b", "a", "d/z", "d/a", "d/e/f", "da", "e-1/x_2.bin"]
        for name in names:
            backend.put_atomic(name, name.encode())
        writer = backend.open_writer("d/uncommitted")
        writer.write(0, b"zz")
        try:
            assert backend.list() == sorted(names)
            assert backend.list("d/") == ["d/a", "d/e/f", "d/z"]
            assert backend.list("d") == ["d/a", "d/e/f", "d/z", "da"]
            assert backend.list("d/e") == ["d/e/f"]
            assert backend.list("nothing") == []
            # the first names only (a store stops listing there): the sorted list's head
            assert backend.list_first("d", 2) == ["d/a", "d/e/f"]
            assert backend.list_first("", 100) == sorted(names)
            assert backend.list_first("nothing", 5) == []
        finally:
            writer.abort()

    def test_delete(self, backend: Backend) -> None:
        backend.put_atomic("d/x", b"1")
        backend.delete("d/x")
        assert not backend.exists("d/x")
        assert backend.list() == []
        backend.delete("d/x")  # missing is fine
        backend.delete("never/was")

    # -- names -----------------------------------------------------------------------
    def test_hostile_names_refused(self, backend: Backend) -> None:
        for name in HOSTILE_NAMES:
            for call in _name_calls(backend, name):
                with pytest.raises(FormatError):
                    call()
        assert backend.list() == []


def _name_calls(backend: Backend, name: str) -> list[Callable[[], object]]:
    """Every call that takes an object name."""
    return [
        lambda: backend.open_writer(name),
        lambda: backend.put_atomic(name, b"x"),
        lambda: backend.read(name, 0, 1),
        lambda: backend.read_into(name, 0, memoryview(bytearray(1))),
        lambda: backend.size(name),
        lambda: backend.delete(name),
    ]
