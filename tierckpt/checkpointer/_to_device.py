"""``load(map_location=...)``: the loaded state moved to a device storage by storage, so that
tensors that shared storage when saved (a weight and its transposed view, tied embeddings)
share it on the device too, and each storage crosses the bus once.

A load onto a GPU reads there directly (:mod:`tierckpt.restore_gpu`), so its tensors arrive
on the device and are left as they are. Otherwise, onto a GPU from host memory the storages
are copied with ``non_blocking=True`` (asynchronous from pinned memory, so copies of
consecutive storages overlap with queueing the next) and the calling thread waits once at the
end, on the device's current stream.
"""

from __future__ import annotations

from typing import Any

import torch

from tierckpt import devices

__all__ = ["to_device"]


def to_device(state: Any, device: torch.device) -> Any:
    """``state`` with every tensor on ``device``; views of one storage stay views of one.
    Tensors already there (a load onto the GPU put them there) are left as they are."""
    device = devices.indexed(device)  # plain "cuda": the current device, as torch means it
    moved: dict[int, torch.UntypedStorage] = {}
    cuda = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device == device or (
            device.index is None and t.device.type == device.type and device.type != "cuda"
        ):
            return t
        st = t.untyped_storage()
        key = st._cdata
        new = moved.get(key)
        if new is None:
            src = torch.empty(0, dtype=torch.uint8, device=t.device)
            src.set_(st, 0, (st.nbytes(),), (1,))
            dst = torch.empty(st.nbytes(), dtype=torch.uint8, device=device)
            dst.copy_(src, non_blocking=cuda and src.is_pinned())
            new = dst.untyped_storage()
            moved[key] = new
        out = torch.empty(0, dtype=t.dtype, device=new.device)
        out.set_(new, t.storage_offset(), t.shape, t.stride())
        return out

    def walk(x: Any) -> Any:
        if isinstance(x, torch.nn.Parameter):  # keep the type and requires_grad, as .to() won't
            return torch.nn.Parameter(move(x.detach()), requires_grad=x.requires_grad)
        if isinstance(x, torch.Tensor):  # a leaf that requires grad stays one
            return move(x.detach()).requires_grad_(x.requires_grad)
        if isinstance(x, dict):
            return type(x)((k, walk(v)) for k, v in x.items())
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    out = walk(state)
    if cuda and moved:
        torch.cuda.current_stream(device).synchronize()  # the pinned sources may be reused
    return out
