"""A node-local copy (a private tier of a multi-rank job: one folder per node) lists every
rank's shard file and holds its node's: checks of it skip the other nodes' ranks, not a rank of
its own whose file is missing."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from tierckpt import Checkpointer, LocalTier
from tierckpt.backends.local import LocalBackend
from tierckpt.errors import CheckpointNotFound
from tierckpt.format import decode_manifest, encode_manifest, manifest_name
from tierckpt.offline import verify_checkpoint


def _as_node_local(root: Path, step: int, *, with_rank_1: bool) -> None:
    """Rewrite a one-rank checkpoint as a two-rank node-local copy; rank 1's file is there
    (a copy of rank 0's) only ``with_rank_1``."""
    path = root / manifest_name(step)
    m = decode_manifest(path.read_bytes(), where=str(path))
    ref0 = m.shards[0]
    ref1 = dataclasses.replace(ref0, rank=1, file=ref0.file.replace("rank-000000", "rank-000001"))
    if with_rank_1:
        shutil.copyfile(root / ref0.file, root / ref1.file)
    node = dataclasses.replace(m, world_size=2, shards=(ref0, ref1), node_local=True)
    path.write_bytes(encode_manifest(node))


def test_a_missing_file_of_this_folders_own_rank_is_damage(tmp_path: Path) -> None:
    root = tmp_path / "node"
    with Checkpointer([LocalTier(root, keep_last=None)]) as ck:
        for s in (1, 2, 3):
            ck.save({"w": torch.full((64,), float(s))}, s).wait()
    _as_node_local(root, 1, with_rank_1=False)  # rank 1's file is on its node: fine
    backend = LocalBackend(root)
    assert verify_checkpoint(backend, 1).node_ranks == (0,)
    _as_node_local(root, 2, with_rank_1=True)  # both ranks' files here
    assert verify_checkpoint(backend, 2).node_ranks == (0, 1)
    _as_node_local(root, 3, with_rank_1=False)  # rank 1 has files here (step 2): damage
    with pytest.raises(CheckpointNotFound, match=r"misses the shard files of rank\(s\) \[1\]"):
        verify_checkpoint(backend, 3)
