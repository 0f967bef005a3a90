"""``load(map_location=...)`` moves the state storage by storage: tensors that shared storage
when saved (a weight and its transposed view, a row, tied weights) still share one storage on
the target device, and each storage is copied once. Proven on the CPU with the meta device,
which takes the same code path as a GPU (a device other than the loaded one)."""

from __future__ import annotations

import uuid

import torch

from tierckpt import Checkpointer, MemoryTier


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(a.untyped_storage()._cdata == b.untyped_storage()._cdata)


def _state() -> dict[str, object]:
    w = torch.randn(32, 48)
    emb = torch.randn(100, 16)
    return {
        "w": w,
        "w_t": w.t(),
        "row": w[3],
        "enc": {"emb": emb},
        "dec": {"emb": emb},  # tied
        "other": torch.arange(10),
        "step": 4,
    }


def _check_sharing(got: dict, device: str) -> None:
    assert got["w"].device.type == device
    assert got["w_t"].shape == (48, 32) and got["w_t"].stride() == (1, 48)
    assert got["row"].storage_offset() == 3 * 48
    assert _same_storage(got["w"], got["w_t"]) and _same_storage(got["w"], got["row"])
    assert _same_storage(got["enc"]["emb"], got["dec"]["emb"])
    assert not _same_storage(got["w"], got["other"])


def test_map_location_to_another_device_keeps_views_sharing() -> None:
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        got = ck.load(map_location="meta")
    _check_sharing(got, "meta")
    assert got["step"] == 4


def test_map_location_cpu_keeps_views_sharing_and_values() -> None:
    state = _state()
    with Checkpointer([MemoryTier(namespace=uuid.uuid4().hex)], chunk_bytes=8192) as ck:
        ck.save(state, step=1).wait()
        got = ck.load(map_location="cpu")
    _check_sharing(got, "cpu")
    for k in ("w", "w_t", "row", "other"):
        assert torch.equal(got[k], state[k])  # type: ignore[arg-type]
    got["w"][3, 0] = 1234.0  # one storage: the row sees the write
    assert got["row"][0] == 1234.0
