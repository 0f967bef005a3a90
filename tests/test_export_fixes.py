"""``tierckpt export`` field-test fixes: the tensor count with aliases, a second export into
the same folder, and the documented way to load an export into a model with tied weights
(the snippets are taken from docs/quickstart.md and docs/faq.md and run)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.cli import main
from tierckpt.export import export_safetensors

DOCS = Path(__file__).resolve().parent.parent / "docs"


class _Tied(torch.nn.Module):
    """The output head shares the embedding's weight (``head.weight = emb.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.body = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight


def _save(src: Path, *states: Any) -> str:
    with Checkpointer([LocalTier(src)]) as ck:
        for step, state in enumerate(states, 1):
            ck.save(state, step=step).wait()
    return str(src)


def _stored(out: Path) -> int:
    """Tensors the safetensors files in ``out`` hold."""
    n = 0
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            n += len(list(st.keys()))
    return n


# -- 1: the tensor count ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "single", "want"),
    [
        ({"a": "t", "b": "t", "c": "t", "d": "t"}, True, 1),  # one tensor, four names
        ({"m": {"x": "t", "y": "t"}}, False, 1),  # a tied pair
        ({"m": {"x": "t", "y": "t", "z": "u"}, "n": {"w": "u"}}, False, 3),
    ],
)
def test_tensor_count_counts_distinct_tensors_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: Any, single: bool, want: int
) -> None:
    t, u = torch.arange(4.0), torch.ones(2, 3)
    real = {k: ({n: {"t": t, "u": u}[x] for n, x in v.items()} if isinstance(v, dict) else t)
            for k, v in state.items()}  # fmt: skip
    src = _save(tmp_path / "ck", real)
    (res,) = export_safetensors(LocalBackend(src), 1, str(tmp_path / "api"), single_file=single)
    assert res.tensors == want == _stored(tmp_path / "api")
    argv = ["export", src, str(tmp_path / "cli"), *(["--single-file"] if single else [])]
    assert main(argv) == 0
    assert f"exported step 1 rank 0: {want} tensors" in capsys.readouterr().out
    assert _stored(tmp_path / "cli") == want


def test_tensor_count_with_shards_and_aliases(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()  # emb.weight (stored once for head.weight too), body.weight, body.bias
    src = _save(tmp_path / "ck", {"model": model.state_dict()})
    out = tmp_path / "out"
    (res,) = export_safetensors(LocalBackend(src), 1, str(out), max_shard_size=2000)
    assert (out / "model.safetensors.index.json").exists()
    assert res.tensors == 3 == _stored(out)


# -- 2: a second export into the same folder -------------------------------------------------------
def test_second_export_replaces_the_first(tmp_path: Path) -> None:
    t = torch.arange(6.0)
    src = _save(tmp_path / "ck", {"model": {"w": t}, "opt": {"s": t + 1}}, {"model": {"w": t + 2}})
    out = tmp_path / "out"
    assert main(["export", src, str(out), "--step", "1"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors", "opt.safetensors", "state.json"]
    (out / "notes.txt").write_text("mine")  # not tierckpt's: stays
    (out / "mine.safetensors").write_bytes(b"x")
    assert main(["export", src, str(out), "--step", "2"]) == 0
    assert sorted(os.listdir(out)) == [
        "mine.safetensors",
        "model.safetensors",
        "notes.txt",
        "state.json",
    ]
    assert torch.equal(safetensors.torch.load_file(out / "model.safetensors")["w"], t + 2)
    assert json.loads((out / "state.json").read_text())["step"] == 2


def test_export_replaces_rank_folders_and_sharded_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    src = _save(tmp_path / "ck", {"model": _Tied().state_dict(), "opt": {"s": torch.ones(3)}})
    out = tmp_path / "out"
    # an earlier export of several ranks (rank-NNNNNN/), one of them sharded
    export_safetensors(LocalBackend(src), 1, str(out / "rank-000001"), max_shard_size=2000)
    assert (out / "rank-000001" / "model.safetensors.index.json").exists()
    export_safetensors(LocalBackend(src), 1, str(out / "rank-000002"))
    (out / "rank-000002" / "keep.txt").write_text("mine")
    export_safetensors(LocalBackend(src), 1, str(out), single_file=True)
    assert sorted(os.listdir(out)) == ["rank-000002", "state.json", "state.safetensors"]
    assert os.listdir(out / "rank-000002") == ["keep.txt"]


def test_export_only_removes_what_a_tierckpt_state_json_lists(tmp_path: Path) -> None:
    src = _save(tmp_path / "ck", {"model": {"w": torch.ones(2)}})
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "victim.safetensors").write_bytes(b"x")
    (out / "a.safetensors").write_bytes(b"x")
    (out / "b.txt").write_bytes(b"x")
    (out / "rank-000000").mkdir()
    (out / "rank-000000" / "c.safetensors").write_bytes(b"x")
    # a tierckpt state.json naming files outside the folder or not safetensors: left alone
    doc = {"tierckpt_export": 1, "files": ["../victim.safetensors", "b.txt", "/etc/passwd"]}
    (out / "state.json").write_text(json.dumps(doc))
    # a state.json that is not a tierckpt export: nothing it lists is removed
    mine = {"files": ["c.safetensors"]}
    (out / "rank-000000" / "state.json").write_text(json.dumps(mine))
    export_safetensors(LocalBackend(src), 1, str(out))
    assert (tmp_path / "victim.safetensors").exists() and (out / "b.txt").exists()
    assert (out / "a.safetensors").exists() and (out / "rank-000000" / "c.safetensors").exists()
    assert json.loads((out / "rank-000000" / "state.json").read_text()) == mine


def test_a_failed_export_keeps_the_previous_one(tmp_path: Path) -> None:
    src = _save(tmp_path / "ck", {"model": {"w": torch.ones(2)}, "opt": {"s": torch.ones(1)}})
    out = tmp_path / "out"
    assert main(["export", src, str(out)]) == 0
    assert main(["export", src, str(out), "--step", "9"]) == 1  # no such checkpoint
    assert sorted(os.listdir(out)) == ["model.safetensors", "opt.safetensors", "state.json"]


# -- 3: the documented way to load an export with tied weights ------------------------------------
def _export_tied(tmp_path: Path, **kw: Any) -> _Tied:
    torch.manual_seed(0)
    model = _Tied()
    src = _save(tmp_path / "ck", {"model": model.state_dict(), "step": 1})
    assert main(["export", src, str(tmp_path / "out"), *kw.get("argv", [])]) == 0
    return model


def _check_loaded(fresh: _Tied, model: _Tied) -> None:
    assert fresh.head.weight is fresh.emb.weight  # still tied
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_quickstart_export_snippet_loads_a_tied_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = (DOCS / "quickstart.md").read_text()
    section = text.split("### Export for Hugging Face users", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the export section shows how to load the files"
    model = _export_tied(tmp_path)
    monkeypatch.chdir(tmp_path)
    fresh = _Tied()
    for code in blocks:
        exec(code, {"model": fresh})
    _check_loaded(fresh, model)


def _faq_loaders() -> list[str]:
    text = (DOCS / "faq.md").read_text()
    section = text.split("### How do I get my weights into a Hugging Face model?", 1)[1]
    section = section.split("\n### ", 1)[0]
    spans = re.findall(r"`([^`]+)`", section)
    found = [
        c
        for c in spans
        if ("(model" in c or c.startswith("model.load_state_dict(")) and "..." not in c
    ]  # the calls shown as the way to load (a counter-example elides its argument: ...)
    assert found, "the FAQ names the call that loads the export"
    return found


@pytest.mark.parametrize("sharded", [False, True])
def test_faq_export_answer_loads_a_tied_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    import huggingface_hub

    argv = ["--max-shard-size", "2KB"] if sharded else []
    model = _export_tied(tmp_path, argv=argv)
    assert (tmp_path / "out" / "model.safetensors.index.json").exists() == sharded
    monkeypatch.chdir(tmp_path)
    calls = [c for c in _faq_loaders() if ("load_torch_model" in c) == sharded]
    assert calls
    fresh = _Tied()
    env = {"model": fresh, "safetensors": safetensors, "huggingface_hub": huggingface_hub}
    eval(calls[0], env)
    _check_loaded(fresh, model)


def test_plain_load_state_dict_fails_for_tied_weights(tmp_path: Path) -> None:
    """Why the docs do not show ``model.load_state_dict(load_file(...))``: the file holds a
    tied tensor once, and its metadata maps the alias to the stored name."""
    _export_tied(tmp_path)
    path = tmp_path / "out" / "model.safetensors"
    with pytest.raises(RuntimeError, match='Missing key.*"head.weight"'):
        _Tied().load_state_dict(safetensors.torch.load_file(path))
    with safe_open(path, "pt") as st:
        assert st.metadata()["head.weight"] == "emb.weight"
        assert "head.weight" not in list(st.keys())


# -- 4: the shard size as the CLI takes it ---------------------------------------------------------
def test_max_shard_size_in_bare_bytes_and_binary_units_splits_the_export(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--max-shard-size 2000`` (bytes, as the API takes an int) failed inside
    huggingface_hub's parser ("Unit '00' not supported"), and so did ``1KiB``; both split now,
    and a size that is not one is a usage error naming the forms it takes."""
    src = _save(tmp_path / "src", {"m": {f"w{i}": torch.full((256,), float(i)) for i in range(4)}})
    for size in ("2000", "1KiB", "0.002MB"):
        out = tmp_path / f"out-{size}"
        rc = main(["export", src, str(out), "--max-shard-size", size])
        assert rc == 0, capsys.readouterr().err
        index = json.loads((out / "m.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 2, (size, shards)  # 4 KiB of tensors above a ~1-2 KB limit
        loaded: dict[str, torch.Tensor] = {}
        for f in shards:
            loaded.update(safetensors.torch.load_file(str(out / f)))
        assert all(torch.equal(loaded[f"w{i}"], torch.full((256,), float(i))) for i in range(4))
    for bad in ("5XB", "-3", "0", "lots"):
        rc = main(["export", src, str(tmp_path / "bad"), "--max-shard-size", bad])
        err = capsys.readouterr().err
        assert rc == 2 and ("500MB, 5GB, 2GiB" in err or "above 0" in err), (bad, err)
    assert not (tmp_path / "bad").exists()


def test_an_export_onto_a_file_says_a_folder_is_needed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tierckpt export ck model.safetensors`` said only "[Errno 17] ...: File exists"."""
    src = _save(tmp_path / "src", {"w": torch.ones(8)})
    (tmp_path / "afile").write_text("mine")
    for out in ("afile", "afile/sub"):
        rc = main(["export", src, str(tmp_path / out)])
        err = capsys.readouterr().err
        assert rc == 1 and "where a folder is needed: give the export a folder" in err, err
    assert (tmp_path / "afile").read_text() == "mine"
