"""The savers compared: one :class:`Contender` per way to save, behind one small interface
(``start`` is the save call; the waits mark the later milestones)."""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from tierckpt.bench.config import BenchConfig
from tierckpt.bench.probes import empty_dir, fsync_tree, median


class Contender(ABC):
    """One way to save: ``start`` is the save call; the waits mark the later milestones."""

    #: True when staging runs in the background (so a lazy run means something)
    background = False

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        self.out = out
        self.cfg = cfg
        out.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def start(self, state: dict[str, Any], step: int) -> None: ...

    def wait_staged(self) -> None:
        """Return once the state may be modified again."""

    @abstractmethod
    def wait_committed(self) -> None: ...

    def cleanup(self) -> None:
        """Delete what the last save wrote (untimed, between runs)."""
        empty_dir(self.out)

    def close(self) -> None:
        pass

    def extra(self) -> dict[str, Any]:
        return {}

    def milestones(self, t0: float) -> dict[str, float]:
        """Extra per-save times (from ``t0``, the start of the save call) a contender knows."""
        return {}


class TorchSave(Contender):
    def start(self, state: dict[str, Any], step: int) -> None:
        path = self.out / f"step-{step}.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    def wait_committed(self) -> None:
        pass


class DcpSave(Contender):
    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        dcp.save(state, checkpoint_id=str(self.out / f"step-{step}"))

    def wait_committed(self) -> None:
        pass


class DcpAsync(Contender):
    """``dcp.async_save`` with its defaults (a new, synchronous stager on every call)."""

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        self._future: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        self._future = dcp.async_save(state, checkpoint_id=str(self.out / f"step-{step}"))

    def wait_committed(self) -> None:
        f = self._future
        (f.upload_completion if hasattr(f, "upload_completion") else f).result()


class DcpAsyncStager(Contender):
    """``dcp.async_save`` with one reused ``DefaultStager`` staging in a background thread.

    The strongest DCP setting on a CPU-only machine: pinned memory and non-blocking copies
    need CUDA, shared memory only serves the process-based upload executor.
    """

    background = True

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=cuda,
            )
        )
        self._resp: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        from torch.distributed.checkpoint import state_dict_saver as dcp

        self._resp = dcp.async_save(
            state, checkpoint_id=str(self.out / f"step-{step}"), async_stager=self._stager
        )

    def wait_staged(self) -> None:
        self._resp.staging_completion.result()

    def wait_committed(self) -> None:
        self._resp.upload_completion.result()

    def close(self) -> None:
        self._stager.close()


class TorchCheckpointingAsync(Contender):
    """torch-checkpointing's ``CheckpointManager`` in its default async mode.

    Its writer is a child process fed through shared memory; its files are not fsync'd, so
    ``committed`` adds an fsync of every file it wrote (reported apart as ``fsync_s``).
    """

    background = True

    def __init__(self, out: Path, cfg: BenchConfig) -> None:
        super().__init__(out, cfg)
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self._mgr = CheckpointManager(
            CheckpointManager.Config(
                storage_config=LocalFileSystemStorageConfig(use_direct_io=False)
            )
        )
        self._future: Any = None
        self._path = out
        self._fsync_s: list[float] = []

    def start(self, state: dict[str, Any], step: int) -> None:
        self._path = self.out / f"step-{step}"
        self._future = self._mgr.save(str(self._path), state)

    def wait_staged(self) -> None:
        with self._mgr.lock():  # its documented guard for the optimizer step
            pass

    def wait_committed(self) -> None:
        self._future.result()
        t0 = time.perf_counter()
        fsync_tree(self._path)
        self._fsync_s.append(time.perf_counter() - t0)

    def close(self) -> None:
        self._mgr.close()

    def extra(self) -> dict[str, Any]:
        return {"fsync_s_median": median(self._fsync_s), "writes_fsync": False}


class Tierckpt(Contender):
    background = True

    def __init__(self, out: Path, cfg: BenchConfig, arena_bytes: int | None) -> None:
        super().__init__(out, cfg)
        from tierckpt import Checkpointer, LocalTier

        self.ck = Checkpointer([LocalTier(out, keep_last=None)], host_buffer_bytes=arena_bytes)
        self._handle: Any = None

    def start(self, state: dict[str, Any], step: int) -> None:
        self._handle = self.ck.save(state, step)

    def wait_staged(self) -> None:
        self.ck.wait_captured()

    def wait_committed(self) -> None:
        self._handle.wait("local")

    def milestones(self, t0: float) -> dict[str, float]:
        h = self._handle
        return {"captured_at_s": h.captured_at - t0} if h.captured_at is not None else {}

    def cleanup(self) -> None:
        backend = self.ck.backend("local")
        for name in backend.list(""):
            if not name.startswith("leases/"):  # the writer's own lease stays while it writes
                backend.delete(name)

    def close(self) -> None:
        self.ck.close()

    def extra(self) -> dict[str, Any]:
        p = getattr(self.ck, "_pipeline", None)  # internals: report what is there
        arena = getattr(p, "arena", None)
        return {
            "host_buffer_bytes": self.ck.host_buffer_bytes,
            "chunk_bytes": self.ck.chunk_bytes,
            "arena_bytes": arena.nbytes if arena is not None else None,
            "arena_slots": arena.live_slots if arena is not None else None,
            "arena_alloc_s": arena.alloc_seconds if arena is not None else None,
        }


def make_contender(name: str, out: Path, cfg: BenchConfig) -> Contender:
    if name == "torch_save":
        return TorchSave(out, cfg)
    if name == "dcp_save":
        return DcpSave(out, cfg)
    if name == "dcp_async":
        return DcpAsync(out, cfg)
    if name == "dcp_async_stager":
        return DcpAsyncStager(out, cfg)
    if name == "tc_async":
        return TorchCheckpointingAsync(out, cfg)
    if name == "tierckpt_256m":
        return Tierckpt(out, cfg, cfg.arena_bytes)
    if name == "tierckpt_default":
        return Tierckpt(out, cfg, None)
    raise ValueError(f"unknown contender {name!r}")
