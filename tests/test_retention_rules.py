"""Orbax-style retention: keep-period, best by a metric, pins; decided from what is stored.

Each phase of a run is a separate Python process (a job restarted), so the best and pinned
sets must come from the tier, not from the memory of the process that saved them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tierckpt
from tierckpt import Checkpointer, LocalTier, MemoryTier

ROOT = Path(__file__).resolve().parents[1]


def _phase(folder: Path, tier_kwargs: dict[str, object], script: str) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter with ``ck`` open on ``folder``; it may set
    ``out``, returned as JSON. ``save(step, **kw)`` saves a small state."""
    code = (
        textwrap.dedent(
            """
        import json, sys, torch
        from tierckpt import Checkpointer, LocalTier
        ck = Checkpointer([LocalTier(sys.argv[1], **json.loads(sys.argv[2]))])
        def save(step, **kw):
            ck.save({"w": torch.full((64,), float(step))}, step, **kw).wait()
        out = None
        """
        )
        + textwrap.dedent(script)
        + "\nck.close()\nprint('OUT' + json.dumps(out))\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(folder), json.dumps(tier_kwargs)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("OUT")][-1]
    result: dict[str, object] = json.loads(line[3:]) or {}
    return result


def _steps(folder: Path) -> list[int]:
    with Checkpointer([LocalTier(folder, keep_last=None)]) as ck:
        return ck.steps()


def test_keep_every_n_steps_survives_restarts(tmp_path: Path) -> None:
    kw = {"keep_last": 1, "keep_every_n_steps": 3}
    _phase(tmp_path, kw, "for s in range(1, 5): save(s)")
    assert _steps(tmp_path) == [3, 4]
    _phase(tmp_path, kw, "for s in range(5, 8): save(s)")
    assert _steps(tmp_path) == [3, 6, 7]


def test_keep_best_by_metric_across_restarts(tmp_path: Path) -> None:
    kw = {"keep_last": 1, "keep_best": 1, "best_metric": "loss", "best_mode": "min"}
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 2.0}
    _phase(tmp_path, kw, f"for s, l in {losses!r}.items(): save(s, metrics={{'loss': l}})")
    assert _steps(tmp_path) == [2, 5]  # the best and the newest
    # a new process knows step 2 is the best only from its manifest
    _phase(tmp_path, kw, "save(6, metrics={'loss': 7.0}); save(7, metrics={'loss': 8.0})")
    assert _steps(tmp_path) == [2, 7]
    _phase(tmp_path, kw, "save(8, metrics={'loss': 0.5}); save(9)")  # 9 has no metric
    assert _steps(tmp_path) == [8, 9]
    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        meta = ck.backend("local").get("manifests/step-000000000008.json")
        assert json.loads(meta)["metadata"]["metrics"] == {"loss": 0.5}


def test_keep_best_max_mode_keeps_the_highest(tmp_path: Path) -> None:
    kw = {"keep_last": 1, "keep_best": 2, "best_metric": "acc", "best_mode": "max"}
    _phase(
        tmp_path,
        kw,
        "for s, a in [(1, .5), (2, .9), (3, .7), (4, .8), (5, .1)]: save(s, metrics={'acc': a})",
    )
    assert _steps(tmp_path) == [2, 4, 5]


def test_pinned_step_survives_restarts_until_unpinned(tmp_path: Path) -> None:
    kw = {"keep_last": 1}
    out = _phase(tmp_path, kw, "save(1); ck.pin(1, reason='best'); save(2); out = ck.steps()")
    assert out == [1, 2]
    out = _phase(tmp_path, kw, "for s in (3, 4, 5): save(s)\nout = [c.step for c in ck.pinned()]")
    assert out == [1]
    assert _steps(tmp_path) == [1, 5]
    _phase(tmp_path, kw, "ck.unpin(1); save(6)")
    assert _steps(tmp_path) == [6]


def test_pin_a_step_in_flight_before_it_commits(tmp_path: Path) -> None:
    """Pinned while still flushing: the next commits' retention keeps it."""
    with Checkpointer([LocalTier(tmp_path, keep_last=1)]) as ck:
        h = ck.save({"w": torch.ones(1 << 16)}, 1)
        assert ck.pin(1) == tierckpt.CheckpointId(1)
        h.wait()
        for s in (2, 3):
            ck.save({"w": torch.ones(4)}, s).wait()
        assert ck.steps() == [1, 3]
        with pytest.raises(tierckpt.CheckpointNotFound, match="cannot pin step 2"):
            ck.pin(2)


def test_pin_reaches_every_tier(tmp_path: Path) -> None:
    from tierckpt.retention import pinned_ids

    tiers = [
        MemoryTier(namespace=f"pin-{os.getpid()}", keep_last=1),
        LocalTier(tmp_path, keep_last=1),
    ]
    with Checkpointer(tiers) as ck:
        ck.save({"w": torch.ones(4)}, 1).wait()
        ck.pin(1)
        for s in (2, 3):
            ck.save({"w": torch.ones(4)}, s).wait()
        assert ck.tier_steps() == {"memory": [1, 3], "local": [1, 3]}
        assert pinned_ids(ck.backend("memory")) == [tierckpt.CheckpointId(1)]
        ck.unpin(1)
        ck.save({"w": torch.ones(4)}, 4).wait()
        assert ck.tier_steps() == {"memory": [4], "local": [4]}


def test_gc_tier_never_removes_what_it_cannot_judge(tmp_path: Path) -> None:
    """A manifest whose metrics cannot be read is kept (retention never guesses)."""
    from tierckpt.retention import Retention, gc_tier

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for s, loss in ((1, 0.1), (2, 6.0), (3, 5.0), (4, 7.0)):
            ck.save({"w": torch.ones(4)}, s, metrics={"loss": loss}).wait()
        backend = ck.backend("local")
    (tmp_path / "manifests" / "step-000000000001.json").write_text("{not json")
    rule = Retention(keep_last=1, keep_best=1, best_metric="loss")
    from tierckpt.retention import _METRICS_CACHE

    _METRICS_CACHE.clear()
    deleted = gc_tier(backend, rule)
    # 1 unreadable: kept; 3 the best readable; 4 the newest; 2 goes
    assert [c.step for c in deleted] == [2]


def test_bad_retention_and_metrics_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        LocalTier(tmp_path, keep_best=1)
    with pytest.raises(ValueError, match="best_mode"):
        LocalTier(tmp_path, keep_best=1, best_metric="loss", best_mode="lowest")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_every_n_steps"):
        MemoryTier(keep_every_n_steps=0)
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        with pytest.raises(ValueError, match="finite number"):
            ck.save({"w": torch.ones(1)}, 1, metrics={"loss": float("nan")})
        with pytest.raises(ValueError, match="not both"):
            ck.save({"w": torch.ones(1)}, 1, metrics={"a": 1.0}, metadata={"metrics": {}})
        # a 0-d tensor is a number
        ck.save({"w": torch.ones(1)}, 1, metrics={"loss": torch.tensor(0.25)}).wait()


def test_offline_gc_honours_pins(tmp_path: Path) -> None:
    from tierckpt.offline import gc

    with Checkpointer([LocalTier(tmp_path, keep_last=None)]) as ck:
        for s in (1, 2, 3, 4):
            ck.save({"w": torch.ones(4)}, s).wait()
        ck.pin(2)
        backend = ck.backend("local")
    dry = gc(backend, 1, dry_run=True)
    assert [c.step for c in dry.expired] == [1, 3]
    assert [c.step for c in dry.retained] == [2, 4]
    gc(backend, 1)
    assert _steps(tmp_path) == [2, 4]
