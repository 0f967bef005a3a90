"""A node-RAM restore (mapped, ``tierckpt.noderam_map``) does little before it reads: the
shard file is opened once (its map), its footer and index read from the mapping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import json, sys, torch
from tierckpt import Checkpointer, NodeRamTier

root = sys.argv[1]
state = {f"l{i}": torch.randn(1 << 16, generator=torch.Generator().manual_seed(i)) for i in range(3)}
tiers = lambda: [NodeRamTier(path=root, namespace="job", stale_after_s=None)]
ck = Checkpointer(tiers(), chunk_bytes=1 << 17)
ck.save(state, 1).wait(timeout=60)
ck.close()
opens = []
sys.addaudithook(lambda ev, args: opens.append(str(args[0])) if ev == "open" else None)
ck = Checkpointer(tiers())
got = ck.load()
shard_opens = [p for p in opens if p.endswith(".tck")]
same = all(torch.equal(got[k], v) for k, v in state.items())
ck.close()
print(json.dumps({"shard_opens": shard_opens, "same": same}))
"""


def test_a_mapped_node_ram_restore_opens_the_shard_file_once(shm: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(shm)],
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(root))},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["same"]
    # the map's open only: the footer and index come from the mapping
    assert len(out["shard_opens"]) == 1, out["shard_opens"]
