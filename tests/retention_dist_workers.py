"""Per-rank functions of ``test_retention_dist.py``, run by :func:`dist_workers.run` as
``"retention_dist_workers:<function>"``."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch.distributed as dist
from dist_workers import rank_state, same

from tierckpt import Checkpointer, S3Tier
from tierckpt import distributed as tdist
from tierckpt.backends.base import ObjectWriter
from tierckpt.errors import CheckpointFailed
from tierckpt.format import shard_name

#: big enough that the shard's upload is a multipart one (8 MiB parts)
NUMEL = 5 << 20  # 20 MiB of float32


class _Stranded(ObjectWriter):
    """A shard writer whose link breaks once the store holds an unfinished upload of it, and
    whose abort cannot reach the store either (the link is still down; an abort never raises,
    so it only says so): the upload is left behind."""

    def __init__(self, real: ObjectWriter, backend: Any, file: str) -> None:
        super().__init__(file)
        self._real, self._backend, self._file = real, backend, file

    def write(self, offset: int, data: Any) -> None:
        if offset >= 9 << 20:
            deadline = time.monotonic() + 30
            while not any(self._file in u for u in self._backend.incomplete("")):
                if time.monotonic() > deadline:
                    raise AssertionError("no unfinished upload appeared")
                time.sleep(0.05)
            raise OSError(104, "Connection reset by peer")
        self._real.write(offset, data)

    def commit(self) -> None:
        raise AssertionError("never reached")

    def abort(self) -> None:
        logging.getLogger("tierckpt").warning("abort failed: Network is unreachable")


def w_stranded_upload(rank: int, world: int, s3: dict[str, str], victim: int) -> dict[str, Any]:
    """Step 1 commits; at step 2 ``victim``'s shard upload fails and its abort fails too, so
    an unfinished upload stays in the shared bucket; step 3 commits. Whoever applies retention
    to the shared tier (rank 0) must sweep the victim's upload although its own save of step 2
    wrote nothing wrong."""
    out: dict[str, Any] = {}
    tier = S3Tier(
        f"s3://{s3['bucket']}/run", endpoint_url=s3["endpoint"], keep_last=None, codec="raw"
    )
    with tdist.knobs(commit_timeout=120, poll_max=0.2):
        ck = Checkpointer([tier], host_buffer_bytes=64 << 20)
        backend = ck.backend(ck.tier_names[0])
        ck.save(rank_state(rank, 1, NUMEL), 1).wait(timeout=90)
        dist.barrier()
        if rank == victim:
            real_open = backend.open_writer

            def stranded(file: str) -> ObjectWriter:
                real = real_open(file)
                return _Stranded(real, backend, file) if file == shard_name(2, rank) else real

            backend.open_writer = stranded  # type: ignore[method-assign]
        try:
            ck.save(rank_state(rank, 2, NUMEL), 2).wait(timeout=90)
            out["error2"] = None
        except CheckpointFailed as exc:
            out["error2"] = sorted(type(e).__name__ for e in exc.errors.values())
        dist.barrier()
        if rank == victim:
            backend.open_writer = real_open  # type: ignore[method-assign]
        out["left_after_2"] = backend.incomplete("")
        dist.barrier()
        ck.save(rank_state(rank, 3, NUMEL), 3).wait(timeout=90)
        ck.wait(timeout=90, retention=True)  # rank 0's pass after the commit sweeps
        dist.barrier()
        out["left_after_3"] = backend.incomplete("")
        out["steps"] = ck.steps()
        out["diff3"] = same(ck.load(), rank_state(rank, 3, NUMEL))
        ck.close()
    return out
