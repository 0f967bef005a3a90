"""Hostile sizes: indexes and manifests re-sealed with tens of MiB of tiny JSON nodes.

Tiny JSON values cost far more as Python objects than as text (``[]``: 2 bytes of JSON, 64 of
memory): before the reader bounded its parses, a re-sealed 256 MiB index of empty lists took
7 GB of RSS to load, a 60 MiB manifest 1.9 GB for ``tierckpt ls``, and ``tierckpt verify``
then printed "ok". Each case builds such a checkpoint from a valid one (every checksum
re-sealed, so the parsers see the hostile bytes) and checks, in a fresh process whose peak RSS
(VmHWM) is compared with loading the valid checkpoint, that loading it is refused
with a tierckpt error naming the file while the peak stays near the valid load's, and that
``tierckpt verify`` / ``tierckpt ls`` exit non-zero without an "ok". The last case checks the
other side of the rule: reading a genuine index costs a small, bounded amount per tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
from rel_util import Recorder, read_shard_parts, reseal

import tierckpt
from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.format import FOOTER_SIZE, Footer, decode_index, manifest_name, with_counts
from tierckpt.jsonbound import scan

STEP = 7
JUNK_BYTES = 72 << 20  # of "[]," : 25 million empty lists
#: what reading the hostile checkpoint may add to the valid checkpoint's peak RSS
GROWTH_BOUND = 48 << 20
REPO = str(Path(tierckpt.__file__).resolve().parent.parent)

# the peak RSS of this process since exec: /proc's VmHWM (ru_maxrss would include the RSS of
# the pytest process that forked it: Linux carries the high-water mark across exec)
_PEAK = """
def peak_rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise RuntimeError("no VmHWM")
"""

_LOAD = (
    _PEAK
    + """
import json, sys
from tierckpt import Checkpointer, LocalTier, TierCkptError
try:
    with Checkpointer([LocalTier(sys.argv[1])]) as ck:
        ck.load(step=int(sys.argv[2]))
    out = "loaded"
except TierCkptError as exc:
    out = f"{type(exc).__name__}: {exc}"
print(json.dumps({"rss": peak_rss(), "out": out}))
"""
)

_CLI = (
    _PEAK
    + """
import sys
from tierckpt.cli import main
rc = main(sys.argv[1:])
print(f"RSS {peak_rss()}", file=sys.stderr)
sys.exit(rc)
"""
)


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def _load(root: Path) -> tuple[int, str]:
    """(peak RSS in bytes, outcome) of loading step STEP from ``root`` in a fresh process."""
    p = _run(_LOAD, str(root), str(STEP))
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    return int(doc["rss"]), str(doc["out"])


def _cli(*args: str) -> tuple[int, str, str, int]:
    """(exit status, stdout, stderr, peak RSS) of ``tierckpt ARGS`` in a fresh process."""
    p = _run(_CLI, *args)
    rss_lines = [ln for ln in p.stderr.splitlines() if ln.startswith("RSS ")]
    return p.returncode, p.stdout, p.stderr, int(rss_lines[-1].split()[1]) if rss_lines else 0


def _save(root: Path) -> None:
    state = {"w": torch.arange(50_000, dtype=torch.float32), "b": torch.ones(10), "m": {"k": 1}}
    with Checkpointer([LocalTier(root)], chunk_bytes=64 << 10) as ck:
        ck.save(state, STEP).wait(timeout=60)


def _junk() -> bytes:
    n = JUNK_BYTES // 3
    return b"[" + b"[]," * n + b"[]]"


def _index(root: Path) -> bytes:
    blob, ft = read_shard_parts(LocalBackend(root), STEP)
    return blob[ft.index_offset : ft.index_offset + ft.index_length]


def _junk_field(root: Path) -> dict[str, Any]:
    """An unknown field of tiny nodes appended; the counts left as the writer wrote them."""
    idx = _index(root)
    return {"index_bytes": idx[:-1] + b',"x":' + _junk() + b"}"}


def _junk_tree(root: Path) -> dict[str, Any]:
    """The object tree replaced by tiny nodes, the counts re-sealed to declare them."""
    parsed = json.loads(_index(root))
    parsed["tree"] = None
    sealed = with_counts(parsed)
    junk = _junk()
    sealed["counts"]["tree"] = scan(junk).items
    text = json.dumps(sealed, separators=(",", ":")).encode()
    return {"index_bytes": text.replace(b'"tree":null', b'"tree":' + junk, 1)}


def _junk_legacy(root: Path) -> dict[str, Any]:
    """No counts at all (the layout of tierckpt 0.1.0's indexes) and an unknown junk field."""
    parsed = json.loads(_index(root))
    parsed.pop("counts", None)
    text = json.dumps(parsed, separators=(",", ":")).encode()
    return {"index_bytes": text[:-1] + b',"x":' + _junk() + b"}"}


INDEX_CASES = {
    "index: 72 MiB of empty lists in an unknown field, counts as written": _junk_field,
    "index: 72 MiB of empty lists as the object tree, counts re-sealed": _junk_tree,
    "index: 72 MiB of empty lists, no counts (0.1.0 layout)": _junk_legacy,
}


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A valid checkpoint and the peak RSS of loading it in a fresh process."""
    root = tmp_path_factory.mktemp("valid") / "ckpt"
    _save(root)
    rss, out = _load(root)
    assert out == "loaded", out
    return root, rss


@pytest.mark.parametrize("name", list(INDEX_CASES))
def test_index_of_tiny_nodes_is_refused_early(
    tmp_path: Path, valid: tuple[Path, int], name: str, record: Recorder
) -> None:
    good, base_rss = valid
    root = tmp_path / "ckpt"
    shutil.copytree(good, root)
    reseal(LocalBackend(root), STEP, **INDEX_CASES[name](root))
    rss, out = _load(root)
    growth = rss - base_rss
    rc, stdout, stderr, verify_rss = _cli("verify", str(root))
    refused = out.startswith("FormatError") and "rank-000000.tck" in out
    record(
        "hostile",
        name,
        f"{out[-160:]}  (peak RSS +{growth >> 20} MiB over a valid load; verify exit {rc})",
        ok=refused and growth < GROWTH_BOUND and rc != 0,
    )
    assert refused, out[-2000:]
    assert growth < GROWTH_BOUND, f"peak RSS grew by {growth >> 20} MiB"
    assert rc != 0 and not any(ln.startswith("ok") for ln in stdout.splitlines()), stdout
    assert "rank-000000.tck" in stderr, stderr[-2000:]
    assert verify_rss - base_rss < GROWTH_BOUND, f"verify peak RSS {verify_rss >> 20} MiB"


def test_manifest_of_tiny_nodes_is_refused_early(
    tmp_path: Path, valid: tuple[Path, int], record: Recorder
) -> None:
    """60 MiB of empty lists in the metadata of a (re-sealed) manifest."""
    good, base_rss = valid
    root = tmp_path / "ckpt"
    shutil.copytree(good, root)
    path = root / manifest_name(STEP)
    body = json.loads(path.read_bytes())
    body.pop("checksum")
    canon = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    junk = b"[" + b"[]," * ((60 << 20) // 3) + b"[]]"
    canon = canon.replace(b'"metadata":{}', b'"metadata":{"x":' + junk + b"}", 1)
    crc = xxhash.xxh3_64_hexdigest(canon).encode()
    path.write_bytes(b'{"checksum":"' + crc + b'",' + canon[1:])
    _, _, _, ls_base = _cli("ls", str(good))
    rc, stdout, stderr, ls_rss = _cli("ls", str(root))
    rss, out = _load(root)
    record(
        "hostile",
        "manifest: 60 MiB of empty lists in its metadata",
        f"ls exit {rc} (peak RSS +{(ls_rss - ls_base) >> 20} MiB); load: {out[-120:]} "
        f"(+{(rss - base_rss) >> 20} MiB)",
        ok=rc != 0 and out.startswith("FormatError"),
    )
    assert rc != 0, stdout
    assert "step-000000000007.json" in stderr and "refused before parsing" in stderr, stderr
    # the manifest is read (64 MiB at most; the bytes and one copy), never parsed into objects
    assert ls_rss - ls_base < (120 << 20) + GROWTH_BOUND, f"ls peak RSS {ls_rss >> 20} MiB"
    assert out.startswith("FormatError") and "step-000000000007.json" in out, out
    assert rss - base_rss < (120 << 20) + GROWTH_BOUND


def test_reading_a_genuine_index_costs_little_per_tensor(tmp_path: Path, record: Recorder) -> None:
    """The other side of the rule: 20,000 tensors (weights and optimizer moments): the peak
    memory of parsing and checking their index stays under 2 KiB per tensor."""
    n = 10_000
    state = {
        "model": {f"layers.{i}.weight": torch.ones(4, 3) for i in range(n)},
        "optimizer": {"state": {i: {"step": 3, "exp_avg": torch.zeros(4, 3)} for i in range(n)}},
    }
    root = tmp_path / "ckpt"
    with Checkpointer([LocalTier(root)]) as ck:
        ck.save(state, STEP).wait(timeout=300)
    blob, ft = read_shard_parts(LocalBackend(root), STEP)
    index_bytes = bytes(blob[ft.index_offset : ft.index_offset + ft.index_length])
    assert Footer.decode(blob[-FOOTER_SIZE:], file_size=len(blob), where="x") == ft
    tracemalloc.start()
    try:
        index = decode_index(index_bytes, file_size=len(blob), where="x")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    tensors = len(index["tensors"])
    assert tensors == 2 * n
    per = peak / tensors
    record(
        "hostile",
        f"index: a genuine one of {tensors} tensors ({len(index_bytes) >> 10} KiB)",
        f"parsed and checked with {peak >> 20} MiB at peak, {per:.0f} B per tensor",
        ok=per < 2048,
    )
    assert per < 2048, per
