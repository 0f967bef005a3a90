"""Hostile checkpoints: manifests and indexes crafted to escape, exhaust or execute.

Each case starts from a valid checkpoint written by the library, edits the manifest, index,
footer or chunk bytes, and re-seals every checksum (index, footer, manifest, and the chunk's
own checksum where chunk bytes change), so the parsers see the hostile values, not a checksum
mismatch. Loading each must:

* raise an error of the tierckpt family with a message that says what is wrong;
* write nothing anywhere (the whole test folder, the checkpoint included, is compared before
  and after; through S3 with repopulation, nothing outside the step's own local folder);
* allocate little (peak RSS growth of the loading process is sampled while it loads);
* execute nothing: pickle payloads that would create a marker file are never unpickled.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from helpers import assert_same
from rel_util import Recorder, RssSampler, fs_snapshot, reseal, seal_manifest

from tierckpt import Checkpointer, LocalTier, S3Tier, TierCkptError
from tierckpt.backends.local import LocalBackend
from tierckpt.backends.s3 import S3Backend
from tierckpt.format import checksum, manifest_name, shard_name

STEP = 7
RSS_BOUND = 64 << 20
MARKER_DIR = Path("/tmp")


class _Evil:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _evil_pickle(marker: Path) -> bytes:
    return pickle.dumps(_Evil(marker))


def _state() -> dict[str, Any]:
    return {
        "w": torch.arange(50_000, dtype=torch.float32),
        "b": torch.ones(10),
        "meta": {"k": 1, "t": (1, "x")},
    }


def _save(root: Path) -> None:
    with Checkpointer([LocalTier(root)], chunk_bytes=64 << 10) as ck:
        ck.save(_state(), STEP).wait(timeout=60)


# -- crafting helpers -----------------------------------------------------------------------


def _zstd_header_only(content_size: int) -> bytes:
    """A zstd frame whose header declares ``content_size`` bytes, with a 10-byte raw block."""
    magic = struct.pack("<I", 0xFD2FB528)
    fhd = bytes([0xC0])  # 8-byte frame content size, not single-segment
    window = bytes([0x00])
    fcs = struct.pack("<Q", content_size)
    block = (1 | (0 << 1) | (10 << 3)).to_bytes(3, "little") + b"\x00" * 10  # last, raw, 10 B
    return magic + fhd + window + fcs + block


def _zstd_zero_bomb(n: int) -> bytes:
    """A real zstd frame of ``n`` zero bytes with no content size in its header."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=False)
    obj = c.compressobj()
    zero = bytes(1 << 20)
    out = [obj.compress(zero) for _ in range(n >> 20)]
    out.append(obj.flush())
    return b"".join(out)


def _replace_last_chunk(stored: bytes, raw_size: int, codec: dict[str, Any]) -> dict[str, Any]:
    """reseal() arguments that make the last chunk ``stored`` (checksum re-sealed), declaring
    ``raw_size`` raw bytes decoded by ``codec``; data_bytes and the last storage follow."""
    box: dict[str, Any] = {}

    def data(region: bytearray, idx: dict[str, Any]) -> bytes:
        rec = idx["chunks"][-1]
        box["delta"] = raw_size - rec[1]
        return bytes(region[: rec[3]]) + stored

    def index(idx: dict[str, Any]) -> None:
        rec = idx["chunks"][-1]
        if codec not in idx["codecs"]:
            idx["codecs"].append(codec)
        rec[1], rec[2], rec[4], rec[5] = (
            raw_size,
            len(stored),
            idx["codecs"].index(codec),
            checksum(stored),
        )
        idx["data_bytes"] += box["delta"]
        idx["storages"][-1][1] += box["delta"]

    return {"data": data, "index": index}


def _chunk(i: int, field: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(idx: dict[str, Any]) -> None:
        idx["chunks"][i][field] = value

    return edit


def _tensor(field: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(idx: dict[str, Any]) -> None:
        idx["tensors"][0][field] = value

    return edit


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        d[key] = value

    return edit


def _shard(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        m["shards"][0][key] = value

    return edit


def _deep(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node]
    return node


def _raw_manifest_with(extra: bytes) -> Callable[[Path], bytes]:
    """A sealed manifest with ``extra`` (raw JSON text) spliced in after sealing."""

    def make(root: Path) -> bytes:
        body = json.loads((root / manifest_name(STEP)).read_bytes())
        text = seal_manifest(body)
        return text.replace(b'"format":', extra + b', "format":', 1)

    return make


@dataclass(frozen=True)
class Case:
    name: str
    expect: str  # regex on the error message
    edits: Callable[[Path, Path], dict[str, Any]]  # (root, marker) -> reseal() arguments
    pickle_marker: bool = False
    #: a harmless oddity: the checkpoint must load, bit-exact
    loads: bool = False


def _edits(**kw: Any) -> Callable[[Path, Path], dict[str, Any]]:
    return lambda root, marker: kw


def _pickle_index(root: Path, marker: Path) -> dict[str, Any]:
    return {"index_bytes": _evil_pickle(marker)}


def _pickle_manifest(root: Path, marker: Path) -> dict[str, Any]:
    return {"manifest_bytes": _evil_pickle(marker)}


def _pickle_tree(root: Path, marker: Path) -> dict[str, Any]:
    b64 = base64.b64encode(_evil_pickle(marker)).decode()
    return {"index": _set("tree", {"$dict": [["model", {"$pickle": b64}]]})}


def _reduce_tree(root: Path, marker: Path) -> dict[str, Any]:
    return {"index": _set("tree", {"$reduce": ["os.system", [f"touch {marker}"]]})}


def _deep_json_index(root: Path, marker: Path) -> dict[str, Any]:
    from rel_util import read_shard_parts

    blob, ft = read_shard_parts(LocalBackend(root), STEP)
    idx = blob[ft.index_offset : ft.index_offset + ft.index_length]
    deep = b'"tree":' + b"[" * 200_000 + b"]" * 200_000 + b',"x":'
    return {"index_bytes": idx.replace(b'"tree":', deep, 1)}


def _many_storages(n: int) -> Callable[[dict[str, Any]], None]:
    def edit(idx: dict[str, Any]) -> None:
        total = idx["data_bytes"]
        idx["storages"] = [[i, 1] for i in range(n - 1)] + [[n - 1, total - (n - 1)]]
        idx["tensors"] = [[n - 1, 0, "uint8", [1], [1], "cpu"]]
        idx["tree"] = {"$tensor": 0}

    return edit


CASES = [
    # manifest: names, sizes, structure
    Case(
        "manifest: shard path with ../ traversal",
        r"invalid object name",
        _edits(manifest=_shard("file", "steps/000000000007/../../../outside/evil.tck")),
    ),
    Case(
        "manifest: absolute shard path",
        r"invalid object name",
        _edits(manifest=_shard("file", "/tmp/tierckpt-evil.tck")),
    ),
    Case(
        "manifest: backslash path",
        r"invalid object name",
        _edits(manifest=_shard("file", "steps\\000000000007\\..\\..\\x.tck")),
    ),
    Case(
        "manifest: NUL in shard name",
        r"invalid object name",
        _edits(manifest=_shard("file", "steps/000000000007/rank\u0000.tck")),
    ),
    Case(
        "manifest: shard in another step's folder",
        r"outside step 7's folder",
        _edits(manifest=_shard("file", "steps/000000000001/rank-000000.tck")),
    ),
    Case(
        "manifest: shard name not a string",
        r"invalid object name",
        _edits(manifest=_shard("file", {"$path": "/etc/passwd"})),
    ),
    Case(
        "manifest: huge declared shard size (2**50)",
        r"manifest says 1125899906842624",
        _edits(manifest=_shard("size", 2**50)),
    ),
    Case("manifest: negative shard size", r"bad shard size", _edits(manifest=_shard("size", -64))),
    Case(
        "manifest: world_size 2**20 with one shard",
        r"exactly 1048576 shards",
        _edits(manifest=_set("world_size", 2**20)),
    ),
    Case("manifest: world_size 0", r"bad world_size", _edits(manifest=_set("world_size", 0))),
    Case(
        "manifest: step out of range", r"step must be an int", _edits(manifest=_set("step", 10**13))
    ),
    Case(
        "manifest: bad index checksum string",
        r"bad index checksum",
        _edits(manifest=_shard("index_checksum", "../../etc/passwd")),
    ),
    Case(
        "manifest: NaN literal",
        r"manifest",
        lambda root, marker: {"manifest_bytes": _raw_manifest_with(b'"x": NaN')(root)},
    ),
    Case(
        "manifest: 1e400 (infinite) number",
        r"manifest",
        lambda root, marker: {"manifest_bytes": _raw_manifest_with(b'"x": 1e400')(root)},
    ),
    Case(
        "manifest: 400-digit integer timestamp (informational field)",
        r"",
        _edits(manifest=_set("created", 10**400)),
        loads=True,
    ),
    Case(
        "manifest: nested 100,000 deep",
        r"not valid JSON",
        lambda root, marker: {
            "manifest_bytes": b'{"format":"tierckpt-manifest","x":'
            + b"[" * 100_000
            + b"]" * 100_000
            + b"}"
        },
    ),
    Case(
        "manifest: larger than 64 MiB",
        r"more than 67108864",
        lambda root, marker: {"manifest_bytes": b'{"x":"' + b"a" * (65 << 20) + b'"}'},
    ),
    Case("manifest: a JSON list", r"not a tierckpt manifest", _edits(manifest_bytes=b"[1, 2, 3]")),
    Case(
        "manifest: a pickle that runs a command",
        r"not valid JSON",
        _pickle_manifest,
        pickle_marker=True,
    ),
    # index: offsets, sizes, codecs
    Case(
        "index: negative chunk file offset", r"chunk 0 file offset", _edits(index=_chunk(0, 3, -1))
    ),
    Case("index: chunk offset 2**61", r"outside the file", _edits(index=_chunk(1, 3, 2**61))),
    Case(
        "index: overlapping chunks in the file", r"overlaps another", _edits(index=_chunk(1, 3, 0))
    ),
    Case(
        "index: overlapping chunks in the data",
        r"overlaps another in the data",
        _edits(index=_chunk(1, 0, 0)),
    ),
    Case("index: chunk raw size 2**41", r"chunk 0 raw size", _edits(index=_chunk(0, 1, 2**41))),
    Case(
        "index: a chunk missing (gap in the data)",
        r"cover",
        _edits(index=lambda idx: idx["chunks"].pop(1)),
    ),
    Case(
        "index: unknown codec id",
        r"unknown codec id 'ro0'",
        _edits(index=_set("codecs", [{"id": "ro0"}])),
    ),
    Case(
        "index: codec id naming a module attribute",
        r"unknown codec id 'os:system'",
        _edits(index=_set("codecs", [{"id": "os:system"}])),
    ),
    Case(
        "index: codec with an unknown parameter",
        r"bad config for codec 'raw'",
        _edits(index=_set("codecs", [{"id": "raw", "path": "/etc/passwd"}])),
    ),
    Case(
        "index: codec with a bad parameter value",
        r"codec 'zstd'",
        _edits(index=_set("codecs", [{"id": "zstd", "level": "max"}])),
    ),
    Case("index: empty codec table", r"codec", _edits(index=_set("codecs", []))),
    Case(
        "index: 2**50 bytes of tensor data declared",
        r"more than this machine's memory",
        _edits(
            index=lambda idx: (
                idx.__setitem__("data_bytes", 2**50),
                idx["storages"][-1].__setitem__(1, 2**50 - 200_000),
            )
        ),
    ),
    Case(
        "index: raw chunk declaring 1 GiB, storing 3 KiB",
        r"raw chunk 3 stores",
        lambda root, marker: _replace_last_chunk(b"x" * 3432, 1 << 30, {"id": "raw"}),
    ),
    Case(
        "index: zstd frame header declaring 4 GiB (decompression bomb)",
        r"chunk 3",
        lambda root, marker: _replace_last_chunk(
            _zstd_header_only(4 << 30), 4 << 30, {"id": "zstd", "level": 1, "threads": 1}
        ),
    ),
    Case(
        "index: 256 MiB zstd bomb declared as 3 KiB",
        r"chunk 3",
        lambda root, marker: _replace_last_chunk(
            _zstd_zero_bomb(256 << 20), 3432, {"id": "zstd", "level": 1, "threads": 1}
        ),
    ),
    Case(
        "index: storages overlapping",
        r"storage 1 overlaps",
        _edits(index=lambda idx: idx["storages"][1].__setitem__(0, 100)),
    ),
    Case("index: version 2", r"unsupported shard index version", _edits(index=_set("version", 2))),
    Case(
        "index: unknown checksum algorithm",
        r"unknown checksum algorithm",
        _edits(index=_set("checksum_algo", "none")),
    ),
    Case("index: a pickle instead of JSON", r"not valid JSON", _pickle_index, pickle_marker=True),
    Case("index: nested 200,000 deep", r"not valid JSON", _deep_json_index),
    # index: tensor table
    Case(
        "tensor: offset outside its storage",
        r"does not fit its storage",
        _edits(index=_tensor(1, 2**40)),
    ),
    Case("tensor: negative offset", r"outside the storage table", _edits(index=_tensor(1, -8))),
    Case(
        "tensor: storage id out of range",
        r"outside the storage table",
        _edits(index=_tensor(0, 99)),
    ),
    Case("tensor: negative shape", r"malformed shape", _edits(index=_tensor(3, [-1]))),
    Case(
        "tensor: 65 dimensions",
        r"malformed shape",
        _edits(index=lambda idx: idx["tensors"][0].__setitem__(slice(3, 5), [[1] * 65, [1] * 65])),
    ),
    Case(
        "tensor: 2**94 elements through zero strides",
        r"tensor 0",
        _edits(
            index=lambda idx: idx["tensors"][0].__setitem__(slice(3, 5), [[2**47, 2**47], [0, 0]])
        ),
    ),
    Case("tensor: dtype 'object'", r"unknown dtype", _edits(index=_tensor(2, "object"))),
    # index: object tree
    Case(
        "tree: a {'$pickle': ...} node that runs a command",
        r"unknown tag '\$pickle'",
        _pickle_tree,
        pickle_marker=True,
    ),
    Case(
        "tree: a {'$reduce': ['os.system', ...]} node",
        r"unknown tag '\$reduce'",
        _reduce_tree,
        pickle_marker=True,
    ),
    Case("tree: nested 300 deep", r"deeper than 200", _edits(index=_set("tree", _deep(300)))),
    Case(
        "tree: tensor reference out of range",
        r"tensor reference 99 out of range",
        _edits(index=_set("tree", {"$tensor": 99})),
    ),
    Case(
        "tree: a $ndarray of dtype 'object'",
        r"unknown NumPy dtype 'object'",
        _edits(index=_set("tree", {"$ndarray": [0, "object"]})),
    ),
    Case(
        "tree: a $ndarray whose tensor is of another dtype",
        r"tensor is torch.float32, not torch.complex128",
        _edits(index=_set("tree", {"$ndarray": [0, "complex128"]})),
    ),
    Case("tree: 5,000-digit $int", r"bad \$int", _edits(index=_set("tree", {"$int": "9" * 5000}))),
    Case(
        "tree: two tags in one node",
        r"malformed object node",
        _edits(index=_set("tree", {"$tuple": [], "$dict": []})),
    ),
    # footer
    Case(
        "footer: version 99",
        r"format version 99",
        _edits(
            footer=lambda f: type(f)(
                f.index_offset, f.index_length, f.index_checksum, f.file_size, 99
            )
        ),
    ),
    Case(
        "footer: index length 512 MiB",
        r"does not end at footer|index checksum differs",
        _edits(footer=lambda f: type(f)(f.index_offset, 512 << 20, f.index_checksum, f.file_size)),
    ),
    Case(
        "footer: file size 2**40",
        r"footer says 1099511627776",
        _edits(footer=lambda f: type(f)(f.index_offset, f.index_length, f.index_checksum, 2**40)),
    ),
]


def _load_hostile(
    root: Path, tiers: list[Any] | None = None
) -> tuple[BaseException | None, int, Any]:
    """(error or None, peak RSS growth, loaded state or None)."""
    with RssSampler() as rss:
        try:
            with Checkpointer(tiers or [LocalTier(root)]) as ck:
                state = ck.load(step=STEP)
        except BaseException as exc:
            return exc, rss.growth, None
    return None, rss.growth, state


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_checkpoint_refused(
    tmp_path: Path, case: Case, record: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "canary").write_text("untouched")
    _save(root)
    marker = MARKER_DIR / f"tierckpt-pwned-{uuid.uuid4().hex}"
    reseal(LocalBackend(root), STEP, **case.edits(root, marker))
    before = fs_snapshot(tmp_path)
    unpickled: list[str] = []
    for mod_attr in ("loads", "load"):
        real = getattr(pickle, mod_attr)

        def spy(*a: Any, _real: Any = real, _n: str = mod_attr, **k: Any) -> Any:
            unpickled.append(_n)
            return _real(*a, **k)

        monkeypatch.setattr(pickle, mod_attr, spy)
    exc, growth, state = _load_hostile(root)
    monkeypatch.undo()
    if case.loads:
        assert exc is None, repr(exc)
        assert_same(_state(), state)
        record("hostile", case.name, f"loads bit-exact (field ignored)  (RSS +{growth >> 20} MiB)")
        return
    assert exc is not None, "a hostile checkpoint loaded without an error"
    ok_family = isinstance(exc, TierCkptError)
    msg = str(exc)
    record(
        "hostile",
        case.name,
        f"{type(exc).__name__}: {msg[-140:]}  (RSS +{growth >> 20} MiB)",
        ok=ok_family and growth < RSS_BOUND,
    )
    assert ok_family, f"not a tierckpt error: {exc!r}"
    assert re.search(case.expect, msg), msg
    assert fs_snapshot(tmp_path) == before, "loading wrote to the filesystem"
    assert growth < RSS_BOUND, f"RSS grew by {growth >> 20} MiB"
    assert not marker.exists(), "a pickle payload ran"
    assert unpickled == [], f"pickle.{unpickled} was called while loading"


def test_manifest_of_another_step_is_refused(tmp_path: Path, record: Recorder) -> None:
    """A manifest named step-7 whose (valid, sealed) body is step 8's: load(step=7) must not
    silently return step 8's state."""
    root = tmp_path / "ckpt"
    _save(root)
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save({"other": torch.zeros(3)}, 8).wait()
    (root / manifest_name(STEP)).write_bytes((root / manifest_name(8)).read_bytes())
    with Checkpointer([LocalTier(root)]) as ck:
        try:
            got = ck.load(step=STEP)
        except TierCkptError as exc:
            record(
                "hostile",
                "manifest: step 8's manifest under step 7's name",
                f"{type(exc).__name__}: {str(exc)[-120:]}",
            )
            assert "step 8" in str(exc) or "step" in str(exc)
            return
    record(
        "hostile",
        "manifest: step 8's manifest under step 7's name",
        f"load(step=7) returned step 8's state: {sorted(got)}",
        ok=False,
    )
    raise AssertionError(f"load(step=7) returned another step's state: {sorted(got)}")


def test_many_storages_cost_what_they_declare(tmp_path: Path, record: Recorder) -> None:
    """100,000 one-byte storages in a 1.2 MB index: each becomes a buffer (like a real state
    with that many tensors); the cost per declared storage stays bounded (< 2 KiB)."""
    root = tmp_path / "ckpt"
    _save(root)
    n = 100_000
    reseal(LocalBackend(root), STEP, index=_many_storages(n))
    with RssSampler() as rss, Checkpointer([LocalTier(root)]) as ck:
        state = ck.load(step=STEP)
    assert state.numel() == 1
    per = rss.growth / n
    record(
        "hostile",
        f"index: {n} one-byte storages (1.2 MB index)",
        f"loads; RSS +{rss.growth >> 20} MiB, {per:.0f} B per declared storage",
        ok=per < 2048,
    )
    assert per < 2048, per


@pytest.mark.s3
def test_hostile_through_s3_repopulates_nothing_outside(
    tmp_path: Path, moto_server: Any, s3_bucket: Any, record: Recorder
) -> None:
    """Through an S3 tier with a local tier to repopulate: refused, and the local folder gets
    nothing but (at most) the step's own folder."""
    bucket = s3_bucket(moto_server)
    s3 = S3Tier(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url, codec="raw")
    picks = [
        c
        for c in CASES
        if c.name.startswith(
            (
                "manifest: shard path",
                "manifest: abs",
                "tree: a {'$pickle'",
                "index: zstd frame",
                "manifest: shard in another",
            )
        )
    ]
    assert len(picks) == 5
    for case in picks:
        root = tmp_path / uuid.uuid4().hex[:8]
        _save(root)
        b = S3Backend(f"s3://{bucket}/run", endpoint_url=moto_server.endpoint_url)
        for p in sorted(root.rglob("*")):
            if p.is_file():
                b.put_atomic(str(p.relative_to(root)), p.read_bytes(), overwrite=True)
        marker = MARKER_DIR / f"tierckpt-pwned-{uuid.uuid4().hex}"
        reseal(b, STEP, **case.edits(root, marker))
        local = tmp_path / f"node-{uuid.uuid4().hex[:6]}"
        local.mkdir()
        exc, growth, _ = _load_hostile(local, [LocalTier(local), s3])
        made = sorted(str(p.relative_to(local)) for p in local.rglob("*"))
        assert isinstance(exc, TierCkptError), repr(exc)
        # at most the (empty) folders of rank 0's copy: v1 names, or v2 under its prefix
        hh = shard_name(STEP, 0).split("/")[0]
        v2 = {hh, f"{hh}/steps", f"{hh}/steps/000000000007"}
        assert set(made) <= {"steps", "steps/000000000007", *v2}, made
        assert not marker.exists()
        assert growth < RSS_BOUND
        record(
            "hostile",
            f"via S3 + repopulated local tier: {case.name}",
            f"{type(exc).__name__}; local tier got {made or 'nothing'}",
        )
        for name in b.list(""):
            b.delete(name)
        b.close()


def test_hostile_checkpoints_through_tierckpt_verify(tmp_path: Path, record: Recorder) -> None:
    """``tools.verify_checkpoint`` (``tierckpt verify``) on every hostile case: a tierckpt
    error or a pass (verify checks chunks, not tensor records), never another exception, a
    write, an allocation of a declared size or a pickle run."""
    import shutil

    from tierckpt.offline import verify_checkpoint

    pristine = tmp_path / "pristine"
    _save(pristine)
    accepted = []
    for i, case in enumerate(c for c in CASES if not c.loads):
        root = tmp_path / f"case-{i}"
        shutil.copytree(pristine, root)
        marker = MARKER_DIR / f"tierckpt-pwned-{uuid.uuid4().hex}"
        reseal(LocalBackend(root), STEP, **case.edits(root, marker))
        before = fs_snapshot(tmp_path)
        with RssSampler() as rss:
            try:
                verify_checkpoint(LocalBackend(root), STEP)
                outcome = "verify passed (it checks chunks, not tensor records)"
                accepted.append(case.name)
            except TierCkptError as exc:
                outcome = f"{type(exc).__name__}: {str(exc)[-100:]}"
        record(
            "hostile",
            f"tierckpt verify: {case.name}",
            f"{outcome} (RSS +{rss.growth >> 20} MiB)",
            ok=rss.growth < RSS_BOUND,
        )
        assert fs_snapshot(tmp_path) == before, case.name
        assert rss.growth < RSS_BOUND, (case.name, rss.growth >> 20)
        assert not marker.exists()
        shutil.rmtree(root)
    # what verify lets through must be tensor/tree records only (load refuses those)
    assert all(n.startswith(("tensor:", "tree:")) for n in accepted), accepted
