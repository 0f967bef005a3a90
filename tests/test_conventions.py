"""Habits users bring from concurrent.futures, Orbax, DCP: a SaveHandle is usable as a Future,
``latest_step()``, step-based ``every=`` that survives restarts, a finite S3 retention default,
``Stateful`` objects in the native API."""

from __future__ import annotations

import threading
from concurrent import futures
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier, S3Tier
from tierckpt.errors import CheckpointFailed, CheckpointSkipped, StateMismatch
from tierckpt.handle import SaveHandle
from tierckpt.policy import S3_DEFAULT_KEEP_LAST


def test_save_handle_works_with_concurrent_futures(tmp_path: Path) -> None:
    seen: list[object] = []
    called = threading.Event()
    with Checkpointer(
        [LocalTier(tmp_path / "a", name="a"), LocalTier(tmp_path / "b", name="b")]
    ) as ck:
        h = ck.save({"w": torch.arange(1000.0)}, step=3)
        assert isinstance(h.future, futures.Future)
        done, not_done = futures.wait([h.future], timeout=120)
        assert h.future in done and not not_done
        results = h.future.result()
        assert set(results) == {"a", "b"} and results["a"].step == 3
        h.add_done_callback(lambda hh: (seen.append(hh), called.set()))
        h.future.add_done_callback(lambda f: seen.append(f.result()["b"].tier))
        assert called.wait(10) and seen == [h, "b"]
        # as_completed over several saves
        hs = [ck.save({"w": torch.full((10,), float(s))}, step=s) for s in (4, 5)]
        assert sorted(
            next(iter(f.result().values())).step
            for f in futures.as_completed([x.future for x in hs], timeout=120)
        ) == [4, 5]


def test_future_carries_the_failure_and_the_skip(tmp_path: Path) -> None:
    with Checkpointer([LocalTier(tmp_path, name="a")]) as ck:
        ck.save({"w": torch.zeros(4)}, step=1).wait()
        h = ck.save({"w": torch.zeros(4)}, step=1)  # committed already: refused on the tier
        with pytest.raises(CheckpointFailed):
            h.future.result(timeout=120)
    h2 = SaveHandle(9, ("s",), skipped=True)  # what save() returns with on_busy="skip"
    assert h2.future.done()
    with pytest.raises(CheckpointSkipped):
        h2.future.result()


def test_latest_step_follows_tiers_and_timelines(tmp_path: Path) -> None:
    tiers = [
        LocalTier(tmp_path / "a", name="a", keep_last=None),
        LocalTier(tmp_path / "b", name="b", every=2, keep_last=None),
    ]
    with Checkpointer(tiers) as ck:
        assert ck.latest_step() is None and ck.latest_step("a") is None
        for s in (1, 2, 3):
            ck.save({"w": torch.full((4,), float(s))}, step=s).wait()
        assert ck.latest_step() == 3 and ck.latest_step("b") == 2
    with Checkpointer(tiers) as ck:  # a new process's view: from the tiers
        assert ck.latest_step() == 3
        ck.load(step=1)
        ck.save({"w": torch.zeros(4)}, step=2).wait()  # rollback: timeline 1
        assert ck.latest_step() == 2  # what load() returns, though step 3 is higher
        assert ck.load()["w"][0].item() == 0.0
        assert ck.latest_step(timeline=0) == 3 and ck.latest_step(timeline=1) == 2
        assert ck.latest_step(timeline=5) is None


def test_every_counts_steps_and_survives_a_restart(tmp_path: Path) -> None:
    """``every=10``: the tier gets the steps that are multiples of 10, whatever the number of
    save() calls and across processes (Orbax's save_interval_steps)."""

    def tiers() -> list[LocalTier]:
        return [
            LocalTier(tmp_path / "fast", name="fast", keep_last=None),
            LocalTier(tmp_path / "slow", name="slow", every=10, keep_last=None),
        ]

    with Checkpointer(tiers()) as ck:
        for s in range(5, 25, 5):  # 5, 10, 15, 20
            h = ck.save({"w": torch.full((4,), float(s))}, step=s)
            h.wait()
            assert ("slow" in h.tiers) == (s % 10 == 0)
        assert ck.steps("slow") == [10, 20]
    with Checkpointer(tiers()) as ck:  # restarted: no count starts over at the first save
        ck.load()
        for s in (25, 30, 35):
            ck.save({"w": torch.full((4,), float(s))}, step=s).wait()
        assert ck.steps("slow") == [10, 20, 30]
        assert ck.steps("fast") == [5, 10, 15, 20, 25, 30, 35]


@pytest.mark.s3
def test_s3_tier_keeps_a_finite_number_by_default(moto_server, s3_bucket) -> None:  # type: ignore[no-untyped-def]
    bucket = s3_bucket(moto_server)
    assert S3Tier("s3://b/run").keep_last == S3_DEFAULT_KEEP_LAST == 5
    assert S3Tier("s3://b/run", keep_last=None).keep_last is None  # an archive, on request
    tier = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
    with Checkpointer([tier]) as ck:
        for s in range(1, 8):
            ck.save({"w": torch.full((100,), float(s))}, step=s).wait()
        assert ck.steps("s3") == [3, 4, 5, 6, 7]


class _Counter:
    """A user class of DCP's Stateful protocol."""

    def __init__(self) -> None:
        self.seen = 0
        self.ema = torch.zeros(3)

    def state_dict(self) -> dict[str, object]:
        return {"seen": self.seen, "ema": self.ema}

    def load_state_dict(self, sd: dict[str, object]) -> None:
        self.seen = int(sd["seen"])  # type: ignore[call-overload]
        self.ema = sd["ema"].clone()  # type: ignore[attr-defined]


def test_native_save_and_load_of_stateful_objects(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    app = _Counter()
    app.seen, app.ema = 7, torch.tensor([1.0, 2.0, 3.0])
    with Checkpointer([LocalTier(tmp_path)]) as ck:
        ck.save({"model": model, "optim": opt, "app": app, "step": 7}, step=7).wait()
        model2 = torch.nn.Linear(4, 2)
        opt2 = torch.optim.Adam(model2.parameters())  # fresh: no state yet
        app2 = _Counter()
        into = {"model": model2, "optim": opt2, "app": app2, "step": 0}
        out = ck.load(into=into)
        assert out is into and into["step"] == 7 and into["model"] is model2
        assert torch.equal(model2.weight, model.weight) and torch.equal(model2.bias, model.bias)
        assert torch.equal(
            opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
        )
        assert app2.seen == 7 and torch.equal(app2.ema, app.ema)
        plain = ck.load()  # what was stored: the state_dicts
        assert set(plain) == {"model", "optim", "app", "step"} and plain["app"]["seen"] == 7
        with pytest.raises(StateMismatch, match="missing from checkpoint"):
            ck.load(into={"model": model2, "other": 1})
