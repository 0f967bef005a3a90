"""How an object store fails, translated once: :class:`ObjectStoreError` and the mapping of
obstore's exceptions onto the error family (a missing object, a read past the end, the rest)."""

from __future__ import annotations

import functools
import random
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from tierckpt.backends._denied import AUTH_CODES, delete_denied_hint
from tierckpt.backends._throttle import throttled
from tierckpt.errors import BackendError, CheckpointNotFound, FormatError
from tierckpt.redact import redact, scrub_exception

_STATUS = re.compile(r"status code: (\d{3})")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>|\"reason\":\s*\"([A-Za-z ]+)\"")
_MISSING_CONTAINER = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
_CREDENTIAL_HINTS = {
    "s3": "check the credentials boto3 finds: env, AWS_PROFILE / ~/.aws, or an instance role",
    "gs": "check GOOGLE_APPLICATION_CREDENTIALS, gcloud's application default credentials or "
    "the instance's service account",
    "az": "check AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY / a SAS, or the "
    "identity (az login, workload or managed identity)",
}
_NO_CONTAINER_WORD = {"s3": "bucket", "gs": "bucket", "az": "container"}
#: the store's own code for a missing bucket, named in the message where the answer has none
_NO_CONTAINER_CODE = {"s3": "NoSuchBucket", "gs": "NoSuchBucket", "az": "ContainerNotFound"}
#: obstore's exception kinds for a create-only put that met an existing object
EXISTS_KINDS = ("AlreadyExistsError", "PreconditionError")


class ObjectStoreError(BackendError):
    """An object-store call failed after retries; ``status`` is the HTTP status (0: none),
    ``code`` the store's error code or the exception's kind."""

    def __init__(
        self, message: str, *, url: str = "", key: str = "", code: str = "", status: int = 0
    ) -> None:
        super().__init__(message)
        self.url = url
        self.key = key
        self.code = code
        self.status = status

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (str(self), self.url, self.key, self.code, self.status))


def _rebuild_error(message: str, url: str, key: str, code: str, status: int) -> ObjectStoreError:
    return ObjectStoreError(message, url=url, key=key, code=code, status=status)


def short(exc: BaseException) -> str:
    """obstore's message without its multi-line debug dump, credentials redacted."""
    text = str(exc).split("\n\nDebug source", 1)[0]
    return redact(" ".join(text.split()))


def statuses(exc: BaseException) -> list[str]:
    """The HTTP statuses an obstore error's message names."""
    return _STATUS.findall(str(exc))


def body_lost(exc: BaseException) -> bool:
    """Whether a call failed reading its response's body (headers came, the body was cut):
    object_store retries failed requests but not these, so the backend asks again."""
    text = str(exc)
    return "response body" in text or "request or response body error" in text


#: obstore's exception kinds that a second try cannot change
_FINAL_KINDS = frozenset(
    {
        "NotFoundError",
        "AlreadyExistsError",
        "PreconditionError",
        "PermissionDeniedError",
        "UnauthenticatedError",
        "NotSupportedError",
        "NotModifiedError",
        "InvalidPathError",
    }
)


def transient(exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` may succeed when sent again: what
    object_store's own retries cover (a 5xx or 429 answer, a connection that failed, timed out
    or dropped) plus a response body cut off mid-read. Used where the backend retries in Python
    (requests sent on its store without object_store's retries, so each attempt is seen)."""
    if not isinstance(exc, Exception) or type(exc).__name__ in _FINAL_KINDS:
        return False
    codes = statuses(exc)
    if codes:
        return any(c.startswith("5") or c == "429" for c in codes)
    return "HTTP error" in str(exc) or body_lost(exc)


#: a store that says it is overloaded (S3's 503 SlowDown, GCS's and Azure's 429 / 503)
_THROTTLED = ("429", "503")


def throttling(exc: BaseException) -> str:
    """The throttling answer ``exc`` names (``"503 SlowDown"``), or ``""``."""
    status = next((c for c in statuses(exc) if c in _THROTTLED), "")
    if not status:
        return ""
    cm = _CODE.search(str(exc))
    code = (cm.group(1) or cm.group(2) or "").replace(" ", "") if cm else ""
    return f"{status} {code}".strip()


def backoff(attempt: int, exc: BaseException | None = None, url: str = "") -> None:
    """Full-jitter exponential backoff before attempt ``attempt + 1`` (at most 2 s). After a
    store's throttling answer (``exc`` a 429 or 503: S3's SlowDown), longer and never near
    zero: half of 0.5 s x 2**(attempt - 1) and up to as much again, so that the default four
    attempts span about 2-4 s; before, they spent 0.1-0.7 s and a new node's restore failed on
    a throttling burst of under a second. ``url``: the backend's, told of the throttling
    (:func:`tierckpt.backends._throttle.throttled`: a WARNING now and then)."""
    answer = throttling(exc) if exc is not None else ""
    if answer:
        if url:
            throttled(url, answer)
        cap = min(20.0, 0.5 * 2 ** (attempt - 1))
        time.sleep(cap / 2 + random.random() * cap / 2)
        return
    time.sleep(random.random() * min(2.0, 0.05 * 2**attempt))


def translate(
    exc: BaseException, what: str, where: str, *, scheme: str, bucket: str, url: str
) -> BaseException:
    """The error family's exception for an obstore error on ``where`` (``scheme://bucket/key``);
    no credentials in it."""
    if isinstance(exc, (BackendError, FormatError, CheckpointNotFound)):
        return exc
    if is_panic(exc):
        return panic_error(exc, what, where, url)
    if not isinstance(exc, Exception):
        return exc  # KeyboardInterrupt and friends pass through
    scrub_exception(exc)
    text = short(exc)
    m = _STATUS.search(text)
    status = int(m.group(1)) if m else 0
    cm = _CODE.search(text)
    code = (cm.group(1) or cm.group(2) or "").replace(" ", "") if cm else ""
    key = where.split("/", 3)[3] if where.count("/") >= 3 else ""
    if any(s in text for s in _MISSING_CONTAINER):
        word = _NO_CONTAINER_WORD[scheme]
        code = code or _NO_CONTAINER_CODE[scheme]
        return ObjectStoreError(
            f"{where}: {what} failed: {code}: the {word} {bucket!r} does not exist ({status}): "
            f"create the {word} or check the URL",
            url=url,
            key=key,
            code=code,
            status=status,
        )
    if isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError":
        return CheckpointNotFound(f"{where} does not exist")
    if status == 416 or code == "InvalidRange" or "InvalidRangeRequest" in str(exc):
        return FormatError(f"{where}: {what}: range not satisfiable (read past the end)")
    hint = ""
    kind = type(exc).__name__
    if status in (429, 503):  # throttled to the last attempt (retried by object_store)
        throttled(url, f"{status} {code}".strip())
    denied = status == 403 or (not status and kind == "PermissionDeniedError")
    if denied and what == "delete" and code not in AUTH_CODES:
        # the credentials work (a 401 or an auth code would say otherwise): a permission
        hint = f" ({delete_denied_hint(scheme, url)})"
    elif status in (401, 403) or kind in ("PermissionDeniedError", "UnauthenticatedError"):
        hint = f" ({_CREDENTIAL_HINTS[scheme]})"
    elif not status:
        hint = _unanswered_hint(exc, text)
    return ObjectStoreError(
        f"{where}: {what} failed: {code or status or kind}: {text}{hint}",
        url=url,
        key=key,
        code=code or kind,
        status=status,
    )


#: rustls's errors (in obstore's debug text) when what answered a TLS handshake was no TLS:
#: an https:// endpoint whose server speaks plain HTTP
_NOT_TLS = ("InvalidContentType", "CorruptMessage", "InvalidMessage")
#: what obstore says where no answer came (no connection, a timeout, a connection dropped)
_NO_ANSWER = ("error sending request", "HTTP error", "timed out", "connection", "Connect")


def _unanswered_hint(exc: BaseException, text: str) -> str:
    """The hint for an error without an HTTP status: what the failure says about the
    endpoint (the suffix "check that the endpoint is reachable" only where nothing answered)."""
    full = str(exc)  # with obstore's debug text, where the TLS error's kind is named
    if "https://" in text and any(k in full for k in _NOT_TLS):
        return (
            " (a server answered, but not with TLS: the endpoint is https:// and the server "
            "there speaks plain HTTP; name it http://host:port, or enable TLS on the server)"
        )
    if "non-partial response" in text:
        return (
            " (the endpoint answered a ranged GET with the whole object: the server, or a "
            "proxy or gateway on the way to it, ignores the Range header; ranged reads need "
            "one that honours it)"
        )
    if any(k in text for k in _NO_ANSWER):
        return " (after retries: check that the endpoint is reachable)"
    return ""


def is_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a panic of obstore's Rust code: pyo3's ``PanicException``, a
    ``BaseException`` that ``except Exception`` (a training loop's, a tier thread's) misses."""
    return type(exc).__name__ == "PanicException" and not isinstance(exc, Exception)


def panic_error(exc: BaseException, what: str, where: str, url: str) -> ObjectStoreError:
    """The error family's exception for a panic of obstore's client (no retry can help)."""
    return ObjectStoreError(
        f"{where}: {what} failed: obstore's client panicked ({short(exc)}): it cannot use this "
        "store's settings (check endpoint_url, region and config=, or the store= given) or it "
        "met a bug; TIERCKPT_S3_DRIVER=boto3 uses the other S3 client",
        url=url,
        code="PanicException",
    )


_C = TypeVar("_C", bound=type)


def guard_panics(methods: Iterable[str]) -> Callable[[_C], _C]:
    """Class decorator: ``methods`` (the public calls of a backend, which has ``url``) raise
    :class:`ObjectStoreError` where obstore's client panicked inside them."""

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except BaseException as exc:
                if not is_panic(exc):
                    raise
                raise panic_error(exc, name, self.url, self.url) from None

        return guarded

    def decorate(cls: _C) -> _C:
        for name in methods:
            attr = getattr(cls, name)
            if isinstance(attr, property):  # a capability that asks the store
                assert attr.fget is not None and attr.fset is None
                setattr(cls, name, property(wrap(name, attr.fget), doc=attr.__doc__))
            else:
                setattr(cls, name, wrap(name, attr))
        return cls

    return decorate
