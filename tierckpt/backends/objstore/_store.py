"""Where the bytes go: an object-store URL parsed, and the obstore store for it (S3, GCS or
Azure) with its credentials, endpoint, timeouts and retries (see the package docstring)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from tierckpt import config as knobs
from tierckpt.backends.objstore._direct import DirectReads, make_direct
from tierckpt.backends.objstore._errors import ObjectStoreError, short
from tierckpt.errors import FormatError
from tierckpt.redact import (
    redact,
    refuse_bad_endpoint,
    refuse_control_characters,
    refuse_credentials,
    scrub_exception,
    warn_bucket_in_endpoint,
)

#: the URL schemes this backend serves
SCHEMES = ("s3", "gs", "az")
#: obstore's names of S3's unsigned-payload setting. Over TLS (AWS, any ``https://`` endpoint)
#: an S3 store signs its requests but not their bodies (``UNSIGNED-PAYLOAD``, as the AWS SDKs do
#: over HTTPS): TLS already authenticates and checks every byte, and a signed body is hashed
#: with SHA-256 first (about 0.2 CPU s per 256 MiB: three quarters of the client's CPU of an
#: upload, measured on SeaweedFS). Over plain ``http://`` the signature is the body's only
#: protection in transit, so it is kept. ``config={"unsigned_payload": ...}`` decides instead.
UNSIGNED = frozenset({"unsigned_payload", "aws_unsigned_payload"})


def parse_url(url: str, prefix: str = "") -> tuple[str, str, str]:
    """``(scheme, bucket, key prefix)`` of ``s3://``, ``gs://`` or ``az://bucket/prefix``."""
    refuse_credentials(url)
    refuse_control_characters(f"{url}/{prefix}", "object-store URL")
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or "://" not in url:
        raise FormatError(
            f"invalid object-store URL {redact(url)!r}: use s3://bucket/prefix, "
            "gs://bucket/prefix or az://container/prefix"
        )
    if parts.query or parts.fragment:
        raise FormatError(f"invalid URL {redact(url)!r}: no query or fragment allowed")
    bucket = parts.netloc
    if not bucket or "/" in bucket:
        raise FormatError(f"invalid bucket in {redact(url)!r}")
    full = "/".join(p for p in (parts.path.strip("/"), prefix.strip("/")) if p)
    if full and any(c in ("", ".", "..") for c in full.split("/")):
        raise FormatError(f"invalid prefix {full!r} in {redact(url)!r}: empty, '.' or '..' parts")
    return parts.scheme, bucket, full


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """What a store is made from (the backend's constructor arguments)."""

    scheme: str
    bucket: str
    url: str  # for messages
    endpoint_url: str | None = None
    region: str | None = None
    max_attempts: int = 4
    connect_timeout: float = 5
    read_timeout: float = 15
    request_timeout: float = 600.0
    #: a named profile of the AWS config / credentials files (S3); None: the default chain
    profile: str | None = None
    #: connections the direct reads keep open (the backend's ranged GETs in flight)
    pool_size: int = 8


def make_stores(s: StoreSettings, extra: dict[str, Any]) -> tuple[Any, Any, DirectReads | None]:
    """The obstore stores for ``s`` (``extra``: further obstore store settings), sharing one
    configuration and credential provider: the first retries failed requests itself
    (object_store's retries: the data path, multipart parts and ranged reads); the second
    never does, for the single requests the backend retries in Python, where each attempt is
    seen (the CLI's wait line shows it) and a create-only put knows it was sent twice. The
    third: the direct ranged reads of an ``s3://`` store with the same endpoint and
    credentials (:mod:`._direct`; None where they do not apply)."""
    # typed as Any: obstore's TypedDict configs are checked by obstore at run time
    stores: Any = importlib.import_module("obstore.store")
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=s.connect_timeout),
        "read_timeout": timedelta(seconds=s.read_timeout),
        "timeout": timedelta(seconds=s.request_timeout),
        "pool_idle_timeout": timedelta(seconds=60),
    }
    retry: dict[str, Any] = {
        "max_retries": s.max_attempts - 1,
        "retry_timeout": timedelta(
            seconds=max(180.0, s.max_attempts * (s.connect_timeout + s.read_timeout) * 2)
        ),
        # this store's retries are object_store's, on uploads (parts, the completion, the
        # abort), where a failed answer is most often a store's throttling (S3's 503
        # SlowDown) and object_store cannot tell one from another: the throttling backoff
        # (object_store waits 0.25 s, then 0.25 s to three times its last wait, at most 2 s:
        # the defaults' four attempts span 0.75-3 s). From 50 ms doubling, the four attempts of
        # a CompleteMultipartUpload fell within 0.2 s of a throttling burst and the save failed.
        "backoff": {
            "init_backoff": timedelta(milliseconds=250),
            "max_backoff": timedelta(seconds=2),
            "base": 3,
        },
    }
    once = {**retry, "max_retries": 0}
    try:
        if s.scheme == "s3":
            endpoint = knobs.s3_endpoint_url(s.endpoint_url)
            cfg, provider = _s3_credentials(s)
            if endpoint:
                # AWS_ENDPOINT_URL(_S3) where no endpoint_url was given
                refuse_bad_endpoint(
                    endpoint, "endpoint_url" if s.endpoint_url else "AWS_ENDPOINT_URL"
                )
                warn_bucket_in_endpoint(endpoint, s.bucket, f"s3://{s.bucket}")
                cfg["endpoint"] = endpoint
                client["allow_http"] = endpoint.startswith("http://")
            cfg["conditional_put"] = "etag"
            if not (endpoint or "https://").startswith("http://") and not UNSIGNED & extra.keys():
                cfg["unsigned_payload"] = True  # over TLS (see UNSIGNED)
            direct = make_direct(
                s.bucket,
                endpoint,
                cfg["region"],
                provider,
                extra,
                connect_timeout=s.connect_timeout,
                read_timeout=s.read_timeout,
                request_timeout=s.request_timeout,
                pool_size=s.pool_size,
            )
            cfg.update(extra)
            store, once_store = (
                stores.S3Store(
                    s.bucket,
                    config=cfg,
                    client_options=client,
                    retry_config=r,
                    credential_provider=provider,
                )
                for r in (retry, once)
            )
            return store, once_store, direct
        if s.scheme == "gs":
            cfg = {}
            endpoint = knobs.gcs_emulator_host(s.endpoint_url)
            if endpoint:
                if "://" not in endpoint:
                    endpoint = f"http://{endpoint}"
                refuse_bad_endpoint(
                    endpoint, "endpoint_url" if s.endpoint_url else "STORAGE_EMULATOR_HOST"
                )
                # object_store's documented way to an emulator: a key naming the base URL,
                # with OAuth off
                cfg["service_account_key"] = json.dumps(
                    {
                        "gcs_base_url": endpoint.rstrip("/"),
                        "disable_oauth": True,
                        "client_email": "",
                        "private_key": "",
                        "private_key_id": "",
                    }
                )
                client["allow_http"] = endpoint.startswith("http://")
            cfg.update(extra)
            gcs, gcs_once = (
                stores.GCSStore(s.bucket, config=cfg, client_options=client, retry_config=r)
                for r in (retry, once)
            )
            return gcs, gcs_once, None
        cfg = {}
        if s.endpoint_url:
            refuse_bad_endpoint(s.endpoint_url)
            cfg["endpoint"] = s.endpoint_url.rstrip("/")
            client["allow_http"] = s.endpoint_url.startswith("http://")
        cfg.update(extra)
        az, az_once = (
            stores.AzureStore(s.bucket, config=cfg, client_options=client, retry_config=r)
            for r in (retry, once)
        )
        return az, az_once, None
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{s.url}: cannot configure the store: {short(exc)}") from None
    except (ObjectStoreError, FormatError):
        raise
    except Exception as exc:  # obstore's configuration errors
        scrub_exception(exc)
        hint = ""
        if "Account must be specified" in str(exc):
            hint = (
                ": an Azure storage account is needed: set AZURE_STORAGE_ACCOUNT_NAME (and a "
                "key, SAS or identity), or pass endpoint_url= naming the account's endpoint"
            )
        raise ObjectStoreError(
            f"{s.url}: cannot configure the store: {short(exc)}{hint}",
            url=s.url,
            code=type(exc).__name__,
        ) from exc


def _env_credentials(s: StoreSettings) -> tuple[dict[str, Any], Any] | None:
    """Static keys from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (and
    ``AWS_SESSION_TOKEN``) with a region from ``region=``, ``AWS_DEFAULT_REGION`` or
    ``AWS_REGION``, without importing boto3 (about 0.3 s of every fresh process); None
    where boto3's chain must decide: a profile (``profile=``, where botocore ignores the
    environment's keys, or ``AWS_PROFILE``, which must then exist), no keys in the environment,
    or no region there (the profile's region applies)."""
    env = knobs.aws_environment()
    key, secret = env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"]
    region = s.region or env["AWS_DEFAULT_REGION"] or env["AWS_REGION"]
    if s.profile is not None or env["AWS_PROFILE"] or not key or not secret or not region:
        return None
    # the environment's keys come first in botocore's chain too
    return {"region": region}, StaticCredentials(key, secret, env["AWS_SESSION_TOKEN"])


def _s3_credentials(s: StoreSettings) -> tuple[dict[str, Any], Any]:
    """The environment's static keys (:func:`_env_credentials`), else boto3's credential chain
    (``profile``: that profile of the AWS config and credentials files, else ``AWS_PROFILE`` /
    the default chain), as a provider obstore calls when the credentials it holds expire; the
    region from ``region=``, else the environment's / the profile's, else boto3's."""
    from_env = _env_credentials(s)
    if from_env is not None:
        return from_env
    import boto3
    from botocore.exceptions import ProfileNotFound

    try:
        session = boto3.session.Session(profile_name=s.profile)
    except ProfileNotFound as exc:
        raise FormatError(
            f"S3 client for {s.url}: {exc}; name a profile of ~/.aws/config or "
            "~/.aws/credentials, or leave profile unset to use the default chain"
        ) from None
    cfg: dict[str, Any] = {"region": s.region or session.region_name or "us-east-1"}
    credentials = session.get_credentials()
    if credentials is None:
        where = f" in the profile {s.profile!r}" if s.profile else ""
        raise ObjectStoreError(
            f"{s.url}: no AWS credentials found{where}: set AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE (~/.aws) or run with an instance role "
            "(or pass config={'skip_signature': True} for a public bucket)",
            url=s.url,
            code="NoCredentials",
        )
    return cfg, BotocoreCredentials(credentials)


class BotocoreCredentials:
    """obstore's credential provider over botocore's credentials (static keys, a profile, SSO,
    assumed roles, container and instance roles). Refreshable credentials are handed out for
    at most :attr:`REFRESHABLE_TTL` and never past their own expiry, so obstore asks again in
    time and botocore refreshes them (obstore's own boto3 provider keeps each for 30 min,
    longer than some roles' credentials live)."""

    #: how long obstore may keep credentials that botocore refreshes
    REFRESHABLE_TTL = timedelta(minutes=5)
    #: how long obstore may keep static keys (they never expire; asked again now and then)
    STATIC_TTL = timedelta(hours=12)

    def __init__(self, credentials: Any) -> None:
        self._credentials = credentials

    def __call__(self) -> dict[str, Any]:
        frozen = self._credentials.get_frozen_credentials()
        now = datetime.now(UTC)
        expiry = getattr(self._credentials, "_expiry_time", None)
        if hasattr(self._credentials, "refresh_needed"):  # botocore's RefreshableCredentials
            expires_at = now + self.REFRESHABLE_TTL
            if isinstance(expiry, datetime):
                expires_at = min(expires_at, expiry.astimezone(UTC))
        else:
            expires_at = now + self.STATIC_TTL
        return {
            "access_key_id": frozen.access_key,
            "secret_access_key": frozen.secret_key,
            "token": frozen.token,
            "expires_at": expires_at,
        }


class StaticCredentials:
    """obstore's credential provider over fixed keys (the environment's): handed out for
    :attr:`BotocoreCredentials.STATIC_TTL`, as botocore's static keys are."""

    def __init__(self, key: str, secret: str, token: str | None) -> None:
        self._creds = {"access_key_id": key, "secret_access_key": secret, "token": token}

    def __call__(self) -> dict[str, Any]:
        return {**self._creds, "expires_at": datetime.now(UTC) + BotocoreCredentials.STATIC_TTL}
