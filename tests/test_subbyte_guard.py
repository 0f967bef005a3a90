"""Sub-byte dtypes (``torch.uint1..7``, ``torch.int1..7``) under ``guard()``.

A tensor the guard does not cover is copied at ``save()``; the copy kernel refuses the sub-byte
dtypes, so their bytes are copied as bytes, keeping dtype, shape and stride. The copy is what
makes the checkpoint the state at ``save()``: a write to the tensor right after ``save()`` must
not reach the checkpoint. To make that race certain, the tier's writes are held until the
tensor has been changed: the capture, stuck behind a small arena full of a 64 MiB weight laid
out first, cannot reach the sub-byte tensor before.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_eager_buffers import _GATES, _Gate, _GatedTier

from tierckpt import Checkpointer
from tierckpt.snapshot import snapshot_eager

MIB = 1 << 20
ARENA = dict(host_buffer_bytes=16 * MIB, chunk_bytes=4 * MIB)

SUBBYTE = [getattr(torch, f"{k}{n}") for k in ("uint", "int") for n in range(1, 8)]


def _subbyte(dtype: torch.dtype, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor of ``dtype`` over ``n`` random bytes, and those bytes (same storage)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    return raw.view(dtype), raw


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s elements as bytes: the same view over the same storage, as uint8."""
    v = torch.empty(0, dtype=torch.uint8)
    v.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return v.clone()


@pytest.mark.parametrize("dtype", SUBBYTE, ids=str)
def test_snapshot_copies_subbyte_tensors_as_bytes(dtype: torch.dtype) -> None:
    q, raw = _subbyte(dtype, 24)  # contiguous, alone on its storage
    grid, graw = _subbyte(dtype, 24, seed=1)
    cols = grid.view(4, 6)[:, 1::2]  # not contiguous, alone on its storage
    other, oraw = _subbyte(dtype, 16, seed=2)
    shared = [other[:8], other[8:]]  # two views of one storage
    tensors = [q.view(4, 6), cols, *shared]
    want = [_bytes(t) for t in tensors]
    snap = snapshot_eager(tensors, set())
    assert snap.eager_tensors == 4
    for r in (raw, graw, oraw):
        r.add_(1)  # the sources change; the copies must not
    for t, w, c in zip(tensors, want, snap.tensors, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.stride() == t.stride()
        assert c.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(_bytes(c), w)
    # views of one storage stay views of one (copied) storage
    a, b = snap.tensors[2:]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.uint4, torch.int1, torch.uint7], ids=str)
def test_guarded_save_of_a_subbyte_tensor_is_the_state_at_save(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4096, 4096, bias=False)  # 64 MiB, laid out before the tensor
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    q, raw = _subbyte(dtype, 64)
    q = q.view(8, 8)
    want = raw.clone()
    tier = _GatedTier(tmp_path)
    gate = _Gate()
    _GATES[tier.path] = gate
    with Checkpointer([tier], **ARENA) as ck:
        ck.guard(opt, model)
        gate.event.clear()
        h = ck.save({"model": model.state_dict(), "q": q}, 1)
        raw.add_(1)  # the loop writes it right after save(), before any capture
        assert not h.captured  # held by the gate
        gate.event.set()
        h.wait()
        loaded = ck.load(1)
    got = loaded["q"]
    assert got.dtype == dtype and got.shape == (8, 8)
    assert torch.equal(got.view(torch.uint8).flatten(), want)
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
    assert h.eager_bytes == 64  # only the sub-byte tensor was copied at save()
