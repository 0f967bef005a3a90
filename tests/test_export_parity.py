"""``tierckpt export`` against what safetensors and Hugging Face users expect (safetensors'
own shared-tensor and dtype cases): tied weights stored once so ``safetensors.torch.
load_model`` restores a tied model, ``max_shard_size`` shards with an index, views that are
not aliases kept apart, and every dtype the installed safetensors stores exported."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, load_model

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main
from tierckpt.export import export_safetensors


class _Tied(torch.nn.Module):
    """A language-model shape: the output head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight


def _save(tmp_path: Path, state: Any) -> Path:
    src = tmp_path / "ck"
    with Checkpointer([LocalTier(src)]) as ck:
        ck.save(state, step=3).wait()
    return src


def test_tied_weights_load_with_safetensors_load_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    src = _save(tmp_path, {"model": model.state_dict(), "step": 3})
    out = tmp_path / "out"
    (res,) = export_safetensors(LocalBackend(str(src)), 3, str(out))
    fresh = _Tied()
    # strict: every key of the model is restored and the file holds no unexpected one
    missing, unexpected = load_model(fresh, out / "model.safetensors")
    assert unexpected == [] and set(missing) <= {"head.weight"}
    assert fresh.head.weight is fresh.emb.weight  # still tied
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert res.aliases == {"model.safetensors:head.weight": "model.safetensors:emb.weight"}
    doc = json.loads((out / "state.json").read_text())
    ref = {"$safetensors": "model.safetensors", "name": "emb.weight"}
    assert doc["state"]["model"]["head.weight"] == ref
    assert set(load_file(out / "model.safetensors")) == {"emb.weight", "body.weight", "body.bias"}


def test_views_that_are_not_aliases_are_stored_apart(tmp_path: Path) -> None:
    a = torch.arange(12.0).reshape(3, 4)
    state = {"t": {"A": a, "B": a[:1], "T": a.t(), "A2": a, "tail": a[1:]}}
    src = _save(tmp_path, state)
    (res,) = export_safetensors(LocalBackend(str(src)), 3, str(tmp_path / "out"))
    got = load_file(tmp_path / "out" / "t.safetensors")
    assert res.aliases == {"t.safetensors:A2": "t.safetensors:A"}  # same view: an alias
    assert set(got) == {"A", "B", "T", "tail"}
    assert torch.equal(got["A"], a) and torch.equal(got["B"], a[:1])
    assert torch.equal(got["T"], a.t()) and torch.equal(got["tail"], a[1:])


def _probe(dtype: torch.dtype, path: Path) -> bool:
    from safetensors.torch import save_file

    try:
        t = torch.zeros(dtype.itemsize, dtype=torch.uint8).view(dtype)
        save_file({"x": t}, path)
        return bool(load_file(path)["x"].dtype == dtype)
    except Exception:
        return False


def test_every_dtype_safetensors_stores_is_exported(tmp_path: Path) -> None:
    dtypes = sorted(
        {
            v
            for v in vars(torch).values()
            if isinstance(v, torch.dtype) and _probe(v, tmp_path / "p")
        },
        key=str,
    )
    wanted = {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2} & set(dtypes)
    assert wanted == {torch.float8_e8m0fnu, torch.float4_e2m1fn_x2}, "safetensors too old"
    g = torch.Generator().manual_seed(1)
    state = {
        "d": {
            str(dt).removeprefix("torch."): torch.randint(
                0, 255, (6,), generator=g, dtype=torch.uint8
            )
            .view(torch.uint8)
            .repeat(dt.itemsize)
            .view(dt)
            for dt in dtypes
        }
        | {"c128": torch.zeros(2, dtype=torch.complex128)}
    }
    src = _save(tmp_path, state)
    (res,) = export_safetensors(LocalBackend(str(src)), 3, str(tmp_path / "out"))
    got = load_file(tmp_path / "out" / "d.safetensors")
    assert res.skipped == ["d.safetensors:c128 (complex128)"]
    for k, v in state["d"].items():
        if k == "c128":
            continue
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def test_max_shard_size_writes_shards_and_an_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    src = _save(tmp_path, {"model": model.state_dict(), "epoch": 2})
    out = tmp_path / "out"
    (res,) = export_safetensors(LocalBackend(str(src)), 3, str(out), max_shard_size=10_000)
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and all(f.startswith("model-0000") for f in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert {os.path.basename(f) for f in res.files} == {
        *shards,
        "model.safetensors.index.json",
        "state.json",
    }
    # what a Hugging Face user does with a sharded folder
    from huggingface_hub import load_torch_model

    fresh = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    load_torch_model(fresh, out)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    doc = json.loads((out / "state.json").read_text())
    ref = doc["state"]["model"]["5.bias"]
    assert ref == {"$safetensors": index["weight_map"]["5.bias"], "name": "5.bias"}
    assert doc["state"]["epoch"] == 2


def test_cli_max_shard_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    src = _save(tmp_path, {"model": model.state_dict()})
    out = tmp_path / "out"
    assert main(["export", str(src), str(out), "--max-shard-size", "8KB"]) == 0
    assert (out / "model.safetensors.index.json").exists()
    assert "model-00001-of-" in capsys.readouterr().out
