"""Keep credentials out of messages, logs and tracebacks.

Credentials reach tierckpt by mistake in two places: the userinfo of an endpoint URL
(``http://KEY:SECRET@host``, given as ``endpoint_url`` or through ``AWS_ENDPOINT_URL``, which
botocore then repeats in its errors, e.g. "Could not connect to the endpoint URL: ...") and
signing material in request text (``X-Amz-Security-Token=...``). :func:`redact` replaces both
with ``***`` in any text; every place that formats a URL or an S3 client error goes through
it, and :func:`scrub_exception` does the same to the messages of an exception's whole chain
(its ``__cause__`` / ``__context__``), so a printed traceback holds no secret either.
``s3://`` URLs never carry credentials: :func:`refuse_credentials` rejects them with a message
that points at the environment or a profile.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import urlsplit, urlunsplit

from tierckpt.errors import FormatError, chained

__all__ = [
    "redact",
    "warn_bucket_in_endpoint",
    "refuse_bad_endpoint",
    "refuse_bad_region",
    "refuse_control_characters",
    "refuse_credentials",
    "scrub_exception",
    "shown",
]

#: ``scheme://userinfo@``: everything between ``://`` and the last ``@`` of the URL token (a
#: secret may itself hold ``/`` or ``+``); over-redacting a rare ``@`` in a path is harmless
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s\"'<>@]+@")
#: signing secrets in query strings, headers or reprs of them
_SIGNING = re.compile(
    r"(?i)\b(x-amz-security-token|x-amz-signature|x-amz-credential|aws_secret_access_key|"
    r"aws_session_token|aws_access_key_id)(['\"]?\s*[=:]\s*['\"]?)[^&\s\"',;}]+"
)
_MASK = "***"


def redact(text: str) -> str:
    """``text`` with URL userinfo and signing secrets replaced by ``***``."""
    if "@" not in text and "amz" not in text.lower() and "aws_" not in text.lower():
        return text  # the common case, without running the patterns
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{_MASK}@", text)
    return _SIGNING.sub(lambda m: f"{m.group(1)}{m.group(2)}{_MASK}", text)


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message names it: its type and its repr, redacted and cut at
    ``limit`` characters (a state given where a step or a tier goes has a megabyte repr)."""
    text = redact(repr(value))
    return f"{type(value).__name__} {text[:limit]}{'...' if len(text) > limit else ''}"


def scrub_exception(exc: BaseException) -> BaseException:
    """Redact the string arguments of ``exc`` and of every exception chained to it, in place.

    botocore builds its messages from keyword arguments (``endpoint_url=...``) at
    construction, so both ``args`` and ``kwargs`` are cleaned. Returns ``exc``.
    """
    for e in chained(exc):
        try:
            if any(isinstance(a, str) and redact(a) != a for a in e.args):
                e.args = tuple(redact(a) if isinstance(a, str) else a for a in e.args)
            kwargs = getattr(e, "kwargs", None)
            if isinstance(kwargs, dict):
                for k, v in list(kwargs.items()):
                    if isinstance(v, str):
                        kwargs[k] = redact(v)
        except Exception:  # an exotic exception type: its message stays as it is
            pass
    return exc


def refuse_credentials(url: str) -> None:
    """Raise :class:`FormatError` if an ``s3://`` URL carries credentials (``user:pass@``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return
    netloc = rest.split("/", 1)[0]
    path = rest.split("?", 1)[0].split("#", 1)[0]
    # "KEY:SECRET@bucket", or a secret holding "/" that pushes the "@" past the first "/"
    if "@" in netloc or ("@" in path and ":" in netloc):
        raise FormatError(
            f"{redact(url)}: credentials do not belong in an {scheme}:// URL (they would end up "
            f"in logs and process listings); {_CREDENTIALS.get(scheme, _CREDENTIALS['http'])}"
        )


#: per URL scheme, where credentials go instead of the URL
_CREDENTIALS = {
    "s3": "give them through the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), a "
    "profile (AWS_PROFILE, ~/.aws/credentials) or an instance role, and use s3://bucket/prefix",
    "gs": "give them through Google's standard chain (GOOGLE_APPLICATION_CREDENTIALS, "
    "gcloud auth application-default login, or the instance's service account), and use "
    "gs://bucket/prefix",
    "az": "give them through Azure's standard chain (AZURE_STORAGE_ACCOUNT_NAME with "
    "AZURE_STORAGE_ACCOUNT_KEY or a SAS token, or a managed identity), and use "
    "az://container/prefix",
    "http": "give them through the store's own credentials (the environment, a profile or an "
    "instance role) and the endpoint as http(s)://host:port",
}


def refuse_bad_endpoint(endpoint: str, who: str = "endpoint_url") -> None:
    """Raise :class:`FormatError` unless ``endpoint`` is an ``http://`` or ``https://`` URL with
    a host: ``minio:9000`` (no scheme) made obstore's client panic at the first request (a
    ``PanicException``, which ``except Exception`` does not catch) and boto3 fail at its first;
    both are refused here, with the URL that was meant."""
    refuse_credentials(endpoint)
    odd = [c for c in endpoint if not 32 < ord(c) < 127]
    if odd:  # obstore's client panicked on a space in the path too
        raise FormatError(
            f"{who} {redact(endpoint)!r}: {odd[0]!r} does not belong in a URL (percent-encode it, "
            "or check what was pasted)"
        )
    try:
        parts = urlsplit(endpoint)
        host = parts.hostname
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError:
        host = None
    if parts.query or parts.fragment:
        raise FormatError(
            f"{who} {redact(endpoint)!r}: an endpoint takes no query or fragment; give the "
            "server's URL alone (https://host[:port][/path])"
        )
    if parts.scheme.lower() in ("http", "https") and host:
        return
    if endpoint and "://" not in endpoint and not re.match(r"[A-Za-z][\w+.-]*:/", endpoint):
        fix = f"{redact('https://' + endpoint)!r} (or {redact('http://' + endpoint)!r}"
    else:  # a scheme there, but not http(s) or not followed by a host
        fix = "https://host[:port] (or http://host[:port]"
    raise FormatError(
        f"{who} {redact(endpoint)!r} is not an http:// or https:// URL with a host; write "
        f"{fix} for a server without TLS)"
    )


def warn_bucket_in_endpoint(endpoint: str | None, bucket: str, url: str) -> None:
    """Warn where the path of ``endpoint`` ends with ``bucket`` (``http://host:9000/bucket``
    beside ``s3://bucket/run``): the client puts the bucket into every request's path again,
    so listings asked for another bucket or key ("manifests/ does not exist", "NoSuchKey")
    and some writes landed under ``bucket/run/`` inside the bucket; nothing was committed.
    A warning, not a refusal: a gateway may serve S3 under a path of the bucket's name."""
    if not endpoint:
        return
    try:
        parts = urlsplit(endpoint)
    except ValueError:
        return
    segments = [p for p in parts.path.split("/") if p]
    if not segments or segments[-1] != bucket:
        return
    meant = urlunsplit((parts.scheme, parts.netloc, "/".join(segments[:-1]), "", ""))
    logging.getLogger("tierckpt").warning(
        "%s: the endpoint %r ends with the bucket's name %r; the bucket belongs in the URL "
        "alone (the client adds it to each request's path again, so the requests miss the "
        "tier's objects): use endpoint_url=%r (or AWS_ENDPOINT_URL) unless your server serves "
        "S3 under that path",
        redact(url),
        redact(endpoint),
        bucket,
        redact(meant),
    )


def refuse_control_characters(url: str, who: str) -> None:
    """Raise :class:`FormatError` if ``url`` (a bucket URL) holds a control character: Python's
    URL parsing drops a newline or tab without a word (``s3://b/run\n2`` would write to
    ``run2``), and obstore refuses the others only at the first request, as an unreachable
    endpoint."""
    odd = [c for c in url if ord(c) < 32 or ord(c) == 127]
    if odd:
        raise FormatError(f"{who} {redact(url)!r}: control character {odd[0]!r} in the URL")


#: what botocore takes as a region name (obstore takes more, and signs with it)
_REGION = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?")


def refuse_bad_region(region: object) -> None:
    """Raise :class:`FormatError` unless ``region`` is a region name (``us-east-1``): obstore
    signed with ``"us east 1"`` and saved, while the boto3 client retention uses for open
    uploads refused it, so every retention pass failed and the bucket kept every checkpoint."""
    if not isinstance(region, str) or not _REGION.fullmatch(region):
        raise FormatError(
            f"region {region!r} is not a region name (letters, digits and '-', like us-east-1)"
        )
