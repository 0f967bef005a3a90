"""A node-RAM restore copies small storages out of the mapping (:data:`MAP_MIN_BYTES`).

A view of the mapping, however small, keeps the whole segment: tmpfs frees an unlinked file's
pages only when its last mapping goes. After the usual ``opt.load_state_dict(state); del
state``, Adam keeps its 0-d ``step`` tensors (and the moments of small parameters) as they
were loaded, so one mapped 4-byte ``step`` kept a 24 MiB segment alive after retention deleted
it, charged to the node-RAM budget until every save failed ("raise max_bytes or lower
keep_last"). Small storages are now copies; large tensors stay mapped.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, NodeRamTier
from tierckpt.noderam_map import live_mappings, unlinked_mapped_bytes
from tierckpt.restore import read_manifest


def _tier(shm: Path, **kw: Any) -> NodeRamTier:
    return NodeRamTier(path=shm, namespace="run", stale_after_s=None, **kw)


def _mapped_files(shm: Path) -> list[str]:
    """Files under ``shm`` this process maps (``/proc/self/maps``; deleted ones too)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(shm)):
                out.append(parts[5].strip())
    return out


def _in_mapping(t: torch.Tensor, shm: Path) -> bool:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith(str(shm)):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                ranges.append((a, b))
    p = t.untyped_storage().data_ptr()
    return any(a <= p < b for a, b in ranges)


def test_small_storages_are_copied_and_do_not_keep_the_segment(shm: Path) -> None:
    # laid out in this order, the storages but "pad" start 16-byte aligned in the file (the
    # 4-byte step and the 12-byte pad keep the next ones aligned): each was mapped before
    state = {
        "bias_m": torch.randn(1024),  # 4 KiB: Adam's exp_avg of a bias
        "step": torch.tensor(7.0),  # Adam's step, offset 4096
        "pad": torch.zeros(3),
        "mid": torch.randn(4096),  # 16 KiB
        "big": torch.randn(1 << 18),  # 1 MiB: stays mapped
    }
    with Checkpointer([_tier(shm, keep_last=None)]) as ck:
        ck.save(state, 1).wait(timeout=60)
    with Checkpointer([_tier(shm, keep_last=None)]) as ck:
        got = ck.load()
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert _in_mapping(got["big"], shm), "the large tensor was copied, not mapped"
    small = {k: got[k] for k in ("bias_m", "step", "pad", "mid")}
    mapped = [k for k, v in small.items() if _in_mapping(v, shm)]
    assert mapped == [], f"small storages still views of the mapping: {mapped}"
    del got
    gc.collect()
    # only the small tensors survive, as in an optimizer after load_state_dict
    assert live_mappings([str(shm)]) == [] and _mapped_files(shm) == []
    with torch.no_grad():
        small["step"] += 1  # ordinary, writable tensors
    assert small["step"].item() == 8.0 and torch.equal(small["mid"], state["mid"])


def _model_and_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    model.register_buffer("table", torch.randn(1 << 18))  # 1 MiB, mapped at the load
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(4, 64)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}


def test_an_adam_restored_from_node_ram_lets_retention_free_the_segment(shm: Path) -> None:
    """The field report, small: restore a model and Adam the usual way, drop the loaded
    state, train on with ``keep_last=1`` and a budget of ``keep_last + 1`` checkpoints."""
    model, opt = _model_and_adam()
    with Checkpointer([_tier(shm, keep_last=1)]) as ck:
        ck.guard(opt, model)
        _train(model, opt)
        ck.save(_state(model, opt, 1), 1).wait(timeout=60)
        b: Any = ck.backend("noderam")
        seg = b.size(read_manifest(b, 1, "noderam").shard_for(0).file)
    model, opt = _model_and_adam()
    with Checkpointer([_tier(shm, keep_last=1, max_bytes=2 * seg + (1 << 20))]) as ck:
        ck.guard(opt, model)
        b = ck.backend("noderam")
        state = ck.load()
        assert live_mappings([b.root]), "the load did not map the segment"
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        del state
        gc.collect()
        steps = [s["step"] for s in opt.state.values()]
        assert steps and not any(_in_mapping(s, shm) for s in steps)
        assert live_mappings([b.root]) == [], "the optimizer keeps the segment mapped"
        for step in range(2, 6):
            _train(model, opt)
            ck.save(_state(model, opt, step), step).wait(timeout=60)  # raises if it failed
            ck.wait(retention=True)
            assert unlinked_mapped_bytes([b.root]) == 0
        assert ck.tier_steps()["noderam"] == [5]
    assert _mapped_files(shm) == []
