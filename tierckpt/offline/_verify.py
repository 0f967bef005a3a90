"""Read every byte of a checkpoint and check it: manifest, index, every chunk's checksum, the
object tree."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from tierckpt.arena import total_ram
from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, codec_from_config
from tierckpt.errors import (
    CheckpointNotFound,
    CorruptChunk,
    FormatError,
)
from tierckpt.format import (
    CheckpointId,
    ChunkRecord,
    Manifest,
    ShardRef,
    checksum,
    tree_args,
)
from tierckpt.offline._listing import Progress, _id
from tierckpt.restore import read_index, read_manifest
from tierckpt.tree import decode_tree


# -- verify ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class VerifyReport:
    step: int
    shards: int
    chunks: int
    raw_bytes: int
    stored_bytes: int
    timeline: int = 0
    #: a node-local copy (:func:`held_shards`): the ranks whose files it holds (checked)
    node_ranks: tuple[int, ...] = ()


def held_shards(backend: Backend, manifest: Manifest) -> tuple[ShardRef, ...]:
    """The shard files of ``manifest`` to check on ``backend``: every one, or for a node-local
    copy (``manifest.node_local``: a private tier of a multi-rank job, one folder per node)
    those of its node's ranks, the files there; ``CheckpointNotFound`` where it holds none."""
    if not manifest.node_local:
        return manifest.shards
    here = tuple(ref for ref in manifest.shards if backend.exists(ref.file))
    if not here:
        raise CheckpointNotFound(
            f"{backend.url}: a node-local copy of {manifest.id} that holds none of its "
            f"{manifest.world_size} ranks' shard files"
        )
    if len(here) < len(manifest.shards):
        # a rank of this node (its files are in this folder for other steps) whose file is
        # missing here is damage, not another node's rank
        mine = {int(m.group(1)) for n in backend.list("") if (m := _RANK_FILE.search(n))}
        lost = [r.rank for r in manifest.shards if r not in here and r.rank in mine]
        if lost:
            raise CheckpointNotFound(
                f"{backend.url}: the node-local copy of {manifest.id} misses the shard files "
                f"of rank(s) {lost}, whose files this folder holds for other steps"
            )
    return here


_RANK_FILE = re.compile(r"/rank-(\d+)\.tck$")


def verify_checkpoint(
    backend: Backend,
    step: int | CheckpointId,
    *,
    progress: Progress | None = None,
    timeline: int | None = None,
) -> VerifyReport:
    """Read every chunk of every rank, check its checksum and decode it.

    Raises on the first problem: :class:`~tierckpt.errors.CorruptChunk` (naming the file and
    chunk) for a bad chunk, :class:`~tierckpt.errors.CorruptCheckpoint` or
    :class:`~tierckpt.errors.FormatError` for a bad manifest, footer or index. Memory use is
    one chunk, not the checkpoint.
    """
    cid = _id(backend, step, timeline)
    manifest = read_manifest(backend, cid.step, backend.url, timeline=cid.timeline)
    n_chunks = raw_total = stored_total = 0
    refs = held_shards(backend, manifest)
    for ref in refs:
        where = f"{backend.url}/{ref.file}"
        index, _blob, _footer = read_index(backend, ref, backend.url)
        codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
        chunks: list[ChunkRecord] = index["chunks"]
        for ci, rec in enumerate(chunks):
            stored = backend.read(ref.file, rec.file_offset, rec.stored_size)
            if checksum(stored) != rec.checksum:
                raise CorruptChunk(
                    f"{where}: chunk {ci} of {len(chunks)} (file bytes "
                    f"{rec.file_offset}..+{rec.stored_size}) does not match its checksum",
                    tier=backend.url,
                    file=ref.file,
                    chunk=ci,
                )
            if rec.raw_size > total_ram():  # a hostile size: refuse before allocating
                raise FormatError(
                    f"{where}: chunk {ci} declares {rec.raw_size} raw bytes, "
                    "more than this machine's memory"
                )
            # uninitialized (a zeroed bytearray would touch every page of a declared size
            # that a bomb's frame never fills); memory is used only as a frame decodes
            out = torch.empty(rec.raw_size, dtype=torch.uint8)
            try:
                codecs[rec.codec].decode(stored, memoryview(out.numpy()))  # type: ignore[arg-type]
            except CorruptChunk as exc:
                raise CorruptChunk(
                    f"{where}: chunk {ci} does not decode: {exc}",
                    tier=backend.url,
                    file=ref.file,
                    chunk=ci,
                ) from exc
            n_chunks += 1
            raw_total += rec.raw_size
            stored_total += rec.stored_size
            if progress is not None:
                progress(rec.stored_size)
        covered = sum(c.raw_size for c in chunks)
        if covered != int(index["data_bytes"]):
            raise FormatError(f"{where}: chunks cover {covered} of {index['data_bytes']} bytes")
        _check_tree(index, where)
    node_ranks = tuple(r.rank for r in refs) if manifest.node_local else ()
    return VerifyReport(
        cid.step, len(refs), n_chunks, raw_total, stored_total, cid.timeline, node_ranks
    )


def _check_tree(index: dict[str, Any], where: str) -> None:
    """Decode the object tree; every tensor reference must be in the tensor table."""
    n = len(index["tensors"])

    def ref(i: int) -> None:
        if not 0 <= i < n:
            raise FormatError(f"{where}: object tree refers to tensor {i} of {n}")

    decode_tree(index.get("tree"), ref, **tree_args(index))
