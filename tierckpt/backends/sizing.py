"""Part size and parts in flight of one multipart upload, chosen from the shard's size and the
host budget (docs/scale.md, section 6).

S3 allows at most 10,000 parts per object, each between 5 MiB and 5 GiB (the last one may be
smaller). A fixed 8 MiB part caps a shard at 80 GB, and the parts in flight cost host memory
(one buffer each) on top of the host arena. So, for each shard file:

- **part size**: the tier's ``part_size`` where given, else 8 MiB — raised, in both cases, to
  the smallest whole number of MiB that fits the shard's upper bound in 10,000 parts (a
  checkpoint that cannot be uploaded is worse than larger parts);
- **parts in flight**: the tier's ``max_concurrency`` where given, else as many as fit in a
  quarter of the host budget (``host_buffer_bytes``), at least 1 and at most the backend's
  ``max_concurrency`` (8 unless set: boto3's connection pool).

Both S3 drivers apply it, each writer from its ``size_hint`` before its first part: the boto3
backend (:mod:`tierckpt.backends.s3`) and the object-store driver
(:mod:`tierckpt.backends.objstore`, for ``s3://``, ``gs://`` and ``az://`` alike: GCS's XML
multipart API has the same 10,000 parts, Azure allows 50,000 blocks, so the rule is merely
conservative there). It lives here, outside both, so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AUTO_CONCURRENCY",
    "AUTO_PART_SIZE",
    "BUDGET_SHARE",
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "UploadSizing",
    "choose_upload",
    "parts_needed",
    "shard_size_bound",
]

MiB = 2**20
#: S3's limits on one multipart upload
MAX_PARTS = 10_000
MAX_PART_SIZE = 5 * 2**30
#: the part size when the tier sets none (s3transfer's and the AWS CRT's default)
AUTO_PART_SIZE = 8 * MiB
#: the most parts in flight per upload when the tier sets none (the connection pool's size)
AUTO_CONCURRENCY = 8
#: the share of the host budget one upload's part buffers may take
BUDGET_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class UploadSizing:
    """How one object is uploaded: ``part_size`` bytes a part, at most ``concurrency`` parts
    in flight (so ``concurrency * part_size`` bytes of part buffers)."""

    part_size: int
    concurrency: int

    @property
    def buffer_bytes(self) -> int:
        return self.part_size * self.concurrency


def shard_size_bound(data_bytes: int) -> int:
    """An upper bound of a shard file's size from its tensors' bytes: the codec's worst case
    (zstd and the byte-plane codecs add well under 1 %; raw adds nothing), chunk alignment
    and the index; 1/8 plus 64 MiB is generous, and only makes parts a little larger."""
    return data_bytes + data_bytes // 8 + 64 * MiB


def parts_needed(size: int, part_size: int) -> int:
    return max(1, -(-size // part_size))


def choose_upload(
    size_bound: int | None,
    host_budget: int | None,
    *,
    part_size: int | None = None,
    max_concurrency: int | None = None,
    pool: int = AUTO_CONCURRENCY,
) -> UploadSizing:
    """The part size and parts in flight for an object of at most ``size_bound`` bytes (None:
    unknown) on a host whose budget is ``host_budget`` bytes (None: unknown).

    ``part_size`` / ``max_concurrency``: the tier's settings (None: choose). The part size is
    never below the tier's (or 8 MiB) and always large enough for ``size_bound`` to fit in
    10,000 parts; without a set ``max_concurrency`` the parts in flight are bounded by a
    quarter of the host budget and by ``pool`` (the backend's connections).
    """
    base = part_size if part_size is not None else AUTO_PART_SIZE
    size = base
    if size_bound is not None and size_bound > base * MAX_PARTS:
        need = -(-size_bound // MAX_PARTS)
        size = min(MAX_PART_SIZE, -(-need // MiB) * MiB)
    if max_concurrency is not None:
        concurrency = max_concurrency
    else:
        concurrency = max(1, pool)
        if host_budget is not None:
            concurrency = max(1, min(concurrency, int(host_budget * BUDGET_SHARE) // size))
    return UploadSizing(size, concurrency)
