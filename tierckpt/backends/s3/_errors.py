"""How S3 fails, translated once: the error codes tierckpt tells apart and :class:`S3Error`."""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    ParamValidationError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from tierckpt.errors import BackendError

log = logging.getLogger("tierckpt.backends.s3")  # one logger for the whole backend

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
# the server refused If-None-Match itself (rather than the object)
_CONDITIONAL_REJECTED_CODES = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})


def _client_lacks_if_none_match(exc: ParamValidationError) -> bool:
    """Whether botocore refused ``IfNoneMatch`` itself, before sending anything.

    PutObject gained ``IfNoneMatch`` in botocore 1.35; an older client raises
    ``Unknown parameter in input: "IfNoneMatch"``. That says nothing about the server, but the
    header cannot be sent either way, so it counts as "conditional put not supported" and the
    HEAD-then-PUT fallback is used (upgrading boto3/botocore brings the atomic create back).
    """
    # exactly this parameter: the "must be one of: ..." list of a newer client names it too
    return 'Unknown parameter in input: "IfNoneMatch"' in str(exc)


_AUTH_CODES = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
)
# failures while streaming a response body: resumed by _get_range
_BODY_ERRORS: tuple[type[BaseException], ...] = (
    HTTPClientError,  # ReadTimeoutError, ResponseStreamingError, ConnectionClosedError
    BotoConnectionError,
    IncompleteReadError,
    OSError,
)


class S3Error(BackendError):
    """An S3 call failed after retries; ``code`` is the S3 error code (``SlowDown``, ...)."""

    def __init__(
        self, message: str, *, bucket: str = "", key: str = "", code: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.bucket = bucket
        self.key = key
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_s3_error, (str(self), self.bucket, self.key, self.code, self.status))


def _rebuild_s3_error(message: str, bucket: str, key: str, code: str, status: int) -> S3Error:
    return S3Error(message, bucket=bucket, key=key, code=code, status=status)


def _error_info(exc: ClientError) -> tuple[str, int, str]:
    err = exc.response.get("Error", {})
    meta = exc.response.get("ResponseMetadata", {})
    return str(err.get("Code", "")), int(meta.get("HTTPStatusCode", 0)), str(err.get("Message", ""))
