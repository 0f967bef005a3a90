"""The processes of the rollback tests (``test_timelines.py``): each phase is a fresh process.

``train``   saves steps ``1..steps`` of run 1, waiting for each commit.
``resume``  loads ``load_step`` (the rollback), checks it is run 1's, then saves
            ``load_step+1..until`` as run 2; after each save returns committed it lists every
            tier (what retention left) and records it.
``load``    a fresh process's view: ``load()``, ``load(step)``, ``steps()``, ``checkpoints()``.

A state says which run and step it is (``marker``), so a test can tell an abandoned step 10
from the resumed run's step 10. Results go to ``<out>/result.json``; an exception's traceback
to ``<out>/error.txt``; the library's log (INFO) to ``<out>/log.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

import torch

from tierckpt import Checkpointer, CheckpointFailed, LocalTier, S3Tier


def state(run: int, step: int) -> dict[str, Any]:
    return {"w": torch.full((20_000,), float(run * 1000 + step)), "step": step, "run": run}


def marker(s: Any) -> list[int]:
    """``[run, step]`` of a loaded state (and a check that its tensor agrees)."""
    run, step = int(s["run"]), int(s["step"])
    assert torch.equal(s["w"], torch.full((20_000,), float(run * 1000 + step)))
    return [run, step]


def tiers(spec: dict[str, Any]) -> list[Any]:
    """``local`` (and ``s3``) keep ``keep_last``; ``archive`` receives the steps that are
    multiples of 3 and keeps them all (where an operator finds the older step to go back to)."""
    k = spec["keep_last"]
    out: list[Any] = [LocalTier(spec["local"], keep_last=k)]
    if spec.get("s3"):
        s3 = spec["s3"]
        out.append(S3Tier(f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=k))
    out.append(LocalTier(spec["archive"], name="archive", keep_last=None, every=3))
    return out


def ids(ck: Checkpointer, tier: str | None = None) -> list[list[int]] | None:
    """``[[step, timeline], ...]`` oldest first (None from a tierckpt without timelines: the
    tests check the behaviour first, with the API every version has, then the ids)."""
    if not hasattr(ck, "checkpoints"):
        return None
    return [[c.step, c.timeline] for c in ck.checkpoints(tier)]


def listing(ck: Checkpointer) -> dict[str, Any]:
    return {
        "steps": {t: ck.steps(t) for t in ck.tier_names},
        "ids": {t: ids(ck, t) for t in ck.tier_names},
    }


def train(spec: dict[str, Any]) -> dict[str, Any]:
    with Checkpointer(tiers(spec), chunk_bytes=1 << 16) as ck:
        timelines = []
        for s in range(1, spec["steps"] + 1):
            h = ck.save(state(1, s), s)
            h.wait(timeout=120)
            timelines.append(getattr(h, "timeline", None))
        return {"timelines": timelines, **listing(ck)}


def resume(spec: dict[str, Any]) -> dict[str, Any]:
    with Checkpointer(tiers(spec), chunk_bytes=1 << 16) as ck:
        loaded = marker(ck.load(spec["load_step"]))
        saves = []
        for s in range(spec["load_step"] + 1, spec["until"] + 1):
            h = ck.save(state(2, s), s)
            try:
                h.wait(timeout=120)
                error = ""
            except CheckpointFailed as exc:  # a refused collision would end here
                error = str(exc)
            saves.append(
                {
                    "step": s,
                    "error": error,
                    "tiers": list(h.tiers),
                    "timeline": getattr(h, "timeline", None),
                    "committed": all(h.committed(t) for t in h.tiers),
                    # what is on each tier once the handle says committed (retention ran)
                    **listing(ck),
                }
            )
        return {"loaded": loaded, "saves": saves}


def load(spec: dict[str, Any]) -> dict[str, Any]:
    with Checkpointer(tiers(spec)) as ck:
        out: dict[str, Any] = {
            "newest": marker(ck.load()),
            "steps": ck.steps(),
            "ids": ids(ck),
            "by_step": {},
        }
        for s in spec.get("load_steps", []):
            out["by_step"][str(s)] = marker(ck.load(s))
        return out


def run(phase: str, spec: dict[str, Any], out: str, env: dict[str, str]) -> None:
    """The process's body (started by the test through a forkserver: a fresh process)."""
    os.environ.update(env)
    os.makedirs(out, exist_ok=True)
    logging.basicConfig(
        filename=os.path.join(out, "log.txt"),
        level=logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,
    )
    try:
        result = {"train": train, "resume": resume, "load": load}[phase](spec)
        Path(out, "result.json").write_text(json.dumps(result))
    except BaseException:
        Path(out, "error.txt").write_text(traceback.format_exc())
        raise
    finally:
        logging.shutdown()
