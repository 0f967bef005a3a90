"""The ``torch.save`` habit: ``save()`` and then straight on to ``optimizer.step()``, without
``guard()`` or ``wait_captured()``.

Parameters and optimizer state are captured lazily. Without ``guard()`` nothing made the step
wait for that copy, so the step raced it: the checkpoint held values from after ``save()``,
mixed two steps, or (the checksum taken while the copy was under way) committed and then failed
its own checksums at load — ``CorruptCheckpoint`` for a save whose handle said committed. Now
the first save without ``guard()`` makes every optimizer's ``step()`` in the process wait for
that writer's pending captures (one process-wide hook), as ``guard()`` would.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tierckpt import Checkpointer, LocalTier, MemoryTier


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))]


def test_save_then_step_without_guard_saves_the_state_at_save(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MiB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tiers = [
        MemoryTier(namespace=f"unguarded-{tmp_path.name}", keep_last=None),
        LocalTier(tmp_path, keep_last=None),
    ]
    with Checkpointer(tiers, chunk_bytes=1 << 20) as ck:
        expected = {}
        for step in range(1, 6):
            model(torch.randn(4, 512)).sum().backward()
            expected[step] = copy.deepcopy(model.state_dict())
            h = ck.save({"model": model.state_dict()}, step)
            opt.step()  # at once: the habit
            opt.zero_grad()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # and more in-place change after the step
            h.wait(timeout=120)
        for step, want in expected.items():
            for tier in ck.tier_names:
                got = ck.load(step=step, tier=tier)["model"]
                assert _same(want, got) == [], (step, tier)


def test_a_guarded_writer_is_not_waited_for_by_other_optimizers(tmp_path: Path) -> None:
    # guard() names what is lazy; the process-wide wait is only for writers without it
    model = torch.nn.Linear(8, 8)
    other = torch.optim.SGD(torch.nn.Linear(8, 8).parameters(), lr=0.1)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.guard(torch.optim.SGD(model.parameters(), lr=0.1), model)
        waited = []
        ck._wait_captures = lambda *a, **k: waited.append(1)  # type: ignore[method-assign]
        ck.save({"model": model.state_dict()}, 1)
        other.step()
        assert waited == []
        ck.wait()
