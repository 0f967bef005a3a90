"""S3 backend: AWS S3 and S3-compatible servers (MinIO, SeaweedFS, moto).

Writing a large object
    ``open_writer`` streams a multipart upload. Bytes are copied into a part buffer; each full
    part goes to the backend's small thread pool while the caller keeps writing. At most
    ``max_concurrency`` parts are in flight across the whole backend and ``write`` blocks beyond
    that (backpressure), so memory stays near ``(max_concurrency + open writers) * part_size``
    whatever the object size. Part buffers are reused (fresh memory is slow to touch). An object
    smaller than one part is a single PutObject. Any failure (a part that fails after retries,
    a failed completion, ``abort()``) aborts the multipart upload, so no parts are orphaned.

Small atomic objects
    ``put_atomic`` is one PutObject, create-only with ``If-None-Match: *`` where the server
    honours it. Whether it does is probed once (lazily) or configured; a server that ignores
    the header gets a best-effort HEAD-then-PUT instead.

Reading
    Ranged GETs; a read larger than one part is split into parallel ranged GETs that fill the
    caller's buffer in place. A response body cut off mid-stream is resumed from the first
    missing byte.

Retries and errors
    botocore's ``standard`` retry mode retries throttling (503 SlowDown), 5xx and connection
    errors, bounded by ``max_attempts`` (the first try included) and the connect/read timeouts,
    so a stalled connection times out. With the defaults (4 attempts, 5 s to connect, 15 s
    without a byte from the server) one call against a server that accepts connections and
    never answers gives up after about 4 x 15 s = 60 s (4 x 5 s = 20 s when nothing accepts
    connections); a call that is merely slow, but sends or receives bytes, is not cut off.
    Training never waits for that: the pipeline's ``save_deadline`` bounds it. Errors are
    translated once, here: ``NoSuchKey``/404 -> :class:`~tierckpt.errors.CheckpointNotFound`,
    unsatisfiable or short ranges -> :class:`~tierckpt.errors.FormatError`, everything else ->
    :class:`S3Error` (a :class:`~tierckpt.errors.BackendError` naming the bucket, key and S3
    error code). Credentials never appear in messages or logs: every message that holds an
    endpoint URL or a botocore error goes through :func:`tierckpt.redact.redact`
    (``http://KEY:SECRET@host`` becomes ``http://***@host``), the chained botocore exception is
    scrubbed the same way, and an ``s3://`` URL with credentials in it is refused.

Behind this module: ``_errors`` (the codes told apart, :class:`S3Error`), ``_client`` (the
boto3 client, its settings, the shared pool and part buffers, every call with its errors
translated), ``_writer`` (the multipart upload), ``_backend`` (:class:`S3Backend`).
"""

from __future__ import annotations

from tierckpt.backends.s3._backend import (
    S3Backend,
)
from tierckpt.backends.s3._client import (
    MIN_PART_SIZE,
)
from tierckpt.backends.s3._errors import (
    S3Error,
)

# importable from here before this module became a package; not public API (`as`: exported)
# isort: off
from tierckpt.backends.s3._client import (
    MAX_PARTS as MAX_PARTS,
    MAX_PART_SIZE as MAX_PART_SIZE,
    MiB as MiB,
)
from tierckpt.backends.base import PROBE_PREFIX as PROBE_PREFIX
from tierckpt.backends.s3._errors import (
    _client_lacks_if_none_match as _client_lacks_if_none_match,
)
# isort: on

__all__ = ["MIN_PART_SIZE", "S3Backend", "S3Error"]
