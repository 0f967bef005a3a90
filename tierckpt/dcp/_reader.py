"""``TierReader``: DCP's metadata from the fastest tier holding the step, then each rank's
shard read by ranges and verified, falling back tier by tier (see :mod:`tierckpt.dcp`)."""

from __future__ import annotations

import io
import logging
import os
import uuid
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt import config
from tierckpt.catalog import list_tiers, unreadable
from tierckpt.checkpointer._near import near_tiers
from tierckpt.dcp._common import (
    MAX_METADATA_BYTES,
    TiersArg,
    _parse_location,
    _parse_step,
    _runtimes,
    note_loaded,
)
from tierckpt.dcp._metadata import ItemLocation, decode_metadata
from tierckpt.dcp._shardfile import _ShardFile
from tierckpt.dcp._writer import TierWriter
from tierckpt.distributed import (
    checkpoint_key,
    checkpoint_of_key,
    collective_device,
    get_knobs,
)
from tierckpt.errors import (
    CheckpointNotFound,
    CorruptCheckpoint,
    FormatError,
)
from tierckpt.format import CheckpointId, Manifest, checksum, dcp_metadata_name, manifest_name
from tierckpt.pipeline import Tier
from tierckpt.redact import redact
from tierckpt.restore import (
    is_recoverable,
    read_manifest,
)
from tierckpt.urls import as_policy

log = logging.getLogger("tierckpt")


#: a single process's load of the newest step: how often it lists again when the step it
#: chose was deleted before its metadata was read (as Checkpointer.load)
LIST_ATTEMPTS = 5
#: a load of the newest step: how many of the newest checkpoints are checked to be DCP ones
#: (a native checkpoint among them is skipped; older ones are offered to the agreement as
#: they are listed)
DCP_CHECKED = 3
#: what a TiersUnreadable of a DCP load advises besides restoring access to the store
_REMEDY = "pass TierReader only the tiers you can read"


class TierReader(StorageReader):
    """A DCP ``StorageReader`` over tierckpt tiers (see the module docstring).

    Args:
        tiers: tier specs fastest first, or a :class:`TierPolicy`; a folder path or URL
            (``"/nvme/run1"``, ``"s3://bucket/run1"``) is that one tier (:func:`tierckpt.tier`),
            and a list may mix tiers and locations.
        step: the step to load; ``None``: the newest DCP checkpoint committed on some tier
            that every rank sees (one ``all_gather`` on the default process group in
            ``read_metadata`` when it is initialized — name the step when only some ranks
            load, e.g. ``no_dist=True`` inside a multi-rank job); native checkpoints
            (``Checkpointer``'s) on the same tiers are passed over. Or the location a
            ``TierWriter`` reported (``dcp.save(...).storage_meta.checkpoint_id``, e.g.
            ``/ck/steps/000000000100``): that step of that timeline. DCP's
            ``checkpoint_id`` takes the same.
        io_threads: shards read in parallel (default 4).

    Each item is read from the fastest tier that holds the step; a corrupt or missing shard
    falls back to the next tier holding the same step.

    A reader pickles as its configuration (tiers, step, threads): the copy opens its own
    backends (clients are never pickled) and starts a fresh load.
    """

    def __init__(self, tiers: TiersArg, step: int | str | None = None, *, io_threads: int = 4):
        super().__init__()
        self.policy = as_policy(tiers)
        self.io_threads = max(1, io_threads)
        self.load_id = uuid.uuid4().hex
        self._tiers = _runtimes(self.policy, create=False)
        #: the timeline a location names (None: the newest holding the step)
        self.step: int | None = None
        self.timeline: int | None = None
        if step is not None:
            self.step, self.timeline = self._checkpoint_of(step)
        self._holders: list[tuple[Tier, Manifest]] = []
        #: the last listing: what each tier that could be listed holds, and why the others
        #: could not be
        self._listed: dict[str, set[CheckpointId]] = {}
        self._unlisted: dict[str, str] = {}
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}
        self.loaded_step: int | None = None
        #: the checkpoint read (its step and timeline)
        self.loaded_id: CheckpointId | None = None

    _PICKLED = ("policy", "step", "timeline", "io_threads", "loaded_step", "loaded_id")

    def __getstate__(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._PICKLED}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k in self._PICKLED:
            setattr(self, k, state[k])
        self.load_id = uuid.uuid4().hex
        self._tiers = _runtimes(self.policy, create=False)
        self._holders = []
        self._listed = {}
        self._unlisted = {}
        self.storage_data = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.step, self.timeline = self._checkpoint_of(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.storage_data = {}
        self._holders = []

    def _checkpoint_of(self, checkpoint_id: object) -> tuple[int, int | None]:
        """The step and timeline (None: the newest holding it) ``checkpoint_id`` names: a
        step, or a location ``TierWriter`` reported on one of this reader's tiers."""
        loc = _parse_location(checkpoint_id)
        if loc is None:
            return _parse_step(checkpoint_id), None
        url, cid = loc
        urls = [t.backend.url.rstrip("/") for t in self._tiers]
        if url not in urls:
            raise ValueError(
                f"checkpoint_id {str(checkpoint_id)!r} is {cid} on {url}, which is not "
                f"one of this TierReader's tiers ({', '.join(urls)})"
            )
        return cid.step, cid.timeline

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _parse_location(checkpoint_id) is not None or TierWriter.validate_checkpoint_id(
            checkpoint_id
        )

    # named ``**options``, not ``**kwargs``: DCP asks a reader whose read_metadata has a
    # parameter called "kwargs" for per-rank metadata (read_metadata(rank=r)) after the
    # global read failed, and adds that second failure to the error; tierckpt DCP
    # checkpoints hold global metadata only, so the first error is the one to read
    def read_metadata(self, *args: Any, **options: Any) -> Metadata:
        if options.get("rank") is not None:
            raise CheckpointNotFound("tierckpt DCP checkpoints hold global metadata only")
        for attempt in range(LIST_ATTEMPTS):
            cid = (
                self._newest_id()
                if self.step is None
                else self._id_of_step(self.step, self.timeline)
            )
            md, errors = self._metadata_of(cid)
            if md is not None:
                break
            if errors or self.step is not None or attempt == LIST_ATTEMPTS - 1 or _distributed():
                raise CheckpointNotFound(
                    f"DCP {cid} is not readable on any tier "
                    f"({', '.join(t.name for t in self._tiers)})"
                    + (": " + "; ".join(errors) if errors else "")
                )
            # the newest checkpoint listed was deleted since (a writer's keep_last): list again
            log.info("DCP load: %s was deleted since it was listed; listing again", cid)
        assert md is not None  # the loop ends with it or raises
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        self.loaded_step = cid.step
        self.loaded_id = cid
        # the next DCP save of these tiers in this process sees the load (a rollback to an
        # older checkpoint saves on a new timeline: see choose_timeline)
        note_loaded((t.backend.url for t in self._tiers), cid)
        return md

    def _metadata_of(self, cid: CheckpointId) -> tuple[Metadata | None, list[str]]:
        """``cid``'s DCP metadata from the first tier whose listing holds it that can read it
        (None if none), and why others could not; the tiers holding it are kept for the
        reads (``_holders``)."""
        errors: list[str] = []
        md: Metadata | None = None
        self._holders = []
        for t in self._tiers:
            if cid not in self._listed.get(t.name, ()):
                continue  # not committed there, or not listed (a hung store): not asked
            try:
                m = read_manifest(t.backend, cid.step, t.name, timeline=cid.timeline)
                if md is None:
                    md = self._read_metadata_object(t, m)
                self._holders.append((t, m))
            except CheckpointNotFound:
                continue
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
                errors.append(f"tier {t.name!r}: {exc}")
                log.warning("DCP metadata of %s on tier %s unreadable: %s", cid, t.name, exc)
        return md, errors

    def _read_metadata_object(self, t: Tier, m: Manifest) -> Metadata:
        where = f"tier {t.name!r} {t.backend.url}"
        info = (m.metadata or {}).get("dcp")
        if not isinstance(info, dict):
            raise FormatError(
                f"{where}: step {m.step} is not a DCP checkpoint (load it with Checkpointer.load)"
            )
        name = dcp_metadata_name(m.step, timeline=m.timeline)
        size = info.get("size")
        if info.get("file") != name or type(size) is not int or not 0 < size <= MAX_METADATA_BYTES:
            raise FormatError(f"{where}: malformed DCP entry in the manifest of step {m.step}")
        blob = t.backend.get(name)
        if len(blob) != size or checksum(blob) != info.get("checksum"):
            raise CorruptCheckpoint(f"{where}/{name}: DCP metadata does not match its checksum")
        return decode_metadata(blob, where=f"{where}/{name}")

    def _listing(self) -> list[CheckpointId]:
        listing, self._unlisted = list_tiers(
            ((t.name, t.backend) for t in self._tiers), config.lease_wait_s()
        )
        self._listed = {n: set(ids) for n, ids in listing.items() if n not in self._unlisted}
        return sorted({c for ids in listing.values() for c in ids}, reverse=True)

    def _id_of_step(self, step: int, timeline: int | None = None) -> CheckpointId:
        """``step`` of ``timeline``, or of the newest timeline holding it (timeline 0 if none:
        not found later; ``TiersUnreadable`` where a tier that could not be listed may hold
        it)."""
        listing = self._listing()
        if timeline is not None:
            found: CheckpointId | None = CheckpointId(step, timeline)
            found = found if found in listing else None
        else:
            found = next((c for c in listing if c.step == step), None)
        if found is None and self._unlisted:
            names = [t.name for t in self._tiers]
            what = f"{CheckpointId(step, timeline or 0)} is not committed"
            raise unreadable(self._unlisted, names, what, remedy=_REMEDY)
        if found is None:
            there = f"; the newest there: {listing[0]}" if listing else self._near(listing)
            raise CheckpointNotFound(
                f"DCP {CheckpointId(step, timeline or 0)} is not committed on any tier "
                f"({self._where()}){there}"
            )
        return found

    def _where(self) -> str:
        """The tiers and their locations, for an error."""
        return ", ".join(f"{t.name}: {redact(t.backend.url)}" for t in self._tiers)

    def _near(self, listing: list[CheckpointId]) -> str:
        """Where no checkpoint at all was found: the tier locations nearby, if any (a folder
        or prefix one level off; see ``tierckpt.checkpointer._near``)."""
        if listing:
            return ""
        rank = torch.distributed.get_rank() if _distributed() else 0
        return near_tiers(self._tiers, self._listed.keys(), rank)

    def _is_dcp(self, cid: CheckpointId) -> bool:
        """Whether ``cid`` is a DCP checkpoint (its metadata file is there), asked of the
        tiers whose listing holds it; True where none can tell, or where it was deleted since
        it was listed (its read says so: see read_metadata)."""
        for t in self._tiers:
            if cid not in self._listed.get(t.name, ()):
                continue
            b = t.backend
            try:
                if b.exists(dcp_metadata_name(cid.step, timeline=cid.timeline)):
                    return True
                return not b.exists(manifest_name(cid.step, timeline=cid.timeline))
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
        return True

    def _dcp_ids(self, ids: list[CheckpointId]) -> list[CheckpointId]:
        """``ids`` (newest first) without native checkpoints among the newest ones: checked
        until ``DCP_CHECKED`` DCP checkpoints are found; the older ones as they are."""
        out: list[CheckpointId] = []
        for i, c in enumerate(ids):
            if len(out) >= DCP_CHECKED:
                return out + ids[i:]
            if self._is_dcp(c):
                out.append(c)
        return out

    def _newest_id(self) -> CheckpointId:
        listed = self._listing()
        newest = self._dcp_ids(listed)
        import torch.distributed as dist

        if _distributed():
            # every rank must read the same checkpoint: the newest one every rank sees
            k = get_knobs().agree_max_candidates
            dev = collective_device()
            vec = torch.full((k,), -1, dtype=torch.int64, device=dev)
            if newest:
                keys = [checkpoint_key(c) for c in newest[:k]]
                vec[: len(keys)] = torch.tensor(keys, dtype=torch.int64)
            gathered = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, vec)
            common = set.intersection(*({int(v) for v in g.tolist() if v >= 0} for g in gathered))
            newest = sorted((checkpoint_of_key(v) for v in common), reverse=True)
        if not newest and self._unlisted:  # it may be on a tier that could not be listed
            names = [t.name for t in self._tiers]
            what = "no DCP checkpoint is committed"
            raise unreadable(self._unlisted, names, what, remedy=_REMEDY)
        if not newest:
            native = (
                f"; the checkpoints there ({len(listed)}, newest {listed[0]}) are native ones: "
                "load them with Checkpointer.load"
                if listed
                else ""
            )
            raise CheckpointNotFound(
                f"no committed {'DCP ' if listed else ''}checkpoint on any tier "
                f"({self._where()}){native}{self._near(listed)}"
            )
        return newest[0]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        sd = metadata.storage_data
        if not isinstance(sd, dict):
            raise FormatError("DCP metadata without storage_data")
        self.storage_data = sd

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_rank: dict[int, list[tuple[ReadItem, str]]] = {}
        for req in plan.items:
            loc = self.storage_data.get(req.storage_index)
            if loc is None:
                raise FormatError(f"DCP item {req.storage_index} has no storage location")
            per_rank.setdefault(loc.rank, []).append((req, loc.key))
        ranks = sorted(per_rank)
        # a stored tensor wanted whole, by one request, is read straight into its target
        targets = {r: _direct_targets(items, planner) for r, items in per_rank.items()}
        with ThreadPoolExecutor(self.io_threads, thread_name_prefix="tierckpt-dcp-read") as pool:
            # at most io_threads shards' tensors in memory; copies happen on this thread
            pending: list[tuple[int, CFuture[dict[str, torch.Tensor]]]] = []
            it = iter(ranks)
            for r in it:
                pending.append((r, pool.submit(self._fetch_rank, r, per_rank[r], targets[r])))
                if len(pending) >= self.io_threads:
                    break
            while pending:
                r, fut = pending.pop(0)
                values = fut.result()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append(
                        (nxt, pool.submit(self._fetch_rank, nxt, per_rank[nxt], targets[nxt]))
                    )
                _apply(per_rank[r], values, planner, targets.pop(r))
                del values
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _fetch_rank(
        self,
        rank: int,
        items: list[tuple[ReadItem, str]],
        targets: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        keys = [k for _, k in items]
        errors: list[str] = []
        for t, m in self._holders:
            try:
                return _ShardFile(t.backend, t.name, m.shard_for(rank)).fetch(keys, targets)
            except BaseException as exc:
                if not is_recoverable(exc):
                    raise
                errors.append(f"tier {t.name!r}: {exc}")
                log.warning(
                    "DCP read of rank %d's shard from tier %s failed, trying the next: %s",
                    rank,
                    t.name,
                    exc,
                )
        why = "; ".join(errors) or "no tier holds it"
        if self._holders and not any(_still_committed(t, m) for t, m in self._holders):
            # not damage: a writer's retention (keep_last) removed it after it was chosen
            names = ", ".join(repr(t.name) for t, _m in self._holders)
            raise CheckpointNotFound(
                f"DCP {self.loaded_id} was deleted from tier(s) {names} while it was being "
                "read (the retention of a writer that committed a newer checkpoint, e.g. "
                "keep_last): nothing is wrong with the stored checkpoints; load again to read "
                f"the newest ({why})"
            )
        raise CorruptCheckpoint(
            f"no readable copy of rank {rank}'s shard of {self.loaded_id}: {why}"
        )


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _still_committed(t: Tier, m: Manifest) -> bool:
    """Whether ``m``'s checkpoint is still committed on ``t`` (True where that cannot be told)."""
    try:
        return t.backend.exists(manifest_name(m.step, timeline=m.timeline))
    except Exception:
        return True


def _direct_targets(
    items: list[tuple[ReadItem, str]], planner: LoadPlanner
) -> dict[str, torch.Tensor]:
    """The destination tensors of stored tensors that one request reads whole: the fetch may
    fill them in place (see ``_ShardFile.fetch``)."""
    count: dict[str, int] = {}
    for _req, key in items:
        count[key] = count.get(key, 0) + 1
    out: dict[str, torch.Tensor] = {}
    for req, key in items:
        if req.type == LoadItemType.BYTE_IO or count[key] != 1:
            continue
        if any(req.storage_offsets) or any(req.dest_offsets):
            continue
        target = planner.resolve_tensor(req).detach()
        if list(target.shape) == list(req.lengths):
            out[key] = target
    return out


def _apply(
    items: list[tuple[ReadItem, str]],
    values: dict[str, torch.Tensor],
    planner: LoadPlanner,
    targets: dict[str, torch.Tensor] | None = None,
) -> None:
    from torch.distributed._shard._utils import narrow_tensor_by_index

    for req, key in items:
        value = values[key]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            continue
        target = targets.get(key) if targets is not None else None
        if target is not None and value is target:
            planner.commit_tensor(req, target)  # filled in place by the fetch
            continue
        src = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
        if target is None:
            target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise FormatError(
                f"DCP item {req.storage_index}: stored piece {tuple(src.size())} does not match "
                f"the target {tuple(target.size())}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)
