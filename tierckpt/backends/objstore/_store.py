"""Where the bytes go: an object-store URL parsed, and the obstore store for it (S3, GCS or
Azure) with its credentials, endpoint, timeouts and retries (see the package docstring)."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from tierckpt import config as knobs
from tierckpt.backends.objstore._errors import ObjectStoreError, short
from tierckpt.errors import FormatError
from tierckpt.redact import redact, refuse_credentials, scrub_exception

#: the URL schemes this backend serves
SCHEMES = ("s3", "gs", "az")


def parse_url(url: str, prefix: str = "") -> tuple[str, str, str]:
    """``(scheme, bucket, key prefix)`` of ``s3://``, ``gs://`` or ``az://bucket/prefix``."""
    refuse_credentials(url)
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


def make_store(s: StoreSettings, extra: dict[str, Any]) -> Any:
    """The obstore store for ``s``; ``extra``: further obstore store settings."""
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
        "backoff": {
            "init_backoff": timedelta(milliseconds=50),
            "max_backoff": timedelta(seconds=2),
            "base": 2,
        },
    }
    try:
        if s.scheme == "s3":
            endpoint = knobs.s3_endpoint_url(s.endpoint_url)
            cfg, provider = _s3_credentials(s)
            if endpoint:
                refuse_credentials(endpoint)
                cfg["endpoint"] = endpoint
                client["allow_http"] = endpoint.startswith("http://")
            cfg["conditional_put"] = "etag"
            cfg.update(extra)
            return stores.S3Store(
                s.bucket,
                config=cfg,
                client_options=client,
                retry_config=retry,
                credential_provider=provider,
            )
        if s.scheme == "gs":
            cfg = {}
            endpoint = knobs.gcs_emulator_host(s.endpoint_url)
            if endpoint:
                if "://" not in endpoint:
                    endpoint = f"http://{endpoint}"
                refuse_credentials(endpoint)
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
            return stores.GCSStore(s.bucket, config=cfg, client_options=client, retry_config=retry)
        cfg = {}
        if s.endpoint_url:
            refuse_credentials(s.endpoint_url)
            cfg["endpoint"] = s.endpoint_url.rstrip("/")
            client["allow_http"] = s.endpoint_url.startswith("http://")
        cfg.update(extra)
        return stores.AzureStore(s.bucket, config=cfg, client_options=client, retry_config=retry)
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{s.url}: cannot configure the store: {short(exc)}") from None
    except ObjectStoreError:
        raise
    except Exception as exc:  # obstore's configuration errors
        scrub_exception(exc)
        raise ObjectStoreError(
            f"{s.url}: cannot configure the store: {short(exc)}",
            url=s.url,
            code=type(exc).__name__,
        ) from exc


def _s3_credentials(s: StoreSettings) -> tuple[dict[str, Any], Any]:
    """boto3's credential chain, as a provider obstore calls when credentials expire."""
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider

    session = boto3.session.Session()
    cfg: dict[str, Any] = {"region": s.region or session.region_name or "us-east-1"}
    if session.get_credentials() is None:
        raise ObjectStoreError(
            f"{s.url}: no AWS credentials found: set AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE (~/.aws) or run with an instance role "
            "(or pass config={'skip_signature': True} for a public bucket)",
            url=s.url,
            code="NoCredentials",
        )
    return cfg, Boto3CredentialProvider(session)
