"""A Hypothesis state machine that drives a backend and a plain dict the same way.

Every rule applies one operation (``put_atomic``, a streamed write that commits or aborts,
``delete``, ``read``, ``list``) to both and checks they agree; an invariant compares the full
listing after every step. Use :func:`run_backend_state_machine` with a factory that returns the
backend under test (the machine empties it before each example; the caller closes it)::

    def test_stateful(tmp_path):
        run_backend_state_machine(LocalBackend(tmp_path))
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from tierckpt.backends.base import Backend
from tierckpt.errors import CheckpointNotFound, FormatError

__all__ = ["BackendStateMachine", "run_backend_state_machine"]

NAMES = st.sampled_from(["a", "b", "a.b", "d/a", "d/b", "d/e/f", "e-1/x_2"])
PREFIXES = st.sampled_from(["", "a", "d", "d/", "d/e", "e", "z"])
DATA = st.binary(max_size=48)
PIECES = st.lists(st.binary(max_size=24), max_size=4)


class BackendStateMachine(RuleBasedStateMachine):
    """Compares a backend with a dict; ``backend`` is set by the runner."""

    backend: Backend

    def __init__(self) -> None:
        super().__init__()
        for name in self.backend.list():
            self.backend.delete(name)
        self.backend.cleanup_incomplete()
        self.model: dict[str, bytes] = {}

    @rule(name=NAMES, data=DATA, overwrite=st.booleans())
    def put_atomic(self, name: str, data: bytes, overwrite: bool) -> None:
        if not overwrite and name in self.model:
            try:
                self.backend.put_atomic(name, data)
            except FileExistsError:
                return
            raise AssertionError(f"put_atomic({name!r}) replaced an existing object")
        self.backend.put_atomic(name, data, overwrite=overwrite)
        self.model[name] = data

    @rule(name=NAMES, pieces=PIECES, commit=st.booleans())
    def stream(self, name: str, pieces: list[bytes], commit: bool) -> None:
        writer = self.backend.open_writer(name)
        offset = 0
        for piece in pieces:
            writer.write(offset, piece)
            offset += len(piece)
        # the old object (or its absence) is what readers see until commit
        assert self.backend.exists(name) == (name in self.model)
        if commit:
            writer.commit()
            self.model[name] = b"".join(pieces)
        else:
            writer.abort()

    @rule(name=NAMES)
    def delete(self, name: str) -> None:
        self.backend.delete(name)
        self.model.pop(name, None)

    @rule(name=NAMES, data=st.data())
    def read(self, name: str, data: st.DataObject) -> None:
        if name not in self.model:
            try:
                self.backend.read(name, 0, 1)
            except CheckpointNotFound:
                return
            raise AssertionError(f"read of missing {name!r} did not raise CheckpointNotFound")
        stored = self.model[name]
        offset = data.draw(st.integers(0, len(stored) + 2), label="offset")
        length = data.draw(st.integers(1, len(stored) + 3), label="length")
        if offset + length > len(stored):
            try:
                self.backend.read(name, offset, length)
            except FormatError:
                return
            raise AssertionError(f"read past the end of {name!r} did not raise FormatError")
        assert bytes(self.backend.read(name, offset, length)) == stored[offset : offset + length]
        assert self.backend.size(name) == len(stored)

    @rule(prefix=PREFIXES)
    def list_prefix(self, prefix: str) -> None:
        assert self.backend.list(prefix) == sorted(n for n in self.model if n.startswith(prefix))

    @invariant()
    def listing_agrees(self) -> None:
        assert self.backend.list() == sorted(self.model)

    def teardown(self) -> None:
        for name in self.model:
            self.backend.delete(name)


def run_backend_state_machine(backend: Backend, *, max_examples: int = 12, steps: int = 15) -> None:
    """Run :class:`BackendStateMachine` against ``backend`` (bounded: a few seconds)."""
    machine = type("BackendStateMachineRun", (BackendStateMachine,), {"backend": backend})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
