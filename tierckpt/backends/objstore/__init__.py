"""Object-store backend on obstore (the Rust ``object_store`` crate): S3, Google Cloud Storage
and Azure Blob Storage behind one driver.

URLs
    ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``. The same
    :class:`~tierckpt.backends.base.Backend` contract and shared test suite as the boto3
    backend (:mod:`tierckpt.backends.s3`); the bytes move in Rust, off the GIL.

Credentials (each cloud's standard chain, never in the URL)
    ``s3://``: boto3's chain (environment, ``AWS_PROFILE`` / ``~/.aws``, SSO, container and
    instance roles; ``profile=`` names a profile of the AWS config and credentials files),
    handed to obstore, so both S3 drivers find the same credentials: refreshable ones (roles,
    SSO) are handed out for at most 5 minutes and never past their expiry, so botocore
    refreshes them in time; region from ``region=``, else the profile's / boto3's.
    Endpoint: ``endpoint_url=``, else ``AWS_ENDPOINT_URL_S3`` /
    ``AWS_ENDPOINT_URL`` (S3-compatible servers). ``gs://``: object_store's chain
    (``GOOGLE_SERVICE_ACCOUNT`` / ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's application default
    credentials, the metadata server); ``endpoint_url=`` or ``STORAGE_EMULATOR_HOST`` points it at
    an emulator (no OAuth then). ``az://``: object_store's chain (``AZURE_STORAGE_ACCOUNT_NAME``
    with ``AZURE_STORAGE_ACCOUNT_KEY`` / a SAS / a client secret, workload or managed identity,
    the Azure CLI); ``endpoint_url=`` names the account's blob endpoint (Azurite:
    ``http://127.0.0.1:10000/devstoreaccount1``). ``config=`` passes any further obstore store
    setting (``S3Config`` / ``GCSConfig`` / ``AzureConfig`` keys).

Writing a large object
    ``open_writer`` streams into obstore's buffered writer: an object up to ``part_size`` is one
    PUT, a larger one a multipart upload (S3, GCS) or staged blocks (Azure) of ``part_size``
    parts, ``max_concurrency`` of them in flight per writer; ``write`` blocks beyond that. Each
    write's bytes are copied once on the way in (obstore would otherwise hold the caller's
    buffer until its part is sent, and the pipeline reuses arena slots as soon as ``write``
    returns). ``abort()`` aborts the multipart upload.

Small atomic objects
    ``put_atomic`` is one PUT; create-only ones use the store's conditional create (S3
    ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure ``If-None-Match: *``). For S3 the
    server's support is probed once, lazily, as the boto3 backend does; a server that ignores
    the header gets the same best-effort HEAD-then-PUT. A create is sent without
    object_store's retries and retried here, so a create sent again after a failed attempt
    (which may have landed) that then meets the object compares the object with its own bytes:
    the same bytes are its own first attempt, and it succeeds.

Reading
    ``read_into`` splits a read larger than one part into ``part_size`` ranges fetched
    concurrently (obstore ``get_ranges``, ``max_concurrency`` at a time) and copies each into the
    caller's buffer; a failed or short batch is fetched again, up to ``max_attempts`` times.
    The ranges in flight across every read of a backend stay within ``read_concurrency``: the
    rank's share of its node's connections (``TIERCKPT_NODE_S3_CONNECTIONS`` //
    ``LOCAL_WORLD_SIZE``), as on the boto3 backend. A read of one part (a load's data reads)
    from ``s3://`` is received off the socket straight into the caller's memory by signed
    ``http.client`` GETs (``_direct``; ``TIERCKPT_S3_DIRECT_READS=0``: through obstore), with
    obstore making any attempt they cannot use.

Retries, timeouts, errors
    The boto3 backend's defaults: 4 attempts (the first included), 5 s to connect, 15 s without
    a byte read from the server (``read_timeout``); a request that keeps moving bytes is cut off
    only after ``request_timeout`` (10 min). Multipart parts and ranged reads are retried by
    object_store; single requests (HEAD, GET, LIST, DELETE, small PUTs) are sent on a second
    store without object_store's retries and retried here with the same backoff, so that each
    failed attempt is seen: ``watch_retries`` tells a listener (the CLI's wait line shows
    ``retrying: attempt 3 of 4``). Errors are translated here, once: a missing object ->
    :class:`~tierckpt.errors.CheckpointNotFound`, an unsatisfiable or short range ->
    :class:`~tierckpt.errors.FormatError`, everything else -> :class:`ObjectStoreError` (a
    :class:`~tierckpt.errors.BackendError` naming the URL, the HTTP status and what to do).
    Messages go through :func:`tierckpt.redact.redact`.

Leftovers
    ``incomplete`` / ``cleanup_incomplete`` list and abort open multipart uploads on ``s3://``
    (through boto3: obstore has no call for it). GCS and Azure have none to list from here:
    Azure drops uncommitted blocks after 7 days; give a GCS bucket a lifecycle rule that
    aborts incomplete multipart uploads.

Behind this package: ``_errors`` (:class:`ObjectStoreError`, the translation of obstore's
exceptions), ``_store`` (URLs, the obstore store with its credentials, endpoint, timeouts and
retries), ``_writer`` (the streamed upload), ``_reads`` (reads that save round trips and
copies), ``_direct`` (ranged GETs received straight into place), ``_backend``
(:class:`ObjectStoreBackend`). The ranged-read loop is shared with the boto3 backend
(:func:`tierckpt.backends.base.read_in_ranges`).
"""

from __future__ import annotations

from tierckpt.backends.objstore._backend import (
    MIN_PART_SIZE,
    REQUEST_TIMEOUT_S,
    ObjectStoreBackend,
)
from tierckpt.backends.objstore._errors import ObjectStoreError
from tierckpt.backends.objstore._listing import PROBE_PREFIX
from tierckpt.backends.objstore._store import SCHEMES, parse_url

__all__ = [
    "MIN_PART_SIZE",
    "PROBE_PREFIX",
    "REQUEST_TIMEOUT_S",
    "SCHEMES",
    "ObjectStoreBackend",
    "ObjectStoreError",
    "parse_url",
]
