"""torch's own DCP test scenarios, ported to ``TierWriter``/``TierReader``, with DCP's
``FileSystemWriter``/``FileSystemReader`` as the control: every case runs for both (``kind``
"tier" and "fs") and must pass for both.

Ported (rewritten, not copied) from torch's test/distributed/checkpoint: test_file_system_
checkpoint(_cpu) (tensor-only and bytes round trips, ``overwrite``, dtypes), test_dtensor_
resharding (save with one placement, load with another), test_state_dict (FSDP2 model and
optimizer through ``get_state_dict``/``set_state_dict``), test_async_process_executor
(``async_save`` in a background process), and the storage-meta and pickling contracts that
DCP's own code relies on. Multi-rank cases run on gloo in real processes
(:mod:`parity_workers`).
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import parity_workers as pw
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt import LocalTier
from tierckpt.dcp import TierReader, TierWriter
from tierckpt.format import manifest_name, step_prefix

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled",
    "ignore:Detected an existing checkpoint",
)

KINDS = ["tier", "fs"]


class _Module(torch.nn.Module):
    """The module of torch's test_file_system_checkpoint: two Linears and an EmbeddingBag."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


def _equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return set(a) == set(b) and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


# -- single process ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_read_write_only_tensor(kind: str, tmp_path: Path) -> None:
    saved = _Module().state_dict()
    dcp.save(saved, storage_writer=pw.writer(kind, str(tmp_path), 1), no_dist=True)
    target = _Module().state_dict()
    assert not _equal(target, saved)
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 1), no_dist=True)
    assert _equal(target, saved)


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_bytes(kind: str, tmp_path: Path) -> None:
    dcp.save(
        {"bytes0": [1], "bytes1": "string"},
        storage_writer=pw.writer(kind, str(tmp_path), 1),
        no_dist=True,
    )
    target: dict[str, Any] = {"bytes0": [2], "bytes1": "other"}
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 1), no_dist=True)
    assert target == {"bytes0": [1], "bytes1": "string"}


@pytest.mark.parametrize("kind", KINDS)
def test_dtypes_shapes_and_views(kind: str, tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 8, generator=g)
    saved = {
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "f64": base.double(),
        "i64": torch.arange(12).reshape(3, 4),
        "i8": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "bool": base > 0,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed": base.t(),  # not contiguous
        "strided": base[::2, 1::3],
    }
    dcp.save(saved, storage_writer=pw.writer(kind, str(tmp_path), 1), no_dist=True)
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 1), no_dist=True)
    assert _equal(target, saved)


@pytest.mark.parametrize("kind", KINDS)
def test_load_into_another_float_dtype_casts(kind: str, tmp_path: Path) -> None:
    saved = {"w": torch.linspace(-2, 2, 33)}
    dcp.save(saved, storage_writer=pw.writer(kind, str(tmp_path), 1), no_dist=True)
    target = {"w": torch.zeros(33, dtype=torch.bfloat16)}
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 1), no_dist=True)
    assert target["w"].dtype == torch.bfloat16
    assert torch.equal(target["w"], saved["w"].bfloat16())


@pytest.mark.parametrize("kind", KINDS)
def test_overwrite(kind: str, tmp_path: Path) -> None:
    """torch's test_overwrite: ``overwrite=True`` lets the second save win; ``overwrite=False``
    on an existing checkpoint raises a ``CheckpointException`` saying "Checkpoint already
    exists". tierckpt keeps the first save on its timeline instead of overwriting it."""
    t1, t2 = torch.randn(10), torch.randn(10)
    root = str(tmp_path)
    dcp.save({"random": t1}, storage_writer=pw.writer(kind, root, 1, overwrite=False))
    dcp.save({"random": t2}, storage_writer=pw.writer(kind, root, 1, overwrite=True))
    sd = {"random": torch.zeros(10)}
    dcp.load(sd, storage_reader=pw.reader(kind, root, 1))
    assert torch.equal(sd["random"], t2)
    with pytest.raises(CheckpointException, match=r"Checkpoint already exists") as info:
        dcp.save({"random": t2}, storage_writer=pw.writer(kind, root, 1, overwrite=False))
    failures = list(info.value.failures.values())
    # DCP wraps each rank's exception with its traceback: (exception, stack)
    failures = [f[0] if isinstance(f, tuple) else f for f in failures]
    assert failures and all(isinstance(f, RuntimeError) for f in failures)
    if kind == "tier":
        from tierckpt import CheckpointExists

        assert all(isinstance(f, CheckpointExists) for f in failures)
        # nothing committed was lost: the first save stays on timeline 0
        assert (tmp_path / manifest_name(1)).exists()
        assert (tmp_path / manifest_name(1, timeline=1)).exists()


@pytest.mark.parametrize("kind", KINDS)
def test_storage_meta_checkpoint_id_is_the_location(kind: str, tmp_path: Path) -> None:
    md = dcp.save({"a": torch.ones(3)}, storage_writer=pw.writer(kind, str(tmp_path), 4))
    assert md.storage_meta is not None
    where = str(md.storage_meta.checkpoint_id)
    expected = tmp_path / ("step-4" if kind == "fs" else step_prefix(4))
    assert os.path.realpath(where) == os.path.realpath(expected)
    assert os.path.isdir(where) and os.listdir(where)
    loaded = pw.reader(kind, str(tmp_path), 4).read_metadata()
    assert loaded.storage_meta is not None
    assert str(loaded.storage_meta.checkpoint_id) == where


@pytest.mark.parametrize("kind", KINDS)
def test_writer_and_reader_pickle(kind: str, tmp_path: Path) -> None:
    """DCP's process-based async save pickles the storage writer; readers travel too."""
    saved = _Module().state_dict()
    w = pickle.loads(pickle.dumps(pw.writer(kind, str(tmp_path), 2)))
    dcp.save(saved, storage_writer=w, no_dist=True)
    r = pickle.loads(pickle.dumps(pw.reader(kind, str(tmp_path), 2)))
    target = _Module().state_dict()
    dcp.load(target, storage_reader=r, no_dist=True)
    assert _equal(target, saved)
    if kind == "tier":
        w.close()


def test_a_used_writer_pickles_and_copies_share_one_writer_per_process(tmp_path: Path) -> None:
    """A writer with live threads pickles as its configuration; the copies of one writer
    unpickled in one process are one writer there (one pipeline, one set of leases)."""
    w = TierWriter([LocalTier(tmp_path)], 1)
    dcp.save({"a": torch.ones(4)}, storage_writer=w, no_dist=True)
    blob = pickle.dumps(w)
    w.close()  # its lease goes: the copy may take the location
    c1, c2 = pickle.loads(blob), pickle.loads(blob)
    assert c1 is c2 and c1 is not w
    dcp.save({"a": torch.full((4,), 2.0)}, storage_writer=c1, checkpoint_id=2, no_dist=True)
    dcp.save({"a": torch.full((4,), 3.0)}, storage_writer=c2, checkpoint_id=3, no_dist=True)
    c1.close()
    target = {"a": torch.zeros(4)}
    dcp.load(target, storage_reader=TierReader([LocalTier(tmp_path)]), no_dist=True)
    assert torch.equal(target["a"], torch.full((4,), 3.0))


def test_a_new_writer_per_save_while_the_old_one_is_still_referenced(tmp_path: Path) -> None:
    """DCP's idiom is a new storage writer per save. An older writer still referenced (kept by
    a traceback, a list, a debugger) must not refuse the next one: the newest writer of a
    location in a process takes it over from an idle older one, which then refuses saves."""
    kept = [TierWriter([LocalTier(tmp_path)], 1)]
    dcp.save({"a": torch.ones(4)}, storage_writer=kept[0], no_dist=True)
    dcp.save({"a": torch.full((4,), 2.0)}, storage_writer=TierWriter([LocalTier(tmp_path)], 2))
    with pytest.raises(CheckpointException, match="took its location over"):
        dcp.save({"a": torch.zeros(4)}, storage_writer=kept[0], checkpoint_id=3, no_dist=True)
    target = {"a": torch.zeros(4)}
    dcp.load(target, storage_reader=TierReader([LocalTier(tmp_path)]), no_dist=True)
    assert torch.equal(target["a"], torch.full((4,), 2.0))


def test_dropped_writers_hand_their_warm_pipeline_on(tmp_path: Path) -> None:
    """A writer dropped without close() parks its idle pipeline; the next writer of the same
    tiers adopts it: the same lease (same owner, never released and taken again) serves
    every save, so a save pays no per-writer setup."""
    owners = []
    for step in (1, 2, 3):
        dcp.save(
            {"a": torch.full((64,), float(step))},
            storage_writer=pw.writer("tier", str(tmp_path), step),
            no_dist=True,
        )
        lease = json.loads((tmp_path / "leases" / "rank-000000.json").read_text())
        owners.append((lease["owner"], lease["started"]))
    assert owners[0] == owners[1] == owners[2]
    # a writer with other settings on the same location takes it over (the parked one closes)
    w = TierWriter([LocalTier(tmp_path, keep_last=None)], 4, chunk_bytes=8192)
    dcp.save({"a": torch.zeros(64)}, storage_writer=w, no_dist=True)
    w.close()
    assert not (tmp_path / "leases" / "rank-000000.json").exists()


@pytest.mark.parametrize("kind", KINDS)
def test_model_and_optimizer_through_state_dict_api(kind: str, tmp_path: Path) -> None:
    """torch's test_state_dict on one process: get_state_dict / set_state_dict round trip."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.GELU(), torch.nn.Linear(9, 2))
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(torch.randn(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
        return m, opt

    model, opt = build(0)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=pw.writer(kind, str(tmp_path), 9))
    model2, opt2 = build(1)
    msd2, osd2 = get_state_dict(model2, opt2)
    target = {"model": msd2, "optim": osd2}
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 9))
    set_state_dict(model2, opt2, model_state_dict=target["model"], optim_state_dict=target["optim"])
    a, b = get_state_dict(model, opt), get_state_dict(model2, opt2)
    assert _equal(a[0], b[0])
    assert all(
        torch.equal(a[1]["state"][k][s], b[1]["state"][k][s])
        for k in a[1]["state"]
        for s in a[1]["state"][k]
    )


@pytest.mark.parametrize("kind", KINDS)
def test_async_save_in_a_thread(kind: str, tmp_path: Path) -> None:
    state = {"t": torch.arange(100.0)}
    fut = dcp.async_save(state, storage_writer=pw.writer(kind, str(tmp_path), 5), no_dist=True)
    state["t"].zero_()  # async_save staged a copy first
    fut.result()  # type: ignore[union-attr]
    target = {"t": torch.zeros(100)}
    dcp.load(target, storage_reader=pw.reader(kind, str(tmp_path), 5), no_dist=True)
    assert torch.equal(target["t"], torch.arange(100.0))


# -- several ranks (gloo, real processes) -------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_async_save_in_a_background_process(kind: str, tmp_path: Path) -> None:
    """``async_save(async_checkpointer_type=PROCESS)``: the writer is pickled to DCP's save
    process with every request; three saves through one writer object load back as they were
    at the call, and the metadata names where each checkpoint lives."""
    res = pw.run("w_async_process", 2, kind=kind, root=str(tmp_path), steps=[1, 2, 3], timeout=240)
    for r in res:
        assert [r[f"ok-{s}"] for s in (1, 2, 3)] == [True, True, True]
        assert [r[f"i-{s}"] for s in (1, 2, 3)] == [0, 1, 2]
    where = res[0]["checkpoint_id-2"]
    expected = tmp_path / ("step-2" if kind == "fs" else step_prefix(2))
    assert os.path.realpath(where) == os.path.realpath(expected)


RESHARD = [("shard0", "shard1"), ("shard0", "replicate"), ("replicate", "shard0")]


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("save", "load"), RESHARD[:1])
def test_dtensor_resharding(kind: str, save: str, load: str, tmp_path: Path) -> None:
    res = pw.run("w_reshard", 2, kind=kind, root=str(tmp_path), save=save, load=load)
    assert all(r["equal"] and r["local_equal"] and r["plain"] and r["step"] == 17 for r in res)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("save", "load"), RESHARD[1:])
def test_dtensor_resharding_more(kind: str, save: str, load: str, tmp_path: Path) -> None:
    res = pw.run("w_reshard", 2, kind=kind, root=str(tmp_path), save=save, load=load)
    assert all(r["equal"] and r["local_equal"] and r["plain"] and r["step"] == 17 for r in res)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    ("save", "load"), [("shard0_shard1", "shard1_replicate"), ("replicate_shard0", "shard0_shard1")]
)
def test_dtensor_resharding_2d_mesh(kind: str, save: str, load: str, tmp_path: Path) -> None:
    res = pw.run("w_reshard", 4, kind=kind, root=str(tmp_path), save=save, load=load, dims=2)
    assert all(r["equal"] and r["local_equal"] and r["plain"] and r["step"] == 17 for r in res)


@pytest.mark.distributed
@pytest.mark.parametrize("kind", KINDS)
def test_fsdp2_model_and_optimizer_state_dict(kind: str, tmp_path: Path) -> None:
    res = pw.run("w_fsdp_state_dict", 2, kind=kind, root=str(tmp_path))
    assert all(r["diffs"] == [] and r["after"] == [] for r in res)
