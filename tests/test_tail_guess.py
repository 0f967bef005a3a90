"""How much of a shard file's end a load reads for its footer and index.

A remote load reads the footer and index in one read of the file's end, sized by a guess that a
larger index seen earlier in the process raises (up to 8 MiB). Unbounded, that guess made every
later load read a small file's end far past its index (a file of a few MiB read nearly whole,
once for the index and again for its chunks), and it applied to local files too, where saving a
round trip saves nothing: a throttled local tier then measured a compressed load no faster than
the raw link (seen as a failing ``test_a_slow_link_keeps_the_tier_compressing`` in the full
suite, after a test with a large index ran first). The guess is now bounded by 1/16 of the file
(at least 256 KiB) and used only on remote stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.base import Backend
from tierckpt.backends.local import LocalBackend
from tierckpt.restore import _index


class TailSpy(LocalBackend):
    """A local folder that records every ``read_tail`` length and may claim to be remote."""

    remote = False
    tails: ClassVar[list[tuple[int, int]]] = []

    @property
    def is_remote(self) -> bool:
        return self.remote

    def read_tail(self, name: str, length: int) -> tuple[int, Any]:
        size, data = super().read_tail(name, length)
        TailSpy.tails.append((size, len(memoryview(data).cast("B"))))
        return size, data


class SpyTier(LocalTier):
    def make_backend(self) -> Backend:
        return TailSpy(self.path)


@pytest.fixture
def big_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a load of a checkpoint with a huge index earlier in this process."""
    monkeypatch.setattr(_index, "_tail_guess", _index.MAX_TAIL_READ_BYTES)
    TailSpy.tails = []


def _save_load(root: Path, remote: bool) -> dict[str, Any]:
    TailSpy.remote = remote
    state = {"w": torch.randn(1 << 20), "b": torch.randn(1000)}  # a ~4 MiB file
    with Checkpointer([SpyTier(root, keep_last=None)]) as ck:
        ck.save(state, 1).wait(timeout=120)
    with Checkpointer([SpyTier(root, keep_last=None)]) as ck:
        back = ck.load(step=1)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    return back


def test_a_local_load_reads_only_the_footer_whatever_the_guess(
    tmp_path: Path, big_guess: None
) -> None:
    _save_load(tmp_path, remote=False)
    assert TailSpy.tails, "the load did not read the file's end through read_tail"
    for _size, got in TailSpy.tails:
        assert got == _index.FOOTER_SIZE, TailSpy.tails


def test_a_remote_load_reads_at_most_a_sixteenth_of_a_small_file(
    tmp_path: Path, big_guess: None
) -> None:
    _save_load(tmp_path, remote=True)
    assert TailSpy.tails
    for size, got in TailSpy.tails:
        bound = max(_index.TAIL_READ_BYTES, size >> 4) + _index.FOOTER_SIZE
        assert size > 2 * bound  # the file is big enough for the bound to matter
        assert got <= bound, (size, got)
