"""One rank's shard read from one tier: index, chunks on the reader threads, tensors, tree."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt.arena import total_ram
from tierckpt.backends.base import Backend
from tierckpt.codecs import Codec, SupportsProgressiveDecode, codec_from_config
from tierckpt.errors import FormatError
from tierckpt.format import (
    FOOTER_SIZE,
    ChunkRecord,
    Manifest,
    ShardRef,
    dcp_metadata_name,
    tree_args,
)
from tierckpt.restore._chunks import ChunkReader
from tierckpt.restore._fetch import PIECE_BYTES, FetchStarts, warm
from tierckpt.restore._index import EarlyTail, as_parameters, read_index, rebuild_tensors
from tierckpt.restore._repopulate import Repopulation
from tierckpt.tree import decode_tree

__all__ = ["LoadedShard", "finish_shard", "read_shard", "refuse_dcp"]


@dataclass
class LoadedShard:
    state: Any
    manifest: Manifest
    tier: str
    raw_bytes: int
    stored_bytes: int
    seconds: float
    #: faster tiers this rank's shard file was copied to while loading (committed files)
    repopulated: list[Backend] = field(default_factory=list)
    #: seconds until every chunk was read, verified and decoded (the tier's read rate)
    read_seconds: float = 0.0
    #: whether any chunk was stored compressed (else ``stored_bytes / read_seconds`` is the
    #: link's read rate)
    compressed: bool = False


def read_shard(
    backend: Backend,
    tier: str,
    manifest: Manifest,
    rank: int,
    pool: ThreadPoolExecutor,
    *,
    repopulate: Sequence[Backend] = (),
    publish: bool = True,
    early: EarlyTail | None = None,
) -> LoadedShard:
    """Read, verify and decode one rank's shard from one tier.

    ``repopulate``: also copy the shard file to these tiers; ``publish``: and write the
    manifest there (False where the caller commits the copies: a Checkpointer's commit
    strategy, which with several ranks waits for every rank's file); ``early``: a read of the
    file's tail already started (:func:`~tierckpt.restore.start_tail`)."""
    refuse_dcp(manifest, f"tier {tier!r} {backend.url}")  # before any byte of the shard
    t0 = time.perf_counter()
    ref = manifest.shard_for(rank)
    where = f"tier {tier!r} {backend.url}/{ref.file}"
    # compressed chunks are fetched in pieces on their own pool while the reader threads
    # decode, and raw chunks from a remote store in segments straight into their storages (a
    # fetch never waits on a reader, so the two pools cannot deadlock). From a remote store
    # its threads are started while the index is read (each start waits for its thread to
    # run: a few ms on a busy host, else paid before the first GETs)
    fetch_pool = _fetch_pool(pool) if backend.is_remote else None
    if fetch_pool is not None:
        warm(fetch_pool, 2 * _workers(pool))
    try:
        index, index_blob, footer_blob = read_index(backend, ref, tier, early=early)
        codecs: list[Codec] = [codec_from_config(c) for c in index["codecs"]]
        data_bytes, chunks = _check_sizes(index, codecs, where)
        if fetch_pool is None and any(isinstance(c, SupportsProgressiveDecode) for c in codecs):
            fetch_pool = _fetch_pool(pool)
        sizes = [int(n) for _off, n in index["storages"]]
        span_offsets = [int(s[0]) for s in index["storages"]]
        # the storages the first chunk fills (and the next chunk's bytes in the part it ends in,
        # which its fetch may read together with its own: ``_scatter.Boundaries``) are allocated
        # first, the rest once that chunk's requests are on their way: a state of a thousand
        # tensors takes a few ms to allocate, which the first GETs need not wait for
        spans: list[torch.Tensor] = [_NONE] * len(sizes)
        first_hi = chunks[0].logical_offset + chunks[0].raw_size + PIECE_BYTES if chunks else 0
        _allocate(spans, sizes, span_offsets, lambda off: off < first_hi)
        repop = Repopulation(repopulate, ref.file)
        starts = FetchStarts(_workers(fetch_pool)) if fetch_pool is not None else None
        reader = ChunkReader(
            backend,
            ref.file,
            tier,
            where,
            codecs,
            chunks,
            spans,
            span_offsets,
            repop,
            fetch_pool,
            starts.tick if starts is not None else None,
            sizes=sizes,
        )
    except BaseException:
        if fetch_pool is not None:
            fetch_pool.shutdown(wait=True, cancel_futures=True)
        raise
    # every chunk is submitted first (the first before the other storages are allocated);
    # once the first requests are out (this thread's Python would hold the GIL they need to
    # be sent), the tensors (views of the storages) and the tree are built on this thread
    # while the readers fill the storages. The tree waits for the bytes only where it holds
    # a quantized tensor: rebuilding one copies its integers, which must have arrived by then
    futures: list[Future[int]] = []
    try:
        if chunks:
            futures.append(pool.submit(reader.read, 0))
        _allocate(spans, sizes, span_offsets, lambda off: off >= first_hi)
        futures += [pool.submit(reader.read, ci) for ci in range(1, len(chunks))]
        if starts is not None:
            starts.wait(futures)
        # cover every span byte: the chunks must tile the data stream
        covered = sum(c.raw_size for c in chunks)
        if covered != data_bytes:
            raise FormatError(f"{where}: chunks cover {covered} of {data_bytes} bytes")
        tensors = rebuild_tensors(index["tensors"], spans, sizes, where)
        as_parameters(tensors, index, where)
        tree_first = not _may_hold_quantized(index_blob)
        if tree_first:  # nothing in it reads the bytes: decoded while they download
            state = decode_tree(index.get("tree"), tensors, **tree_args(index))
        stored_total = sum(f.result() for f in futures)
        if not tree_first:
            state = decode_tree(index.get("tree"), tensors, **tree_args(index))
        read_seconds = time.perf_counter() - t0
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)  # nothing writes into the storages or the copies after this
        repop.abort()
        raise
    finally:
        if fetch_pool is not None:
            fetch_pool.shutdown(wait=True, cancel_futures=True)
    return finish_shard(
        repop,
        ref,
        index_blob,
        footer_blob,
        manifest,
        publish=publish,
        state=state,
        tier=tier,
        raw_bytes=data_bytes,
        stored_bytes=stored_total,
        t0=t0,
        read_seconds=read_seconds,
        compressed=any(not codecs[c.codec].is_passthrough for c in chunks),
    )


def refuse_dcp(manifest: Manifest, where: str) -> None:
    """``FormatError`` where ``manifest`` is of a checkpoint ``tierckpt.dcp.TierWriter`` wrote.

    Its shards hold DCP's items (keys ``'0'``, ``'1'``…, non-tensor values as ``torch.save``
    bytes), not the state that was saved: only DCP's metadata maps them back. The marker is
    the one ``TierReader`` reads: the manifest's ``dcp`` entry naming the step's DCP metadata
    file (``steps/<step>/dcp-metadata.json.zst``), a name no native save writes."""
    info = (manifest.metadata or {}).get("dcp")
    name = dcp_metadata_name(manifest.step, timeline=manifest.timeline)
    if isinstance(info, dict) and info.get("file") == name:
        raise FormatError(
            f"{where}: step {manifest.step} is a DCP checkpoint (written by "
            "tierckpt.dcp.TierWriter through torch.distributed.checkpoint.save), which "
            "Checkpointer.load cannot rebuild: load it with torch.distributed.checkpoint.load"
            f"(state, storage_reader=tierckpt.dcp.TierReader(tiers, {manifest.step}))"
        )


def finish_shard(
    repop: Repopulation,
    ref: ShardRef,
    index_blob: bytes | bytearray,
    footer_blob: bytes,
    manifest: Manifest,
    *,
    publish: bool,
    state: Any,
    tier: str,
    raw_bytes: int,
    stored_bytes: int,
    t0: float,
    read_seconds: float = 0.0,
    compressed: bool = False,
) -> LoadedShard:
    """The end of a shard's load, host or device (every chunk read and verified): the
    repopulated copies get the index and footer and are committed (and the manifest, where
    ``publish``), then the :class:`LoadedShard` (``seconds`` since ``t0``)."""
    copied = repop.finish(
        ref.size - FOOTER_SIZE - len(index_blob),
        index_blob + footer_blob,
        manifest if publish else None,
    )
    return LoadedShard(
        state,
        manifest,
        tier,
        raw_bytes,
        stored_bytes,
        time.perf_counter() - t0,
        copied,
        read_seconds,
        compressed,
    )


def _fetch_pool(pool: ThreadPoolExecutor) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2 * _workers(pool), thread_name_prefix="tierckpt-fetch")


def _check_sizes(
    index: dict[str, Any], codecs: Sequence[Codec], where: str
) -> tuple[int, list[ChunkRecord]]:
    """The index's data bytes (refused beyond this machine's memory) and chunks (a raw one
    must store what it declares)."""
    data_bytes = int(index["data_bytes"])
    if data_bytes > total_ram():
        raise FormatError(
            f"{where}: declares {data_bytes} bytes of tensor data, more than this machine's "
            "memory; refusing to allocate it"
        )
    chunks: list[ChunkRecord] = index["chunks"]
    for ci, rec in enumerate(chunks):
        if codecs[rec.codec].is_passthrough and rec.stored_size != rec.raw_size:
            raise FormatError(
                f"{where}: raw chunk {ci} stores {rec.stored_size} bytes "
                f"but declares {rec.raw_size}"
            )
    return data_bytes, chunks


#: a placeholder of a storage not allocated yet (never read: see ``read_shard``)
_NONE = torch.empty(0, dtype=torch.uint8)


def _allocate(
    spans: list[torch.Tensor],
    sizes: Sequence[int],
    offsets: Sequence[int],
    wanted: Callable[[int], bool],
) -> None:
    """Allocate the storages (fresh, untouched memory) whose data-stream offset is
    ``wanted``."""
    for si, n in enumerate(sizes):
        if wanted(offsets[si]):
            spans[si] = torch.empty(n, dtype=torch.uint8)


def _may_hold_quantized(index_blob: bytes | bytearray) -> bool:
    """Whether the index's tree may hold a quantized tensor (whose rebuild copies the
    integers, so the tree is decoded after the bytes arrived). Conservative: the tag's name
    anywhere in the JSON, or any ``\\u`` escape (which could spell it), counts."""
    return b"qtensor" in index_blob or b"\\u" in index_blob


def _workers(pool: ThreadPoolExecutor) -> int:
    n = getattr(pool, "_max_workers", 4)
    return n if isinstance(n, int) and n > 0 else 4
